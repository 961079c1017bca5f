"""The remote coordinator (:class:`~medfl.engine.remote.RemoteRun`) and sites (:class:`Site`) in one process.

A loop-back transport (:class:`LoopTransport`, a :class:`medfl.transport.InProcessTransport`)
stands in for Flower's: every message crosses as its bytes (:func:`medfl.wire.encode`), is
handed to the addressed node's :class:`Site` with :func:`medfl.site_messages.answer_message`, and
its answer crosses back. So these tests run the coordinator's and the sites' real code, fast and
deterministically: the same numbers as in process, state kept at the sites, dropouts and
rejoins, resume, and what the coordinator refuses. ``test_flower_transport.py`` runs Flower's
transport over a Flower grid in this process, ``test_flower.py`` the same jobs over real Flower
processes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.data import split_data  # noqa: E402
from medfl.engine.runner import Run, RunError, build_source  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl import wire  # noqa: E402
from medfl.engine.remote import RemoteRun, RemoteSettings  # noqa: E402
from medfl.flower.server import resume_flower, run_flower_experiment  # noqa: E402
from medfl.site import Site, SiteError, SiteSettings  # noqa: E402
from medfl.site_messages import answer_message  # noqa: E402
from medfl.flower.transport import FLOWER_TERMS  # noqa: E402
from medfl.transport import Answer, InProcessTransport, Outgoing  # noqa: E402
from medfl.wire import Content  # noqa: E402

from flower_cases import FEDAVG, FEDBN, FEDSKD, fl_config, numeric_equal, write_config  # noqa: E402
# Flower's message stamp, for the tests that import it from here (it stamps no message of this file's)

FAST = RemoteSettings(round_timeout=2.0, connect_timeout=5.0, hello_timeout=2.0, poll_interval=0.01)

#: ``(node, message type, control fields, reply content) -> reply content``
Tamper = Callable[[int, str, dict[str, Any], Content], Content]


class LoopTransport(InProcessTransport):
    """The sites of this process as the coordinator's transport, standing in for Flower's (its
    words: SuperNode, SuperLink): every content crosses as its bytes and is answered by the
    addressed node's :class:`Site` (:func:`medfl.site_messages.answer_message`) when received.

    Args:
        sites: node id -> the site it runs.
        rule: ``(node, message type, control fields) -> "ok" | "unavailable" | "silent"``:
            answer, lose the message (the node is gone), or never answer.
        tamper: rewrites a site's answer before it travels back.
    """

    terms = FLOWER_TERMS

    def __init__(self, sites: dict[int, Site], rule: Callable[[int, str, dict[str, Any]], str] | None = None,
                 tamper: Tamper | None = None) -> None:
        super().__init__(dict(sites), answer_message)
        self.rule = rule
        self.tamper = tamper
        self.sent: list[tuple[int, str, int]] = []   # (node, message type, round)
        self.lost: set[str] = set()                  # messages whose node is gone

    def send(self, messages: list[Outgoing]) -> list[str]:
        ids = super().send(messages)
        for msg, mid in zip(messages, ids):
            ctl = wire.take_json(msg.content, P.CONTROL, "loop transport")
            self.sent.append((msg.node, msg.kind, int(ctl.get("round", 0) or 0)))
            what = self.rule(msg.node, msg.kind, ctl) if self.rule else "ok"
            if what == "silent":
                self.pending.pop(mid, None)
            elif what == "unavailable":
                self.lost.add(mid)
        return ids

    def deliver(self, mid: str, msg: Outgoing) -> Answer:
        if mid in self.lost:
            return Answer(mid, error="node unavailable", lost=True)
        answer = super().deliver(mid, msg)
        if self.tamper is None or answer.content is None:
            return answer
        ctl = wire.take_json(msg.content, P.CONTROL, "loop transport")
        try:   # on what the site answered; a tamper that raises is the site's error
            return Answer(mid, wire.decode(wire.encode(self.tamper(msg.node, msg.kind, ctl, answer.content))))
        except Exception as exc:  # noqa: BLE001
            return Answer(mid, error=f"{type(exc).__name__}: {exc}")


class VirtualClock:
    """The coordinator's clock over the loop-back transport (``time`` in :mod:`medfl.engine.remote`
    and :mod:`medfl.engine.remote_sites`):
    it moves only when the coordinator waits (``time.sleep``, one ``poll_interval`` per poll),
    so a timeout is a number of polls and a test's outcome never depends on how loaded the
    machine is (a site's answer, computed when it is pulled, never arrives "late")."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, float(seconds))

    def __getattr__(self, name: str) -> Any:
        import time

        return getattr(time, name)   # time.time() for the events' wall-clock stamps


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """Every test here runs the coordinator on a :class:`VirtualClock`."""
    import medfl.engine.remote as remote
    import medfl.engine.remote_sites as remote_sites

    clock = VirtualClock()
    monkeypatch.setattr(remote, "time", clock)
    monkeypatch.setattr(remote_sites, "time", clock)
    return clock


def _sites(work: Path, fl: dict[str, Any], tag: str = "") -> dict[int, Site]:
    """Sites 0, 1, 2 as nodes 101, 102, 103, each with its own state directory."""
    cfg = write_config(work / f"site{tag}.json", fl)
    return {101 + i: Site(SiteSettings(client_id=str(i), config=cfg, state_dir=work / f"state{tag}" / f"site{i}"))
            for i in range(3)}


def _tampered_run(tmp_path: Path, name: str, job: dict[str, Any], tamper: Callable[..., Any],
                  method: str = "fedavg") -> tuple[Path, pd.DataFrame]:
    """Run ``job`` over the loop-back grid with ``tamper`` rewriting the sites' replies; return
    the method's run directory and its ``reply_events.csv`` (empty when nothing was refused)."""
    fl = fl_config(tmp_path, name, job)
    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl), tamper=tamper), FAST)
    run_dir = Path(out["dir"]) / method
    path = run_dir / "reply_events.csv"
    events = pd.read_csv(path, dtype={"client_id": str}) if path.is_file() else pd.DataFrame()
    return run_dir, events


