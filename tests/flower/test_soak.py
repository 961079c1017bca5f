"""Sites and a SuperLink that die mid-run, and the same run in process (issue 39, item 5).

A site killed and restarted, and the SuperLink killed and restarted with the run resumed,
each at a round boundary that the test reads from the run's ``status.json`` (never a clock):
every round must be accounted for in the run's files (an answer, a refused reply or a
recorded absence for every client of every exchange), and the in-process run with the
absences the Flower run recorded (``fl.absences``, :mod:`medfl.flower.replay`) must give the
same ``metrics.csv`` and ``train_metrics.csv``. ``benchmarks/flower_soak.py`` is the long
version (5 sites, 30+ rounds). The schedule itself (``fl.absences``) is checked in process
and over the loop-back transport first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.config import ConfigError, resolve_config  # noqa: E402
from medfl.engine.runner import RunError, build_source  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.replay import account_rounds, max_difference, recorded_absences, replay_in_process  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402

from flower_cases import FEDAVG, fl_config, numeric_equal, write_config  # noqa: E402
from local_federation import LocalFederation  # noqa: E402
from soak import Disruption, random_plan, soak  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402

#: FedAvg evaluated every round: every round has a train and an evaluate exchange to account for
JOB: dict[str, Any] = {**FEDAVG, "rounds": 6, "eval_every": 1}


@pytest.mark.parametrize("absences, match", [
    ({"0": ["1"]}, r"fl.absences: round '0': expected a round number from 1 to fl.rounds \(6\)"),
    ({"7": ["1"]}, r"round '7': expected a round number from 1 to fl.rounds \(6\)"),
    ({"x": ["1"]}, "round 'x'"),
    (["1"], r"fl.absences: expected null or \{round: \[client ids\]\}"),
    ({"2": "1"}, r"fl.absences\[2\]: expected a list of client ids or \{phase: \[client ids\]\}"),
    ({"2": {"score": ["1"]}}, r"fl.absences\[2\]: unknown exchange\(s\) \['score'\]; valid: train, validate, evaluate"),
    ({"2": {"train": [1.5]}}, r"fl.absences\[2\].train: expected a list of client ids"),
    ({"2": ["1", 1]}, r"fl.absences\[2\].train: a client is listed twice"),
])
def test_a_bad_absence_schedule_is_refused_by_name(tmp_path: Path, absences: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_config(fl_config(tmp_path, "bad", {**JOB, "absences": absences}))


def test_an_absent_client_id_must_be_in_the_partition(tmp_path: Path) -> None:
    cfg = resolve_config(fl_config(tmp_path, "unknown", {**JOB, "absences": {"2": {"evaluate": ["7"]}}}))
    with pytest.raises(RunError, match=r"fl.absences\[2\].evaluate: client\(s\) \['7'\] are not in this run's "
                                       r"partition \(clients 0, 1, 2\)"):
        run_experiment(cfg)


def test_scheduled_absences_leave_the_client_out_of_those_exchanges_in_process(tmp_path: Path) -> None:
    """Client 1 misses all of round 2 and only the evaluation of round 3: no row of it there,
    the others' rows as without the schedule in round 2's training, and it trains again."""
    job = {**JOB, "rounds": 3, "absences": {"2": ["1"], "3": {"evaluate": ["1"]}}}
    out = Path(run_experiment(resolve_config(fl_config(tmp_path, "sched", job)))["dir"]) / "fedavg"
    train = pd.read_csv(out / "train_metrics.csv", dtype={"client_id": str})
    metrics = pd.read_csv(out / "metrics.csv", dtype={"client_id": str})
    trained = {r: set(g["client_id"]) for r, g in train.groupby("round")}
    evaluated = {r: set(g["client_id"]) for r, g in metrics.groupby("round")}
    assert trained == {1: {"0", "1", "2"}, 2: {"0", "2"}, 3: {"0", "1", "2"}}
    assert evaluated == {1: {"0", "1", "2"}, 2: {"0", "2"}, 3: {"0", "2"}}
    full = Path(run_experiment(resolve_config(fl_config(tmp_path, "full", {**job, "absences": None})))["dir"]) / "fedavg"
    rows = pd.read_csv(full / "train_metrics.csv", dtype={"client_id": str})
    numeric_equal(rows[rows["round"] == 1], train[train["round"] == 1], "round 1, before any absence")
    m = pd.read_csv(full / "metrics.csv", dtype={"client_id": str})
    assert not m[m["round"] == 2].reset_index(drop=True).equals(metrics[metrics["round"] == 2].reset_index(drop=True))


def test_absences_over_the_grid_are_recorded_and_replay_in_process(tmp_path: Path) -> None:
    """Over the loop-back transport site 1 never answers round 2's training and site 2 is gone for
    round 3's evaluation, and a third absence is scheduled: the run records each, accounts
    for every round, and the in-process run with the recorded absences is the same run."""
    job = {**JOB, "rounds": 4, "absences": {"4": {"train": ["0"]}}}
    fl = fl_config(tmp_path, "grid", job)

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        if (node, kind, ctl.get("round")) in ((102, P.TRAIN, 2), (103, P.EVALUATE, 3)):
            return "silent" if node == 102 else "unavailable"
        return "ok"

    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl), rule=rule), FAST)
    run_dir = Path(out["dir"]) / "fedavg"
    assert recorded_absences(run_dir) == {"2": {"train": ["1"]}, "3": {"evaluate": ["2"]}, "4": {"train": ["0"]}}
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str})
    assert "absent (scheduled)" in set(events[events["client_id"] == "0"]["status"])
    acc = account_rounds(run_dir)
    assert acc.problems == [] and (acc.rounds, acc.absences, acc.trained, acc.evaluated) == (4, 3, 10, 11)
    replay = replay_in_process(run_dir, tmp_path / "replay")
    assert json.loads((replay / "config.json").read_text())["fl"]["absences"]["3"]["evaluate"] == ["2"]
    assert max_difference(run_dir, replay) == 0.0


def test_unaccounted_rounds_are_named(tmp_path: Path) -> None:
    """A training row deleted from a finished run is found missing, by round and client."""
    fl = fl_config(tmp_path, "gap", {**JOB, "rounds": 2})
    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)
    run_dir = Path(out["dir"]) / "fedavg"
    assert account_rounds(run_dir).problems == []
    train = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    train[~((train["round"] == 2) & (train["client_id"] == "1"))].to_csv(run_dir / "train_metrics.csv", index=False)
    assert account_rounds(run_dir).problems == [
        "round 2, train, client 1: neither answered, refused nor recorded absent"]


def test_random_plan_never_takes_the_superlink_down_while_a_site_is_down() -> None:
    plan = random_plan(32, ["0", "1", "2", "3", "4"], seed=3, every=3, down=2)
    link = [d.after_round for d in plan if d.action == "superlink"]
    assert link == [16]
    sites = [d for d in plan if d.action == "site"]
    assert len(sites) >= 7 and all(d.after_round + d.down < 32 for d in sites)
    assert not any(d.after_round <= 16 <= d.after_round + d.down + 1 for d in sites)
    assert plan == random_plan(32, ["0", "1", "2", "3", "4"], seed=3, every=3, down=2)    # seeded


def test_a_site_and_the_superlink_killed_mid_run_give_the_in_process_numbers(tmp_path: Path) -> None:
    """Real Flower processes: site 2 killed (SIGKILL) after round 1 and started again two
    rounds later; the SuperLink killed (SIGKILL) after round 3 (or once site 2 is back),
    started again on its database, and the run resumed. Every round accounted for, site 2's
    absence recorded, the in-process run with the recorded absences equal. Four rounds: the
    resumed run has round 4 left. A killed site's message is answered by Flower's
    NODE_UNAVAILABLE once its heartbeat lapses (about 60 s), and each exchange costs Flower
    9-10 s, so this takes 3 minutes."""
    job = {**JOB, "rounds": 4}
    site_cfg = write_config(tmp_path / "site.json", fl_config(tmp_path, "site", job))
    build_source(resolve_config(fl_config(tmp_path, "site", job))["dataset"])   # the data, once
    cfg_file = write_config(tmp_path / "job.json", fl_config(tmp_path, "job", job))
    run_dir = tmp_path / "runs" / "job" / "fedavg"
    fed = LocalFederation(tmp_path / "fed")
    plan = [Disruption(after_round=1, action="site", client_id="2", down=2),
            Disruption(after_round=3, action="superlink")]
    try:
        database = tmp_path / "superlink.db"
        fed.start_superlink(database=str(database))
        for cid in ("0", "1", "2"):
            fed.start_site(cid, site_cfg, wait=False)
        fed.wait_for_nodes(3)
        # generous: an honest site never times out, even on a loaded machine
        done = soak(fed, cfg_file, run_dir, plan, site_config=site_cfg, database=database, round_timeout=90.0,
                    timeout=1500.0)
    finally:
        fed.close()
        assert fed.stray_processes() == [], "processes of the federation left running"
    assert done.ok, done.runs
    assert not done.runs[0].get("ok"), "the first run cannot have finished without its SuperLink"
    killed, link = plan[0].applied_at, plan[1].applied_at
    assert killed is not None and link is not None and link >= killed + 2, plan
    sessions = json.loads((run_dir / "flower.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [0, link], sessions
    acc = account_rounds(run_dir)
    assert acc.problems == [] and acc.rounds == job["rounds"], acc
    absences = recorded_absences(run_dir)
    assert "2" in absences[str(killed + 2)]["train"], (plan, absences)     # down for that whole round
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str, "session": str})
    hellos = events[(events["phase"] == "hello") & (events["client_id"] == "2") & (events["status"] == "joined")]
    first, resumed = (hellos[hellos["session"] == s["session"]]["node_id"] for s in sessions)
    assert len(resumed) and not set(resumed) & set(first), hellos       # it came back as a new SuperNode
    replay = replay_in_process(run_dir, tmp_path / "replay")
    assert max_difference(run_dir, replay) <= 1e-5
