"""Each method scored where its own mechanism acts (issue 48, item 1): the engine asks
:meth:`medfl.method.Method.scored_from` after every round; early stopping chooses its best
round among the rounds from it on (earlier rounds are recorded, never the best, never count
toward patience), the answer travels in checkpoints, is written to ``mechanisms.csv`` for a
method that declares it and to the summary's ``selection`` block; FedFed is scored from its
release round (the first trained with the shared set)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest

from medfl.arm_report import arm_scores
from medfl.config import resolve_config
from medfl.engine.early_stopping import EarlyStopping
from medfl.experiment import resume, run_experiment
from medfl.rundir import RunError
from contract_methods import NoisedFrom, methods_registered

METHOD = "test_noised_from"
EARLY = {"metric": "val/micro_f1", "patience": 2}


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    with methods_registered(NoisedFrom, name="scored-from-test"):
        yield


def _rows(value: float | None) -> list[dict[str, Any]]:
    v = float("nan") if value is None else value
    return [{"split": "local_val", "micro_f1": v}, {"split": "local_val", "micro_f1": v}]


# ------------------------------------------------------------------ the rule
def test_rounds_before_scored_from_are_recorded_but_never_best_and_never_count():
    values = [0.9, 0.5, 0.6, 0.55, 0.58, 0.4]
    answers = [None, None, 3, 3, 3, 3]          # the mechanism acts from round 3, known after it
    es = EarlyStopping("val/micro_f1", patience=3)
    stops = [es.observe(r, _rows(v), rounds=10, scored_from=s) for r, (v, s) in enumerate(zip(values, answers), 1)]
    # rounds 1-2 are in the curve but round 1 (0.9) is not the best; the wait counts 4, 5, 6 only
    assert [e["value"] for e in es.curve] == values
    assert [e["best_round"] for e in es.curve] == [None, None, 3, 3, 3, 3]
    assert [e["wait"] for e in es.curve] == [0, 0, 0, 1, 2, 3]
    assert stops == [False] * 5 + [True] and es.stopped_at == 6
    assert (es.best_round, es.best_value, es.overall_best_round, es.overall_best_value) == (3, 0.6, 1, 0.9)
    # the old rule would have stopped after round 4 with round 1 as the best
    plain = EarlyStopping("val/micro_f1", patience=3)
    assert [plain.observe(r, _rows(v), rounds=10) for r, v in enumerate(values[:4], 1)] == [False] * 3 + [True]
    assert plain.best_round == 1 and plain.overall_best_round == 1
    # the state survives a checkpoint at every round: a resumed run decides exactly the same
    for k in range(1, len(values)):
        part = EarlyStopping("val/micro_f1", patience=3)
        for r in range(1, k + 1):
            part.observe(r, _rows(values[r - 1]), rounds=10, scored_from=answers[r - 1])
        again = EarlyStopping("val/micro_f1", patience=3)
        again.load_state_dict(json.loads(json.dumps(part.state_dict())))
        for r in range(k + 1, len(values) + 1):
            again.observe(r, _rows(values[r - 1]), rounds=10, scored_from=answers[r - 1])
        assert again == es, k
    summary = es.summary(10, 6, "checkpoints/round_0003.pt")
    assert (summary["scored_from"], summary["best_round"], summary["overall_best_round"]) == (3, 3, 1)
    assert es.restriction() == (" among rounds >= 3; overall best round 1 (0.9), before the method's "
                                "mechanism acts")
    # while the answer is None no round is the best and nothing stops the run
    stage1 = EarlyStopping("val/micro_f1", patience=1)
    assert not any(stage1.observe(r, _rows(1.0 / r), rounds=10, scored_from=None) for r in range(1, 6))
    assert stage1.best_round is None and stage1.overall_best_round == 1
    # a checkpoint written before scored_from existed: every round counted
    old = EarlyStopping("val/micro_f1", patience=3)
    old.load_state_dict({"curve": [], "best_round": 2, "best_value": 0.5, "wait": 1, "stopped_at": None})
    assert (old.scored_from, old.overall_best_round, old.overall_best_value) == (1, 2, 0.5)


# ------------------------------------------------------------------ a run
def _job(tiny_fl: dict[str, Any], name: str, entry: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {**tiny_fl, "name": name, "rounds": 6, "eval_splits": ["val", "test", "global_test"],
            "early_stopping": dict(EARLY), "methods": [entry or {"name": METHOD}], **extra}


def _expected(metrics: pd.DataFrame, first: int | None, patience: int, rounds: int) -> tuple[int | None, int | None]:
    """The best round among the rounds from ``first`` on, and the stop round, from metrics.csv alone."""
    val = {int(r): float(np.mean(g["micro_f1"].dropna())) for r, g in
           metrics[metrics["split"] == "local_val"].groupby("round")}
    best, best_value, wait = None, -math.inf, 0
    for r, v in val.items():
        if first is None or r < first:
            continue
        if v > best_value:
            best, best_value, wait = r, v, 0
        else:
            wait += 1
        if wait >= patience and r < rounds:
            return best, r
    return best, None


def _summary(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s_last_session")
    return s


def test_a_run_chooses_its_best_round_from_scored_from_on_and_records_it(tiny_fl, capsys):
    run_dir = Path(run_experiment(resolve_config(_job(tiny_fl, "sel")))["dir"]) / METHOD
    metrics = pd.read_csv(run_dir / "metrics.csv", dtype={"client_id": str})
    s = _summary(run_dir)
    es, sel = s["early_stopping"], s["selection"]
    best, stop = _expected(metrics, 3, EARLY["patience"], 6)
    overall, _ = _expected(metrics, 1, 10 ** 6, 6)
    assert overall < 3, "the noise from round 3 on must make an earlier round the overall best for this test"
    assert (es["best_round"], es["stopped_at_round"], es["scored_from"]) == (best, stop, 3)
    assert (es["overall_best_round"], sel["overall_best_round"]) == (overall, overall)
    assert sel["scored_from"] == 3 and sel["declared"] is True and sel["best_round"] == best >= 3
    assert sel["reported_round"] == best and s["final"]["round"] == best
    assert sel["note"].startswith(f"best round {best} among rounds >= 3; overall best round {overall} (")
    assert sel["note"].endswith("), before the method's mechanism acts")
    # mechanisms.csv: the answer after every round (empty: not yet), for an unfinished run's reader
    mech = pd.read_csv(run_dir / "mechanisms.csv")
    row = mech[(mech["mechanism"] == "selection") & (mech["name"] == "scored_from")]
    assert row["scope"].eq("run").all() and row["round"].tolist() == list(range(1, int(metrics["round"].max()) + 1))
    assert row["value"].isna().tolist()[:2] == [True, True] and (row["value"].iloc[2:] == 3).all()
    # arm_report reads the same round, and flags the overall best
    scored = arm_scores(run_dir)
    assert scored["rounds"] == [best] and scored["scored_from"] == 3 and scored["overall_best"] == overall
    assert scored["flag"] == f"overall best {overall}, before the mechanism acts"
    assert f"best round {best}" in capsys.readouterr().err or stop is None


def test_a_run_resumed_in_and_after_the_first_stage_decides_as_an_uninterrupted_one(tiny_fl):
    full = Path(run_experiment(resolve_config(_job(tiny_fl, "full")))["dir"]) / METHOD
    for when in (2, 4):
        part = run_experiment(resolve_config(_job(tiny_fl, f"part{when}", stop_after_round=when)))
        run_dir = Path(part["dir"]) / METHOD
        assert json.loads((run_dir / "status.json").read_text())["last_round"] == when
        # an unfinished run: arm_report reads scored_from from mechanisms.csv (not yet after round 2)
        scored = arm_scores(run_dir)
        assert scored["scored_from"] == (None if when == 2 else 3)
        if when == 2:
            assert scored["flag"] == "the method's mechanism acted in no evaluated round"
        resume(part["dir"])
        assert _summary(run_dir) == _summary(full)
        for f in ("metrics.csv", "mechanisms.csv"):
            assert (run_dir / f).read_text() == (full / f).read_text(), (when, f)


def test_a_method_without_the_hook_is_scored_from_round_1_and_writes_no_selection_row(tiny_fl):
    run_dir = Path(run_experiment(resolve_config(_job(tiny_fl, "plain", {"name": "fedavg"}, rounds=3)))["dir"])
    s = _summary(run_dir / "fedavg")
    assert s["selection"]["scored_from"] == 1 and s["selection"]["declared"] is False
    assert s["early_stopping"]["scored_from"] == 1
    assert s["early_stopping"]["overall_best_round"] == s["early_stopping"]["best_round"]
    assert not (run_dir / "fedavg" / "mechanisms.csv").is_file()


@pytest.mark.parametrize("answer,match", [
    ("zero", r"method 'test_noised_from': scored_from\(1\) must be None or a round >= 1, got 0"),
    ("moves", r"method 'test_noised_from': scored_from\(2\) is 2, but the method said 1 before"),
])
def test_a_bad_answer_stops_the_run_naming_the_method(tiny_fl, answer, match):
    with pytest.raises(RunError, match=match):
        run_experiment(resolve_config(_job(tiny_fl, answer, {"name": METHOD, "answer": answer}, rounds=3)))


def test_fedfed_is_scored_from_its_release_round(tiny_fl):
    entry = {"name": "fedfed", "distill_rounds": 1, "vae_width": 4, "distill_steps": 4, "epsilon": 2.0}
    job = _job(tiny_fl, "fedfed", entry, rounds=3, early_stopping={"metric": "val/micro_f1", "patience": 5},
               client_split={"train": 0.6, "val": 0.2, "test": 0.2})
    run_dir = Path(run_experiment(resolve_config(job))["dir"]) / "fedfed"
    s = _summary(run_dir)
    # stage 1 is round 1; round 2 releases, then trains phi on the shared set: FedFed's first round
    assert s["selection"]["scored_from"] == 2 and s["early_stopping"]["best_round"] >= 2
    mech = pd.read_csv(run_dir / "mechanisms.csv")
    row = mech[(mech["mechanism"] == "selection") & (mech["name"] == "scored_from")].set_index("round")["value"]
    assert math.isnan(row.loc[1]) and row.loc[2:].tolist() == [2.0, 2.0]


def test_a_round_named_too_late_to_have_its_checkpoint_stops_the_run_saying_why():
    """A method that names its first round only rounds later: the best round among the rounds
    from it on may have lost its checkpoint (keep_checkpoints), and the best round's models
    with it; the run stops at once, saying so, instead of failing at its end."""
    from types import SimpleNamespace

    from medfl.engine.runner import Run

    es = EarlyStopping("val/micro_f1", patience=5)
    for r, v in enumerate([0.9, 0.5, 0.4], 1):
        es.observe(r, _rows(v), rounds=10, scored_from=None if r < 3 else 1)
    run = SimpleNamespace(early=es, label="late", scored_from=1, config={"keep_checkpoints": 1},
                          files=SimpleNamespace(kept_checkpoints=lambda: [2]))
    with pytest.raises(RunError, match=r"method 'late': scored_from named round 1 only after round 3, and early "
                                       r"stopping's best round among the rounds from it on, 1, has no checkpoint "
                                       r"left \(fl.keep_checkpoints 1\)"):
        Run._check_best_kept(run, 3)
    run.files = SimpleNamespace(kept_checkpoints=lambda: [1, 2])   # kept (pinned or recent): nothing to say
    Run._check_best_kept(run, 3)