def _run_both(work: Path, name: str, job: dict[str, Any], grid_kw: dict[str, Any] | None = None
              ) -> tuple[Path, Path, LoopTransport]:
    fl = fl_config(work, name, job)
    grid = LoopTransport(_sites(work, fl), **(grid_kw or {}))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    ref = run_experiment(resolve_config({**fl, "name": name + "_ref"}))
    label = fl["methods"][0]["name"]
    return Path(out["dir"]) / label, Path(ref["dir"]) / label, grid


def _no_state_at_coordinator(run_dir: Path) -> None:
    for sub in ("clients", "eval_state"):
        assert not list((run_dir / sub).rglob("state_r*.pt")), f"client state at the coordinator ({sub})"


def test_fedavg_over_the_grid_equals_in_process(tmp_path: Path) -> None:
    flower, local, grid = _run_both(tmp_path, "fedavg", FEDAVG)
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)
    assert json.loads((flower.parent / "config.json").read_text())["engine"] == "flower"
    assert json.loads((flower / "summary.json").read_text())["rounds"] == 2
    kinds = [k for _, k, _ in grid.sent]
    assert kinds.count(P.HELLO) == 3 and kinds.count(P.TRAIN) == 6 and kinds.count(P.EVALUATE) == 6
    events = pd.read_csv(flower / "flower_events.csv", dtype={"client_id": str})
    assert set(events.loc[events["phase"] == "train", "status"]) == {"ok"}
    _no_state_at_coordinator(flower)


def test_fedskd_peer_to_peer_over_the_grid_equals_in_process(tmp_path: Path) -> None:
    flower, local, grid = _run_both(tmp_path, "fedskd", FEDSKD)
    for f in ("metrics.csv", "train_metrics.csv", "cross_test.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)
    assert P.SCORE in {k for _, k, _ in grid.sent}      # the Global Test went through the sites
    _no_state_at_coordinator(flower)
    run_id = json.loads((flower / "flower.json").read_text())["run_id"]
    for i in range(3):   # each site keeps its own DAM, versioned by round
        assert (tmp_path / "state" / f"site{i}" / run_id / f"site_{i}" / "clients" / str(i) / "state_r0002.pt").is_file()


OTHER_METHODS = ["fedprox", "fedadam", "fedyogi", "fedadagrad", "feddisco", "fedsdc", "fedavgm", "fedkper", "local",
                 "fedcross", "fedcross_het"]


def test_every_built_in_method_has_a_flower_check() -> None:
    """A method added to medfl's own plugins must join one of the grid checks in this file."""
    from medfl.plugins import registry

    built_in = {n for n, r in registry()["method"].items() if r.distribution == "medfl"}
    # pfedcdp: tests/flower/test_pfedcdp_flower.py (it needs a public dataset and its own checks)
    # fedtpf, fedfed: tests/flower/test_fedtpf_flower.py (stage switch, release round, reproducible noise)
    checked = {"fedavg", "fedskd", "fedbn", "centralized", "pfedcdp", "fedtpf", "fedfed", *OTHER_METHODS}
    assert "fedavg" in built_in
    assert built_in - checked == set(), "add these methods to OTHER_METHODS"


@pytest.mark.parametrize("method", OTHER_METHODS)
def test_every_other_registered_method_runs_unchanged_over_the_grid(tmp_path: Path, method: str) -> None:
    """No method-specific code in the Flower layer: each built-in method (FedAvg, FedSKD and
    FedBN above; ``centralized`` pools data and is refused) gives its in-process numbers."""
    job = {**FEDAVG, "rounds": 2, "eval_every": 0, "methods": [{"name": method}]}
    if method == "fedcross_het":
        job["client_models"] = [{"width": 4}, {"width": 3}, {"width": 2}]
    flower, local, _ = _run_both(tmp_path, method, job)
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f"{method}: {f}", atol=0.0)
    _no_state_at_coordinator(flower)


def test_fedsdc_plus_ranks_heads_through_the_sites_as_in_process(tmp_path: Path) -> None:
    """FedSDC+: every head goes to every site in the validation exchange, only micro-F1 scalars
    come back, and the coordinator keeps the same top-gamma heads as in process."""
    job = {**FEDAVG, "rounds": 2, "eval_every": 0, "client_split": {"train": 0.6, "val": 0.2, "test": 0.2},
           "methods": [{"name": "fedsdc", "gamma": 0.3}]}
    flower, local, grid = _run_both(tmp_path, "fedsdc", job)
    for f in ("metrics.csv", "train_metrics.csv", "validation_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f"fedsdc+: {f}", atol=0.0)
    reports = [json.loads((d / "summary.json").read_text())["method_report"] for d in (flower, local)]
    assert reports[0] == reports[1] and len(reports[0]["ensemble_heads"]) == 1
    assert [k for _, k, _ in grid.sent].count(P.VALIDATE) == 6  # 3 sites x 2 rounds
    _no_state_at_coordinator(flower)


class _Replica(Run):
    """In process, with the participation a Flower run had: ``absent`` (round, client) pairs do not train."""

    absent: set[tuple[int, str]] = set()

    def update_clients(self, r, instructions):  # type: ignore[no-untyped-def]
        return super().update_clients(r, {c: i for c, i in instructions.items() if (r, c) not in self.absent})


def _replica(work: Path, fl: dict[str, Any], absent: set[tuple[int, str]]) -> Path:
    cfg = resolve_config({**fl, "name": fl["name"] + "_ref"})
    data = split_data(build_source(cfg["dataset"]), cfg)
    run = _Replica(cfg, cfg["methods"][0], work / "runs" / cfg["name"] / cfg["methods"][0]["name"], data)
    run.absent = absent
    run.prepare()
    run.execute()
    return run.run_dir


@pytest.mark.parametrize("failure", ["unavailable", "silent"])
def test_site_drops_out_for_a_round_and_rejoins_with_its_state(tmp_path: Path, failure: str) -> None:
    """Site 2 fails round 2's training (Flower reports its node gone, or it never answers),
    then comes back as a new node (a restarted SuperNode) on the same state directory."""
    fl = fl_config(tmp_path, "drop", FEDBN)
    sites = _sites(tmp_path, fl)
    grid = LoopTransport(sites)

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        if node == 103 and kind == P.TRAIN and ctl["round"] == 2:
            del grid.sites[103]    # the node is gone; a new one serving client 2 registers
            grid.sites[203] = Site(sites[103].settings)
            return failure
        return "ok"

    grid.rule = rule
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    run_dir = Path(out["dir"]) / "fedbn"
    train = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    trained = {r: set(g["client_id"]) for r, g in train.groupby("round")}
    assert trained == {1: {"0", "1", "2"}, 2: {"0", "1"}, 3: {"0", "1", "2"}}
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str})
    lost = events[(events["client_id"] == "2") & (events["round"] == 2) & (events["phase"] == "train")]
    assert lost["status"].tolist() == ["dropped (node unavailable)" if failure == "unavailable" else "timeout"]
    assert ((events["phase"] == "hello") & (events["client_id"] == "2") & (events["node_id"] == "203")).any()
    ref = _replica(tmp_path, fl, {(2, "2")})
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(ref / f), pd.read_csv(run_dir / f), f, atol=0.0)
    _no_state_at_coordinator(run_dir)


