"""A Flower run never goes on, or finishes, without its sites (issue 39, items 1 and 2), and
a SuperLink that answers "database is locked" does not kill it (item 6b), over the loop-back
transport of ``test_coordinator.py`` (the coordinator's and the sites' real code, deterministic;
the SuperLink's errors over the Flower grid of ``flower_grid.py``):

- an exchange that too few sites answered (``fl.min_sites``, ``fl.min_fraction``) waits for the
  sites that missed it (their hello asked again and waited for, up to ``fl.site_wait_s``) and
  is sent to them again; before, the coordinator asked for the hello but did not wait, and
  every later round ran in a millisecond with no site, ending "finished";
- a round whose sites stay away fails (status ``failed`` with the reason, never "finished"),
  and the run resumes to the numbers of a run that never failed (the first evaluation round
  included, item 2);
- SuperLink calls failing with HTTP 500 are tried again with a growing wait, each retry
  recorded; errors that persist fail the run with one line.

tests/flower/test_flower.py runs the same over real Flower processes with paused sites.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Message  # noqa: E402

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.screening import TooFewSites  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.engine.remote import RemoteSettings  # noqa: E402
from medfl.flower.server import resume_flower, run_flower_experiment  # noqa: E402
from medfl.site import Site  # noqa: E402
from medfl.flower.transport import SuperLinkError  # noqa: E402
from medfl.transport import Answer  # noqa: E402

from flower_cases import FEDAVG, FEDBN, fl_config, numeric_equal  # noqa: E402
from flower_grid import LoopGrid  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402

#: no wait for the hellos of new nodes before an exchange: a hello withheld at its first pull
#: is then met only by the waits this file is about
NO_HELLO_WAIT = RemoteSettings(round_timeout=2.0, connect_timeout=5.0, hello_timeout=0.0, poll_interval=0.01)


class SlowHellos(LoopTransport):
    """A loop-back transport whose nodes in :attr:`held` answer a hello only at its second pull
    (a site that is slow to come back): a coordinator that asks and does not wait misses it."""

    def __init__(self, sites: dict[int, Site], **kw: Any) -> None:
        super().__init__(sites, **kw)
        self.held: set[int] = set()
        self.pulls: dict[str, int] = {}

    def miss_evaluation(self, r: int, nodes: set[int]) -> None:
        """The ``nodes`` miss the first evaluation message of round ``r`` (never answered)
        and are then slow to answer their next hello."""
        missed: set[int] = set()

        def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
            if node in nodes and kind == P.EVALUATE and ctl.get("round") == r and node not in missed:
                missed.add(node)
                self.held.add(node)
                return "silent"
            return "ok"

        self.rule = rule

    def receive(self, ids: list[str]) -> list[Answer]:
        out = []
        for mid in ids:
            msg = self.pending.get(mid)
            if msg is None:
                continue
            if msg.kind == P.HELLO and msg.node in self.held:
                self.pulls[mid] = self.pulls.get(mid, 0) + 1
                if self.pulls[mid] < 2:
                    continue
            out.append(self.deliver(mid, self.pending.pop(mid)))
        return out


def _table(run_dir: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(run_dir / name, dtype={"client_id": str, "node_id": str})


def _same_numbers(flower: Path, ref: Path) -> None:
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(ref / f), pd.read_csv(flower / f), f, atol=0.0)


def test_an_exchange_every_site_missed_waits_for_them_and_is_sent_again(tmp_path: Path) -> None:
    """Every site misses round 1's first evaluation and is slow to answer its next hello:
    the coordinator waits for the hellos and sends the evaluation again. Before, round 1
    had no evaluation row at all and the run said "finished"."""
    job = {**FEDBN, "rounds": 2, "eval_every": 1}
    fl = fl_config(tmp_path, "missed", job)
    grid = SlowHellos(_sites(tmp_path, fl))
    grid.miss_evaluation(1, {101, 102, 103})
    out = run_flower_experiment(resolve_config(fl), grid, NO_HELLO_WAIT)
    run_dir = Path(out["dir"]) / "fedbn"
    metrics = _table(run_dir, "metrics.csv")
    assert sorted(metrics[metrics["round"] == 1]["client_id"].unique()) == ["0", "1", "2"]
    events = _table(run_dir, "flower_events.csv")
    r1 = events[(events["round"] == 1) & (events["phase"] == "evaluate")]
    assert sorted(r1[r1["status"] == "timeout"]["client_id"]) == ["0", "1", "2"]
    assert sorted(r1[r1["status"] == "ok"]["client_id"]) == ["0", "1", "2"]
    assert r1["status"].str.startswith("waiting: 3 site(s) missing (0 1 2), 1 more needed (fl.min_sites 1)").any()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    ref = run_experiment(resolve_config({**fl, "name": "missed_ref"}))
    _same_numbers(run_dir, Path(ref["dir"]) / "fedbn")


def test_a_round_whose_sites_stay_away_fails_and_the_run_resumes(tmp_path: Path) -> None:
    """No site answers round 1's evaluation however long it waits: the run fails naming the
    round, the sites that answered and the minimum (status ``failed`` with that reason, no
    summary); once the sites are back, ``--resume`` ends with the numbers of a run that never
    failed. Before, the run finished with round 1 unevaluated."""
    job = {**FEDBN, "rounds": 2, "eval_every": 1, "site_wait_s": 3}
    fl = fl_config(tmp_path, "away", job)
    grid = LoopTransport(_sites(tmp_path, fl),
                         rule=lambda node, kind, ctl: "silent" if kind == P.EVALUATE and ctl.get("round") == 1 else "ok")
    with pytest.raises(TooFewSites, match=r"round 1: 0 of 3 sites answered evaluate \(missing: 0, 1, 2\), the round "
                                          r"needs at least 1 \(fl.min_sites 1\).*medfl flower run --resume"):
        run_flower_experiment(resolve_config(fl), grid, FAST)
    run_dir = tmp_path / "runs" / "away" / "fedbn"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["last_round"] == 0
    assert status["reason"].startswith("TooFewSites: round 1: 0 of 3 sites answered evaluate")
    assert not (run_dir / "summary.json").exists() and not (run_dir / "metrics.csv").exists()
    events = _table(run_dir, "flower_events.csv")
    assert (events["status"] == "too few sites: 0 of 3").sum() == 1
    assert events["status"].str.startswith("waited: 3 back").any()       # they were asked again...
    assert (events[(events["phase"] == "evaluate")]["status"] == "timeout").sum() >= 6   # ... and missed it again

    back = LoopTransport({n + 100: Site(s.settings) for n, s in grid.sites.items()})   # restarted sites
    resumed = resume_flower(tmp_path / "runs" / "away", back, FAST)
    assert resumed["summaries"]["fedbn"]["rounds"] == 2
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    ref = run_experiment(resolve_config({**fl, "name": "away_ref"}))
    _same_numbers(run_dir, Path(ref["dir"]) / "fedbn")


def test_a_round_waits_before_sending_for_a_site_it_lost(tmp_path: Path) -> None:
    """One client trains per round (``fraction``); the one sampled for round 2 missed round 1's
    evaluation and is slow to answer its hello. Round 2 waits for it before sending; before,
    it was absent and round 2 trained nobody."""
    job = {**FEDAVG, "rounds": 2, "fraction": 0.34}
    fl = fl_config(tmp_path, "lost", job)
    ref = run_experiment(resolve_config({**fl, "name": "lost_ref"}))
    trained = _table(Path(ref["dir"]) / "fedavg", "train_metrics.csv")
    second = str(trained[trained["round"] == 2]["client_id"].iloc[0])
    grid = SlowHellos(_sites(tmp_path, fl))
    grid.miss_evaluation(1, {101 + int(second)})
    out = run_flower_experiment(resolve_config(fl), grid, NO_HELLO_WAIT)
    run_dir = Path(out["dir"]) / "fedavg"
    train = _table(run_dir, "train_metrics.csv")
    assert train[train["round"] == 2]["client_id"].tolist() == [second]
    events = _table(run_dir, "flower_events.csv")
    r2 = events[(events["round"] == 2) & (events["phase"] == "train")]
    assert r2["status"].tolist()[:2] == ["waiting: 0 of 1 sites available, 1 needed (fl.min_sites 1)",
                                         "waited: 1 of 1 sites available"]


class LockedSuperLink(LoopGrid):
    """A loop-back grid whose calls fail with the HTTP 500 a SuperLink on SQLite answers when
    its database is locked: each call kind fails ``fails`` times in a row every ``every``-th
    time it is made (``every`` 0: from the ``after``-th call on, for good)."""

    def __init__(self, sites: dict[int, Site], fails: int, every: int = 5, after: int = 0) -> None:
        super().__init__(sites)
        self.fails, self.every, self.after = fails, every, after
        self.calls: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.raised = 0

    def _maybe_fail(self, what: str) -> None:
        n = self.calls[what] = self.calls.get(what, 0) + 1
        if self.every and n % self.every == 0 and not self.left.get(what):
            self.left[what] = self.fails
        if self.left.get(what) or (not self.every and n >= self.after):
            self.left[what] = max(0, self.left.get(what, 0) - 1)
            self.raised += 1
            request = httpx.Request("POST", f"http://superlink/{what}")
            response = httpx.Response(500, text='{"detail": "(sqlite3.OperationalError) database is locked"}',
                                      request=request)
            raise httpx.HTTPStatusError("Server error '500 Internal Server Error'", request=request, response=response)

    def get_node_ids(self) -> list[int]:
        self._maybe_fail("get_node_ids")
        return super().get_node_ids()

    def push_messages(self, messages: list[Message]) -> list[str]:
        self._maybe_fail("push_messages")
        return super().push_messages(messages)

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        self._maybe_fail("pull_messages")
        return super().pull_messages(message_ids)


RETRY_FAST = RemoteSettings(round_timeout=10.0, connect_timeout=10.0, hello_timeout=2.0, poll_interval=0.01,
                            superlink_retries=3, superlink_backoff=0.01)


def test_a_locked_superlink_database_is_retried_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the first HTTP 500 ("database is locked") killed the coordinator."""
    fl = fl_config(tmp_path, "locked", FEDAVG)
    grid = LockedSuperLink(_sites(tmp_path, fl), fails=2)
    out = run_flower_experiment(resolve_config(fl), grid, RETRY_FAST)
    assert grid.raised >= 6
    run_dir = Path(out["dir"]) / "fedavg"
    events = _table(run_dir, "flower_events.csv")
    retries = events[events["phase"] == "superlink"]["status"]
    assert len(retries) == grid.raised
    assert retries.str.contains(r"^retry [12]/3 of to (?:list its nodes|take messages|hand over replies): HTTP 500: "
                                r".*database is locked").all()
    err = capsys.readouterr().err
    assert "medfl flower: the SuperLink failed to take messages (HTTP 500: " in err and "trying again in" in err
    ref = run_experiment(resolve_config({**fl, "name": "locked_ref"}))
    _same_numbers(run_dir, Path(ref["dir"]) / "fedavg")


def test_a_superlink_that_keeps_failing_fails_the_run_with_one_line(tmp_path: Path) -> None:
    fl = fl_config(tmp_path, "gone", FEDAVG)
    grid = LockedSuperLink(_sites(tmp_path, fl), fails=0, every=0, after=4)
    with pytest.raises(SuperLinkError, match=r"^the SuperLink failed to \w+ \w+( \w+)? 4 times in a row \(HTTP 500: "
                                             r".*database is locked.*\); giving up \(superlink-retries 3\)"):
        run_flower_experiment(resolve_config(fl), grid, RETRY_FAST)
    status = json.loads((tmp_path / "runs" / "gone" / "fedavg" / "status.json").read_text())
    assert status["status"] == "failed" and status["reason"].startswith("SuperLinkError: the SuperLink failed")


class UnstoredPushes(LoopGrid):
    """A loop-back grid as a SuperLink on SQLite behaves while its database is locked (issue
    49, item 5): the ``push_failures`` first pushes of training messages fail with Flower's
    ``ObjectPushError`` (the SuperLink's store_object turns "database is locked" into "not
    stored"), and the training message of round 2 to node ``leaves`` is refused (an empty
    message id: that SuperNode stopped on the SuperLink's error and unregistered itself) until
    the node says hello again."""

    def __init__(self, sites: dict[int, Site], push_failures: int, leaves: int) -> None:
        super().__init__(sites)
        self.push_failures, self.leaves = push_failures, leaves
        self.refused: list[int] = []

    def push_messages(self, messages: list[Message]) -> list[str]:
        from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

        kinds = {m.metadata.message_type for m in messages}
        if P.TRAIN in kinds and self.push_failures:
            self.push_failures -= 1
            raise ObjectPushError("0" * 64, 1, "session")
        gone = [m for m in messages if m.metadata.dst_node_id == self.leaves and m.metadata.message_type == P.TRAIN
                and m.metadata.group_id == "2" and not self.refused]
        ids = super().push_messages([m for m in messages if m not in gone])
        if not gone:
            return ids
        self.refused.append(self.leaves)
        it = iter(ids)
        return ["" if m in gone else next(it) for m in messages]