def test_stopped_flower_run_resumes_to_the_uninterrupted_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 request: pytest.FixtureRequest) -> None:
    """A Flower run stopped after round 1 (the ServerApp's ``serve``, as ``medfl flower run``
    starts it) prints the command that continues it at the sites, with the options that
    reached the SuperLink (issue 51: it said `medfl resume DIR`, which trained the remaining
    rounds here without the sites' state). `medfl resume` refuses in one line naming that
    command and writes nothing; the printed command, run as pasted (``flwr run`` caught: its
    ServerApp serves restarted sites) with ``--threads 1`` as `medfl resume` takes it, ends
    with the uninterrupted run's numbers."""
    import shlex

    import medfl.flower.deploy as deploy
    from medfl.cli import main
    from medfl.flower.server import serve

    monkeypatch.chdir(tmp_path)   # serve() changes to the run config's workdir
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(1)      # every part as the resume's --threads 1 (the numbers are compared exactly)
    fl = fl_config(tmp_path, "stop", {**FEDBN, "stop_after_round": 1})
    launch = f"--superlink hub:9100 --root-certificates {tmp_path / 'ca.pem'}"
    rc = deploy.make_run_config(workdir=tmp_path, result_file=tmp_path / "result.json", round_timeout=2.0,
                                connect_timeout=5.0, hello_timeout=2.0, config=write_config(tmp_path / "stop.json", fl),
                                launch=launch)
    grid = LoopTransport(_sites(tmp_path, fl))
    out = serve(grid, {**rc, "poll-interval": 0.01})
    exp = Path(out["dir"])
    run_dir = exp / "fedbn"
    assert not (run_dir / "summary.json").is_file()
    printed = [a or b for a, b in re.findall(r"continue with:? (?:`([^`]+)`|(medfl .+))", capsys.readouterr().out)]
    assert printed == [f"medfl flower run --resume {run_dir} {launch}"]

    files = {f: f.read_bytes() for f in exp.rglob("*") if f.is_file()}
    assert main(["resume", str(exp)]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("medfl: error: ") and "ran at the sites over Flower" in said[0], said
    assert f"`medfl flower run --resume {exp} {launch}`" in said[0]
    assert {f: f.read_bytes() for f in exp.rglob("*") if f.is_file()} == files   # nothing written

    restarted = LoopTransport({n + 100: Site(s.settings) for n, s in grid.sites.items()})   # restarted sites
    launched: list[tuple[str, dict[str, Any]]] = []

    def flwr_run(app_dir: Path, superlink: str, run_config: dict[str, Any], **kw: Any) -> int:
        launched.append((superlink, run_config))
        result = serve(restarted, {**run_config, "poll-interval": 0.01})   # the ServerApp at the SuperLink
        Path(run_config["result-file"]).write_text(json.dumps({"ok": True, "dir": result["dir"]}))
        return 0

    monkeypatch.setattr(deploy, "flwr_run", flwr_run)
    assert main(shlex.split(printed[0])[1:] + ["--threads", "1"]) == 0
    assert [(link, rc2["resume"], rc2["threads"]) for link, rc2 in launched] == [("hub:9100", str(run_dir), "1")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["threads"]["setting"] == 1   # --threads reached the coordinator
    ref = run_experiment(resolve_config({**fl, "name": "stop_ref", "stop_after_round": None}))
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(Path(ref["dir"]) / "fedbn" / f), pd.read_csv(run_dir / f), f, atol=0.0)
    sessions = json.loads((run_dir / "flower.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [0, 1]


def test_early_stopping_over_the_grid_equals_in_process_after_a_resume(tmp_path: Path) -> None:
    """The same best round, stop round and final metrics over Flower as in process, for a run
    stopped before its stop round and resumed with restarted sites; each site keeps the client
    states the in-process run keeps (the best round's among them)."""
    early = {**FEDBN, "rounds": 6, "eval_every": 1, "eval_splits": ["val", "test", "global_test"],
             "early_stopping": {"metric": "val/micro_f1", "patience": 3}}
    fl = fl_config(tmp_path, "early", {**early, "stop_after_round": 2})
    grid = LoopTransport(_sites(tmp_path, fl))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    grid = LoopTransport({n + 100: Site(s.settings) for n, s in grid.sites.items()})   # restarted sites
    resume_flower(out["dir"], grid, FAST)
    ref = Path(run_experiment(resolve_config({**fl, "name": "early_ref", "stop_after_round": None}))["dir"]) / "fedbn"
    run_dir = Path(out["dir"]) / "fedbn"
    flower, local = (json.loads((d / "summary.json").read_text()) for d in (run_dir, ref))
    es = flower["early_stopping"]
    # stopped early, and the site pruned past the best round's state while it ran on
    assert es["stopped_at_round"] < 6 and es["best_round"] < es["stopped_at_round"] - 2
    for block in ("early_stopping", "final", "last_round", "rounds"):
        assert json.dumps(flower[block], sort_keys=True) == json.dumps(local[block], sort_keys=True), block
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(ref / f), pd.read_csv(run_dir / f), f, atol=0.0)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("round_*.pt")) == \
        sorted(p.name for p in (ref / "checkpoints").glob("round_*.pt"))
    _no_state_at_coordinator(run_dir)
    run_id = json.loads((run_dir / "flower.json").read_text())["run_id"]
    for i in range(3):
        site = tmp_path / "state" / f"site{i}" / run_id / f"site_{i}" / "clients" / str(i)
        kept = sorted(p.name for p in site.glob("state_r*.pt"))
        assert f"state_r{es['best_round']:04d}.pt" in kept
        # a site prunes on the coordinator's next message, so it may hold one more version
        assert set(kept) >= {p.name for p in (ref / "clients" / str(i)).glob("state_r*.pt")}, i


def _add_to_payload(extra: Callable[[], Any]) -> Tamper:
    def tamper(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN:
            payload = wire.take(out, "reply.payload", "tamper", allow_str=True)
            payload["leak"] = extra()
            out["reply.payload.arrays"], out["reply.payload.tree"] = _pack_raw(payload)
        return out
    return tamper


def _pack_raw(value: Any) -> Any:
    """``wire.pack`` without its outgoing check: what a modified site could send."""
    from unittest import mock

    with mock.patch.object(wire, "validate_payload", lambda *a, **k: None):
        return wire.pack(value)


@pytest.mark.parametrize("leak, match", [
    (lambda: torch.zeros(4, 1, 16, 16), "looks like a batch of the client's images"),
    (lambda: "/data/site1/patient_0001.dcm", "strings may not leave a client"),
])
def test_coordinator_refuses_a_reply_carrying_data(tmp_path: Path, leak: Callable[[], Any], match: str) -> None:
    """A site whose code was changed to send images or text: the coordinator's wire side refuses
    the reply (issue 19: it used to stop the whole run), names the site in reply_events.csv,
    and the round goes on with the others; a site that keeps doing it is excluded."""
    run_dir, events = _tampered_run(tmp_path, "leak", {**FEDAVG, "rounds": 3, "max_reply_failures": 2},
                                    _add_to_payload(leak))
    assert events[["round", "client_id", "status"]].values.tolist() == [
        [1, "1", "dropped"], [2, "1", "dropped"], [2, "1", "excluded"]]
    assert events["reason"].iloc[0].startswith("train: reply of site 1 in round 1")
    assert events["reason"].str.contains(match).iloc[:2].all()
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert "1" not in set(trained["client_id"]) and json.loads((run_dir / "summary.json").read_text())["rounds"] == 3


def test_metrics_a_site_reports_about_itself_are_marked(tmp_path: Path) -> None:
    """Issue 19: a site claimed global-test accuracy 1.0 for a model the others scored 0.53.
    Its claim is well-formed and cannot be checked (only it evaluates its model on its data),
    so it is kept but marked ``reported_by = self``; ``cross_test``, which the peers score on
    their own data, is marked ``peers`` and shows what the model really does."""
    def boast(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 101 and kind == P.EVALUATE and "eval.global_test" in out:
            out["eval.global_test"] = wire.metrics_record({**dict(out["eval.global_test"]), "accuracy": 1.0}, "tamper")
        return out

    job = {**FEDAVG, "eval_splits": ["test", "global_test", "cross_test"]}
    run_dir, events = _tampered_run(tmp_path, "boast", job, boast)
    assert events.empty
    metrics = pd.read_csv(run_dir / "metrics.csv", dtype={"client_id": str})
    assert dict(zip(metrics["split"], metrics["reported_by"])) == {
        "local_test": "self", "global_test": "self", "cross_test": "peers"}
    last = metrics[metrics["round"] == metrics["round"].max()].set_index(["client_id", "split"])
    assert last.loc[("0", "global_test"), "accuracy"] == 1.0
    assert last.loc[("0", "cross_test"), "accuracy"] < 1.0          # the peers' word
    cross = pd.read_csv(run_dir / "cross_test.csv", dtype={"client_id": str, "data_client_id": str})
    assert ((cross["reported_by"] == "self") == (cross["client_id"] == cross["data_client_id"])).all()
    assert set(cross["reported_by"]) == {"self", "peer"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reported_by"]["metrics"] == {"local_test": "self", "global_test": "self", "cross_test": "peers"}
    assert summary["reported_by"]["train_metrics"]["bytes_from_client"] == "coordinator"
    assert summary["reported_by"]["train_metrics"]["loss"] == "self"


def test_a_site_answering_with_errors_is_dropped_then_excluded(tmp_path: Path) -> None:
    """Issue 19: one site's error (its code raised, or it answers errors on purpose)
    stopped every run; now it is dropped like a bad reply and excluded by policy (the run
    stops only when every site asked fails: tests/flower/test_approval.py)."""
    def fail(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN:
            raise RuntimeError("boom")
        return out

    run_dir, events = _tampered_run(tmp_path, "errors", {**FEDAVG, "rounds": 3, "max_reply_failures": 2}, fail)
    assert events[["round", "client_id", "status"]].values.tolist() == [
        [1, "1", "dropped"], [2, "1", "dropped"], [2, "1", "excluded"]]
    assert events["reason"].iloc[0] == "site 1 failed in train of round 1 (Flower): RuntimeError: boom"
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert sorted(trained[trained["round"] == 3]["client_id"]) == ["0", "2"]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 3


def test_undecodable_replies_are_refused_not_fatal(tmp_path: Path) -> None:
    """Issue 19: a reply whose records are missing or malformed (a bare KeyError, a non-integer
    num_examples, metrics for splits nobody asked for) stopped the run; now each is refused
    with a reason naming the site, in train, evaluate and the client check alike."""
    def garble(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        r = int(ctl.get("round", 0))
        if node == 102 and kind == P.TRAIN and r == 1:
            del out["reply.payload.tree"]
        if node == 102 and kind == P.TRAIN and r == 2:
            control = wire.take_json(out, P.CONTROL, "tamper")
            wire.put_json(out, P.CONTROL, {**control, "num_examples": "1e12"})
        if node == 101 and kind == P.EVALUATE and r == 1:
            control = wire.take_json(out, P.CONTROL, "tamper")
            wire.put_json(out, P.CONTROL, {**control, "splits": [*control.get("splits", []), "secret"]})
        return out

    run_dir, events = _tampered_run(tmp_path, "garble", {**FEDAVG, "rounds": 2}, garble)
    got = events[["round", "client_id", "status"]].values.tolist()
    assert [1, "1", "dropped"] in got and [2, "1", "dropped"] in got and [1, "0", "dropped"] in got
    reasons = " | ".join(events["reason"])
    assert "no 'reply.payload' in the message" in reasons or "'tree'" in reasons
    assert "num_examples '1e12' is not an integer" in reasons
    assert "split 'secret', which was not asked for" in reasons
    metrics = pd.read_csv(run_dir / "metrics.csv", dtype={"client_id": str})
    assert not ((metrics["round"] == 1) & (metrics["client_id"] == "0")).any()   # its evaluation was refused
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


def test_pinned_clients_are_served_only_by_their_registered_node(tmp_path: Path) -> None:
    """Issue 19: "the last hello for a client id wins". With site-nodes (client -> the node
    registered for it), a second node claiming client 1, with the right config and data, is
    refused and client 1 stays with its registered node."""
    import dataclasses

    fl = fl_config(tmp_path, "pinned", {**FEDAVG, "stop_after_round": 1})
    sites = _sites(tmp_path, fl)
    sites[104] = Site(SiteSettings(client_id="1", config=tmp_path / "site.json", state_dir=tmp_path / "s104"))
    pins = dataclasses.replace(FAST, site_nodes=json.dumps({"0": 101, "1": 102, "2": 103}))
    exp = run_flower_experiment(resolve_config(fl), LoopTransport(sites), pins)["dir"]
    # the resume is given no site-nodes: it keeps the first session's (flower.json)
    assert resume_flower(exp, LoopTransport(sites), FAST)["summaries"]["fedavg"]["rounds"] == 2
    run_dir = Path(exp) / "fedavg"
    assert json.loads((run_dir / "flower.json").read_text())["site_nodes"] == {"0": 101, "1": 102, "2": 103}
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str})
    hellos = events[events["phase"] == "hello"]
    served = hellos[hellos["status"] == "joined"]
    assert served["session"].nunique() == 2
    assert set(zip(served["client_id"], served["node_id"])) == {("0", "101"), ("1", "102"), ("2", "103")}
    refused = hellos[hellos["status"].str.startswith("refused")]
    assert refused["node_id"].tolist() == ["104", "104"]                  # in both sessions
    assert "node 104 says it serves client '1', which is registered to node 102" in refused["status"].iloc[0]
    # a malformed mapping stops the run before anything is sent
    bad = dataclasses.replace(FAST, site_nodes=json.dumps({"0": 101, "1": 101}))
    with pytest.raises(RunError, match="node 101 is registered for clients '0' and '1'"):
        run_flower_experiment(resolve_config(fl_config(tmp_path, "bad_pins", FEDAVG)), LoopTransport(_sites(tmp_path, fl)),
                              bad)


def test_site_drawing_another_partition_is_refused(tmp_path: Path) -> None:
    fl = fl_config(tmp_path, "mismatch", FEDAVG)
    sites = _sites(tmp_path, fl)
    sites[103] = Site(SiteSettings(client_id="2", config=write_config(tmp_path / "other.json", {
        **fl, "client_split": {"train": 0.5, "val": 0.25, "test": 0.25}}),
                                   state_dir=tmp_path / "other"))
    # refused, so client 2 has no site: the connect error says why
    with pytest.raises(RunError, match=r"no SuperNode serves client\(s\) \['2'\].*refused site 2 .*drew a different "
                                       "partition"):
        run_flower_experiment(resolve_config(fl), LoopTransport(sites), FAST)


def test_a_node_whose_hello_is_refused_cannot_stop_the_run(tmp_path: Path) -> None:
    """Issue 19: a node serving an unknown client, answering the hello with an error, with
    garbage or with another partition stopped the whole run; now each is refused (an event
    and a stderr line naming the node and why), never asked again, and the run goes on."""
    fl = fl_config(tmp_path, "unknown", FEDAVG)
    sites = _sites(tmp_path, fl)
    sites[104] = Site(SiteSettings(client_id="7", config=tmp_path / "site.json", state_dir=tmp_path / "s7"))
    sites[105] = Site(SiteSettings(client_id="1", config=tmp_path / "site.json", state_dir=tmp_path / "s105"))
    sites[106] = Site(SiteSettings(client_id="2", config=tmp_path / "site.json", state_dir=tmp_path / "s106"))

    def garble(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if kind == P.HELLO and node == 105:
            del out[P.CONTROL]
        if kind == P.HELLO and node == 106:
            control = wire.take_json(out, P.CONTROL, "tamper")
            wire.put_json(out, P.CONTROL, {**control, "digest": 12345})
        return out

    out = run_flower_experiment(resolve_config(fl), LoopTransport(sites, tamper=garble), FAST)
    run_dir = Path(out["dir"]) / "fedavg"
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str})
    refused = events[events["status"].astype(str).str.startswith("refused")]
    why = dict(zip(refused["node_id"], refused["status"]))
    assert set(why) == {"104", "105", "106"}
    assert "client id '7' is not in this config's partition" in why["104"]
    assert "its hello cannot be read" in why["105"]
    assert "site 2 (node 106) drew a different partition" in why["106"]
    assert (events["phase"] == "hello").sum() == 6          # refused nodes are not asked again
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert len(trained) == 2 * 3                              # the three honest sites, both rounds


def test_missing_site_fails_after_connect_timeout(tmp_path: Path) -> None:
    fl = fl_config(tmp_path, "missing", FEDAVG)
    sites = _sites(tmp_path, fl)
    del sites[102]
    quick = RemoteSettings(round_timeout=1.0, connect_timeout=0.2, hello_timeout=0.2, poll_interval=0.01)
    with pytest.raises(RunError, match=r"no SuperNode serves client\(s\) \['1'\]"):
        run_flower_experiment(resolve_config(fl), LoopTransport(sites), quick)


def test_coordinator_says_which_sites_it_still_waits_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sites on other machines may never come: while waiting, the coordinator names the
    clients that have no site yet (every ``progress_interval`` seconds)."""
    fl = fl_config(tmp_path, "waiting", FEDAVG)
    sites = _sites(tmp_path, fl)
    del sites[102]
    quick = RemoteSettings(round_timeout=1.0, connect_timeout=0.5, hello_timeout=0.2, poll_interval=0.01,
                           progress_interval=0.1)
    with pytest.raises(RunError, match=r"no SuperNode serves client\(s\) \['1'\]"):
        run_flower_experiment(resolve_config(fl), LoopTransport(sites), quick)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("medfl: waiting for sites")]
    assert len(lines) >= 2, lines
    assert "no site serves client(s) 1 yet; connected: 0, 2 (2 SuperNode(s) registered)" in lines[-1]
    assert RemoteSettings.from_run_config({"progress-interval": 20}).progress_interval == 20.0


def test_pooled_methods_cannot_run_across_sites(tmp_path: Path) -> None:
    fl = fl_config(tmp_path, "pooled", {**FEDAVG, "methods": [{"name": "centralized"}]})
    cfg = resolve_config(fl)
    data = split_data(build_source(cfg["dataset"]), cfg)
    with pytest.raises(RunError, match="pools every client's data"):
        RemoteRun(cfg, cfg["methods"][0], tmp_path / "run", data, LoopTransport({}), FAST)


# ---------------------------------------------------------------------- the site alone
def test_node_config_errors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(SiteError, match="lacks config, state-dir"):
        SiteSettings.from_node_config({"client-id": "0"})
    with pytest.raises(SiteError, match="'overrides' is not JSON"):
        SiteSettings.from_node_config({"client-id": "0", "config": "c.json", "state-dir": "s", "overrides": "{x"})
    with pytest.raises(SiteError, match="config .*nope.json not found"):
        Site(SiteSettings(client_id="0", config=tmp_path / "nope.json", state_dir=tmp_path))
    s = SiteSettings.from_node_config({"client-id": 3, "config": "c.json", "state-dir": "s",
                                       "overrides": '{"fl#seed": 2}', "device": ""})
    assert (s.client_id, s.overrides, s.device, s.superlink) == ("3", {"fl#seed": 2}, None, "")
    assert SiteSettings.from_node_config({"client-id": 3, "config": "c.json", "state-dir": "s",
                                          "superlink": "hub:9100"}).superlink == "hub:9100"


def test_site_refuses_other_protocols_clients_and_message_types(tmp_path: Path) -> None:
    site = _sites(tmp_path, fl_config(tmp_path, "x", FEDAVG))[101]

    def msg(**ctl: Any) -> Content:
        content = Content()
        wire.put_json(content, P.CONTROL, ctl)
        return content

    with pytest.raises(SiteError, match="protocol 99"):
        answer_message(site, P.HELLO, msg(protocol=99))
    with pytest.raises(SiteError, match="addressed to client '1'"):
        answer_message(site, P.HELLO, msg(protocol=P.PROTOCOL, client="1"))
    with pytest.raises(SiteError, match="unknown message type 'query.secrets'"):
        answer_message(site, "query.secrets", msg(protocol=P.PROTOCOL))
    with pytest.raises(wire.WireError, match="no 'medfl' record"):
        answer_message(site, P.HELLO, Content())
    hello = wire.take_json(answer_message(site, P.HELLO, msg(protocol=P.PROTOCOL, fold=None)), P.CONTROL, "hello")
    assert hello["client"] == "0" and set(hello["sizes"]) == {"train", "val", "test"}


def test_a_site_sending_nan_weights_is_dropped_from_the_round_and_the_run_goes_on(tmp_path: Path) -> None:
    """Issue 19: NaN updates were averaged in and the run died blaming an honest site; now
    the coordinator's reply checks drop the reply, name the site in reply_events.csv, and the
    other sites' round completes."""
    def nan_weights(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN and int(ctl.get("round", 0)) == 1:
            payload = wire.take(out, "reply.payload", "tamper", allow_str=True)
            key = next(iter(payload["model"]))
            payload["model"][key] = payload["model"][key] * float("nan")
            out["reply.payload.arrays"], out["reply.payload.tree"] = _pack_raw(payload)
        return out

    run_dir, events = _tampered_run(tmp_path, "nan", FEDAVG, nan_weights)
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"]]
    assert "NaN or infinite" in events["reason"].iloc[0]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


def _rewrite_train_reply(change: Callable[[dict[str, Any], dict[str, float], dict[str, Any]], None]) -> Tamper:
    """Site 1 (node 102) rewrites its round-1 train reply: ``change(payload, metrics, control)``
    edits them in place, and they are packed again without the site's outgoing checks."""
    def tamper(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN and int(ctl.get("round", 0)) == 1:
            payload = wire.take(out, "reply.payload", "tamper", allow_str=True)
            metrics = wire.take(out, "reply.metrics", "tamper", allow_str=True)
            control = wire.take_json(out, P.CONTROL, "tamper")
            change(payload, metrics, control)
            out["reply.payload.arrays"], out["reply.payload.tree"] = _pack_raw(payload)
            out["reply.metrics.arrays"], out["reply.metrics.tree"] = _pack_raw(metrics)
            wire.put_json(out, P.CONTROL, control)
        return out
    return tamper


def _scale(payload: dict[str, Any]) -> None:
    payload["model"] = {k: v * 1e6 if v.is_floating_point() else v for k, v in payload["model"].items()}


#: issue 39, 6b: replies that passed the coordinator's checks (no model: KeyError 'model' then
#: stopped the run)
REPLIES_6B: dict[str, tuple[Callable[[dict[str, Any], dict[str, float], dict[str, Any]], None], str]] = {
    "no_model": (lambda p, m, c: p.pop("model"), "no 'model' entry: a reply of method 'fedavg'"),
    "nan_metric": (lambda p, m, c: m.update(loss=float("nan")), "metrics['loss'] holds NaN or infinite values"),
    "extra_entry": (lambda p, m, c: p.update(blob=torch.zeros(3)), "payload entry 'blob' that it does not declare"),
    "zero_examples": (lambda p, m, c: c.update(num_examples=0), "num_examples 0 is not an integer >= 1"),
    "negative_examples": (lambda p, m, c: c.update(num_examples=-4), "num_examples -4 is not an integer >= 1"),
    "scaled_1e6": (lambda p, m, c: _scale(p), "is above the bound"),
}


@pytest.mark.parametrize("case", sorted(REPLIES_6B))
def test_a_reply_the_checks_missed_is_dropped_over_flower_as_in_process(tmp_path: Path, case: str) -> None:
    """The coordinator's reply checks are one code path (``Run.screen``) whatever the
    transport: each reply of issue 39, 6b is dropped with its reason in reply_events.csv, and
    the run goes on with the other sites."""
    change, reason = REPLIES_6B[case]
    run_dir, events = _tampered_run(tmp_path, case, FEDAVG, _rewrite_train_reply(change))
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"]]
    assert reason in events["reason"].iloc[0]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert sorted(trained.loc[trained["round"] == 1, "client_id"]) == ["0", "2"]


def test_a_diverging_run_is_warned_about_over_flower_as_in_process(tmp_path: Path) -> None:
    """Issue 39, item 8: a finite but exploding training loss (lr 100: hundreds to tens of
    thousands, ln 2 = 0.69 at the start) finished with no word; the warning comes from the
    coordinator's round (``Run.divergence``), the same code over Flower as in process."""
    fl = fl_config(tmp_path, "lr", {**FEDAVG, "rounds": 1, "train": {"batch_size": 8, "lr": 100.0}})
    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)
    warnings = json.loads((Path(out["dir"]) / "fedavg" / "summary.json").read_text())["warnings"]
    assert [w["round"] for w in warnings] == [1]
    assert warnings[0]["warning"].startswith("training is diverging: the mean training loss of round 1 is")


def test_an_experiment_over_seeds_runs_across_sites(tmp_path: Path) -> None:
    """Each seed of ``seeds`` draws its own split; the sites draw theirs with the seed the
    coordinator sends (before, a site drew the config's seed and every other seed's hello was
    refused as another partition)."""
    fl = {**fl_config(tmp_path, "seeds", {**FEDAVG, "rounds": 1}), "seeds": [0, 3]}
    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)
    ref = run_experiment(resolve_config({**fl, "name": "seeds_ref"}))
    for seed in (0, 3):
        a = pd.read_csv(Path(ref["dir"]) / f"seed_{seed}" / "fedavg" / "metrics.csv")
        b = pd.read_csv(Path(out["dir"]) / f"seed_{seed}" / "fedavg" / "metrics.csv")
        numeric_equal(a, b, f"seed {seed}")
    split0, split3 = (pd.read_csv(Path(out["dir"]) / f"seed_{s}" / "partition.csv") for s in (0, 3))
    assert not split0.equals(split3)   # the seeds really drew different splits


def test_a_reply_the_filters_cannot_undo_is_dropped_with_the_site_named(tmp_path: Path) -> None:
    """Issue 38, item 9: under ``quantize``, a site whose reply holds something else than the
    chain's codes (here float weights where 8-bit codes were planned) made ``Run.unfilter``
    raise and stop the whole run. The reply is now dropped with the site named in
    reply_events.csv, and the run goes on with the others."""
    def garble(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN and ctl.get("round") == 1:
            payload = wire.take(out, "reply.payload", "tamper", allow_str=True)
            payload["model"] = _wrong_codes(payload["model"])
            out["reply.payload.arrays"], out["reply.payload.tree"] = _pack_raw(payload)
        return out

    job = {**FEDAVG, "rounds": 2, "filters": [{"name": "quantize", "bits": 8}]}
    run_dir, events = _tampered_run(tmp_path, "undo", job, garble)
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"]]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert {"0", "2"} <= set(trained.loc[trained["round"] == 1, "client_id"])


def test_an_oversized_reply_is_refused_with_its_size(tmp_path: Path) -> None:
    """Issue 38, item 9: a site that appended a 512 MiB tensor to its reply was taken over
    Flower with no event. An answer larger than what the method can send (four times the
    larger of the instruction and the model state, plus 64 MiB: a few MB for this model) is
    refused with its size in reply_events.csv; the run goes on with the other sites."""
    def pad(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        if node == 102 and kind == P.TRAIN and ctl.get("round") == 1:
            payload = wire.take(out, "reply.payload", "tamper", allow_str=True)
            payload["blob"] = torch.zeros(72 * 2**20 // 4)   # 72 MiB of float32
            out["reply.payload.arrays"], out["reply.payload.tree"] = _pack_raw(payload)
        return out

    run_dir, events = _tampered_run(tmp_path, "big", {**FEDAVG, "rounds": 2}, pad)
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"]]
    assert "MiB" in events["reason"].iloc[0] and "max-reply-mb" in events["reason"].iloc[0]
    flow = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str})
    assert flow.loc[(flow["round"] == 1) & (flow["client_id"] == "1") & (flow["phase"] == "train"),
                    "status"].tolist() == ["refused (size)"]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    # `medfl flower run --max-reply-mb 2` sets the bound instead
    from medfl.flower.deploy import make_run_config

    rc = make_run_config(workdir=tmp_path, result_file=tmp_path / "r.json", round_timeout=9, connect_timeout=9,
                         hello_timeout=9, config="train.json", max_reply_mb=2)
    assert RemoteSettings.from_run_config(rc).max_reply_mb == 2.0


def _wrong_codes(value: Any) -> Any:
    """Every tensor of ``value`` (a filtered state) as float32 noise of its shape."""
    if isinstance(value, torch.Tensor):
        return torch.randn(value.shape)
    if isinstance(value, dict):
        return {k: _wrong_codes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_wrong_codes(v) for v in value)
    return value


def test_cross_test_under_dp_over_the_grid_is_refused_or_recorded_as_not_private(tmp_path: Path) -> None:
    """Issue 38, item 2, over Flower: under ``dp_gaussian`` every site sent its evaluation
    model in the clear for ``cross_test`` and the summary said ``private: true``. Without the
    opt-in the coordinator refuses the config before any message; with it the models travel
    (``evaluate.score`` messages) and the summary says the run is not private and why."""
    from medfl.config import CROSS_TEST_IN_CLEAR, ConfigError

    job = {**FEDAVG, "rounds": 1, "eval_splits": ["test", "cross_test"],
           "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 1.0}]}
    with pytest.raises(ConfigError, match=r"fl\.cross_test \{\"under_dp\": \"send_models\"\}"):
        resolve_config(fl_config(tmp_path, "refused", job))
    fl = fl_config(tmp_path, "opted_in", {**job, "cross_test": {"under_dp": "send_models"}})
    grid = LoopTransport(_sites(tmp_path, fl))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    run_dir = Path(out["dir"]) / "fedavg"
    assert [k for _, k, _ in grid.sent].count(P.SCORE) == 3 and (run_dir / "cross_test.csv").is_file()
    privacy = json.loads((run_dir / "summary.json").read_text())["privacy"]
    assert privacy["private"] is False and privacy["epsilon"] is None
    assert privacy["sent_in_clear"] == [CROSS_TEST_IN_CLEAR] and CROSS_TEST_IN_CLEAR in privacy["not_covered"]


def test_undeclared_names_and_counts_from_a_site_are_dropped_with_the_site_named(tmp_path: Path) -> None:
    """Issue 38, item 3, at the coordinator: a modified site (its own checks skipped) sends
    a label as a training metric's name (site 1, round 1), a ``num_examples`` below its
    training split (site 2, round 2) and a validation scalar under an undeclared name (site
    0, round 1). On main all three reached train_metrics.csv / validation_metrics.csv; each
    is now dropped with the site named in reply_events.csv, and the run goes on."""
    from contract_methods import ValidatingAvg, methods_registered

    def garble(node: int, kind: str, ctl: dict[str, Any], out: Content) -> Content:
        r = ctl.get("round")
        if kind == P.TRAIN and (node, r) in ((102, 1), (103, 2)):
            payload = wire.take(out, "reply.payload", "tamper", allow_str=False)
            metrics = wire.take(out, "reply.metrics", "tamper", allow_str=False)
            n = int(wire.take_json(out, P.CONTROL, "tamper")["num_examples"])
            if node == 102:
                return wire.train_answer("1", payload, {**metrics, "label_of_sample_0_is_1": 1.0}, n)
            return wire.train_answer("2", payload, metrics, n - 1)
        if kind == P.VALIDATE and (node, r) == (101, 1):
            scores = wire.read_metrics(out["validate"], "tamper")
            return wire.validate_answer("0", {**scores, "first_label_1": 1.0})
        return out

    job = {**FEDAVG, "methods": [{"name": "test_validating_avg"}]}
    with methods_registered(ValidatingAvg, name="side-channels-grid"):
        run_dir, events = _tampered_run(tmp_path, "names", job, garble, method="test_validating_avg")
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"], [1, "0", "dropped"],
                                                                      [2, "2", "dropped"]]
    reasons = events["reason"].tolist()
    assert "train value name(s) 'label_of_sample_0_is_1' that method 'test_validating_avg' does not declare" in reasons[0]
    assert reasons[1].startswith("validate: validate value name(s) 'first_label_1'")
    assert "num_examples" in reasons[2] and "that method 'test_validating_avg' declares" in reasons[2]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    for name in ("train_metrics.csv", "validation_metrics.csv"):
        columns = pd.read_csv(run_dir / name).columns
        assert not any("label" in c for c in columns), (name, list(columns))


def test_only_the_coordinator_tracks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fl.tracking`` over Flower, the coordinator's experiment is the only place a
    tracker is built (the sites, in this process too, build none): TensorBoard's events land in
    the coordinator's experiment directory, one step per round; the final models, which stay
    at the sites, are not logged (said once)."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install \"medfl[tracking]\"")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import medfl.tracking as tracking
    import medfl.tracking_feed as tracking_feed

    built: list[Path] = []
    init = tracking_feed.Tracking.__init__

    def counted(self: Any, root: Path, *args: Any, **kwargs: Any) -> None:
        built.append(Path(root))
        init(self, root, *args, **kwargs)

    monkeypatch.setattr(tracking_feed.Tracking, "__init__", counted)
    fl = fl_config(tmp_path, "tracked", {**FEDAVG, "tracking": ["tensorboard"]})
    # the warning names where the clients ran (issue 49, item 6: it named fl.backend 'inprocess')
    with pytest.warns(tracking.TrackerWarning, match="the clients ran over Flower, at the sites, not in this process; "
                                                     "their models stay where they ran"):
        out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)
    assert built == [Path(out["dir"])]
    acc = EventAccumulator(str(Path(out["dir"]) / "tensorboard" / "fedavg"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/local_test/accuracy/mean")] == [1, 2]
    assert not list((tmp_path / "state").rglob("tensorboard")) and not list((tmp_path / "state").rglob("tracking.json"))


def test_scored_from_over_the_grid_equals_in_process(tmp_path: Path) -> None:
    """The coordinator asks the method's ``scored_from`` after every round over Flower as in
    process: the same best round among the rounds from it on, the same overall best, the same
    ``selection`` block and ``mechanisms.csv`` rows (issue 48, item 1)."""
    from contract_methods import NoisedFrom, methods_registered

    job = {**FEDAVG, "rounds": 5, "eval_every": 1, "eval_splits": ["val", "test"],
           "early_stopping": {"metric": "val/micro_f1", "patience": 2}, "methods": [{"name": NoisedFrom.name}]}
    with methods_registered(NoisedFrom, name="scored-from-over-flower"):
        flower, local, _ = _run_both(tmp_path, "scored", job)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (flower, local))
    assert a["selection"]["scored_from"] == 3 and a["early_stopping"]["best_round"] >= 3
    for block in ("early_stopping", "selection", "final", "rounds"):
        assert json.dumps(a[block], sort_keys=True) == json.dumps(b[block], sort_keys=True), block
    assert (flower / "mechanisms.csv").read_text() == (local / "mechanisms.csv").read_text()