def test_a_push_the_superlink_did_not_store_is_retried_and_a_node_that_left_is_sent_again(tmp_path: Path) -> None:
    """Before, an ObjectPushError killed the coordinator at once (no retry), and a message the
    SuperLink refused for a node that had left was waited for until the round timed out."""
    fl = {**fl_config(tmp_path, "unstored", {**FEDAVG, "rounds": 3}), "min_sites": 3}
    grid = UnstoredPushes(_sites(tmp_path, fl), push_failures=2, leaves=102)
    out = run_flower_experiment(resolve_config(fl), grid, RETRY_FAST)
    run_dir = Path(out["dir"]) / "fedavg"
    events = _table(run_dir, "flower_events.csv")
    retries = events[events["phase"] == "superlink"]["status"].tolist()
    assert len(retries) == 2
    assert all(r.startswith(f"retry {i}/3 of to take messages: it did not store a message's content (Failed to push")
               for i, r in enumerate(retries, 1))
    r2 = events[(events["round"] == 2) & (events["phase"] == "train")]
    assert grid.refused == [102]
    assert r2["status"].iloc[0] == "unavailable (the SuperLink refused the message: the node left)"
    assert str(r2["client_id"].iloc[0]) == "1"          # node 102
    assert any(s.startswith("waited: 1 back (1)") for s in r2["status"])          # asked for its hello, sent again
    ref = run_experiment(resolve_config({**fl, "name": "unstored_ref"}))
    _same_numbers(run_dir, Path(ref["dir"]) / "fedavg")
