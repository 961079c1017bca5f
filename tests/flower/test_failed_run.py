"""A run whose sites are late (issue 64): one line that says which sites registered and which
did not, the connect timeout and how to raise it; no traceback unless ``--debug``; a run
folder that ``medfl runs`` lists as ``failed to start``; a site that says when it waits for
the SuperLink and when it registered.

The sites are "late" deterministically: sites 1 and 2 are never started, and the runs give
up after a ``--connect-timeout`` of a few seconds. The first test runs the coordinator over
``test_coordinator``'s loop-back transport (no process); the others start real Flower processes
(a SuperLink, ``medfl flower site``, ``medfl flower run``), each with its own federation.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.runner import RunError  # noqa: E402
from local_federation import LocalFederation  # noqa: E402
from medfl.engine.remote import RemoteSettings  # noqa: E402
from medfl.flower.server import resume_flower, run_flower_experiment  # noqa: E402
from medfl.runs import find_run_dirs, run_row  # noqa: E402
from medfl.rundir import RunDir  # noqa: E402

from flower_cases import FEDAVG, fl_config, write_config  # noqa: E402
from test_coordinator import LoopTransport, VirtualClock, _sites  # noqa: E402
from test_startup_failures import federation  # noqa: E402,F401  (its SuperLink-only fixture)


def flower_run(fed: LocalFederation, cfg: Path, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``medfl flower run CFG`` against ``fed``, giving up on the sites after 3 s."""
    return subprocess.run([sys.executable, "-m", "medfl.cli", "flower", "run", str(cfg), "--insecure",
                           "--superlink", str(fed.superlink), "--connect-timeout", "3", "--progress-interval", "1",
                           *extra], env=fed.env, cwd=work, capture_output=True, text=True, timeout=900)


def failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line ``medfl flower run`` says of its failure (exit code 1)."""
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("medfl flower run:")]
    assert proc.returncode == 1 and len(said) == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert said[0].startswith("medfl flower run: the run failed: RunError: no SuperNode serves client(s)"), said
    return said[0]


def failed_to_start(output_dir: Path) -> str:
    """The status ``medfl runs`` shows for the one run under ``output_dir``, whose lock no
    process holds."""
    runs = find_run_dirs(output_dir)
    assert len(runs) == 1, runs
    assert not RunDir(runs[0]).locked_elsewhere()
    status = str(run_row(runs[0])["status"])
    assert status.startswith("failed to start: no SuperNode serves client(s)"), status
    return status


@pytest.fixture
def loop_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualClock]:
    """The coordinator on ``test_coordinator``'s virtual clock, as the loop-back transport's
    tests run it."""
    import medfl.engine.remote as remote
    import medfl.engine.remote_sites as remote_sites

    clock = VirtualClock()
    monkeypatch.setattr(remote, "time", clock)
    monkeypatch.setattr(remote_sites, "time", clock)
    yield clock


def test_connect_error_names_registered_and_missing_sites(tmp_path: Path, loop_clock: VirtualClock) -> None:
    """Over the loop-back transport: client 0's site answers, node 102 registered but never
    answers its hello (a site still starting), client 2 has no node: the error names each
    by client and node id, the timeout and how to raise it; the run is listed as failed to
    start, unlocked, and continues with ``--resume`` once the sites answer. With no node at
    all, the error says to start a site per client."""
    fl = fl_config(tmp_path, "late", FEDAVG)
    sites = _sites(tmp_path, fl)
    del sites[103]
    quick = RemoteSettings(round_timeout=1.0, connect_timeout=7.0, hello_timeout=0.2, poll_interval=0.01)
    grid = LoopTransport(sites, rule=lambda node, kind, ctl: "silent" if node == 102 else "ok")
    with pytest.raises(RunError) as err:
        run_flower_experiment(resolve_config(fl), grid, quick)
    msg = str(err.value)
    assert msg.startswith("no SuperNode serves client(s) ['1', '2'] after 7 s (connected: ['0']); "), msg
    assert ("; registered: client 0 (node 101), node 102 (no answer to medfl's hello yet); late or "
            "missing: client(s) 1, 2, not served within --connect-timeout 7 s: raise --connect-timeout") in msg, msg
    assert "no site registered" not in msg
    assert failed_to_start(tmp_path / "runs") == f"failed to start: {msg}"
    # once every site answers, the run that failed to start continues with --resume, from round 1
    out = resume_flower(find_run_dirs(tmp_path / "runs")[0], LoopTransport(_sites(tmp_path, fl, tag="b")), quick)
    assert run_row(Path(out["dir"]))["status"] == "finished"

    fl = fl_config(tmp_path / "none", "nobody", FEDAVG)
    with pytest.raises(RunError) as err:
        run_flower_experiment(resolve_config(fl), LoopTransport({}), quick)
    assert str(err.value) == (
        "no SuperNode serves client(s) ['0', '1', '2'] after 7 s (connected: []); no site registered at the "
        "SuperLink within --connect-timeout 7 s: start a site per client with `medfl flower site --client-id ID "
        "...` (sites still starting on a busy machine: raise --connect-timeout)")
    failed_to_start(tmp_path / "none" / "runs")


def test_run_without_sites_fails_in_one_line(federation: LocalFederation, tmp_path: Path) -> None:
    """No site started: one line that says no site registered and to start one per client
    (and the timeout it waited), no traceback, and a run `medfl runs` lists as failed to start."""
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "nobody", FEDAVG))
    proc = flower_run(federation, cfg, tmp_path)
    line = failure_line(proc)
    assert ("(connected: []); no site registered at the SuperLink within --connect-timeout 3 s: start a site per "
            "client with `medfl flower site --client-id ID ...`") in line, line
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert "ServerApp raised an exception" not in proc.stdout
    assert "medfl: waiting for sites" in proc.stdout   # the coordinator's progress still shows
    status = failed_to_start(tmp_path / "runs")
    assert "no site registered" in status


def test_late_sites_named_with_the_registered_one(federation: LocalFederation, tmp_path: Path) -> None:
    """Site 0 up and registered, sites 1 and 2 never started: the line names node N (the one
    site 0 printed) as registered and clients 1 and 2 as late or missing, with the timeout
    and the flag to raise it; ``--debug`` adds the ServerApp's traceback. Site 0 said that it
    waits for the SuperLink, then that it registered as node N."""
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "late", FEDAVG))
    federation.start_site("0", cfg)
    federation.wait_for_nodes(1)
    link = re.escape(str(federation.superlink))
    pattern = re.compile(rf"^medfl site 0: registered as node (\d+) at the SuperLink {link}$", re.M)
    deadline = time.monotonic() + 120   # a condition polled, not a sleep: the line follows Flower's at once
    while not pattern.search(federation.tail("site0", 10**6)) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = federation.tail("site0", 10**6)
    found = pattern.search(log)
    assert found, log[-3000:]
    node = found.group(1)
    activated = re.findall(r"Activated node_id=(\d+)", federation.tail("superlink", 10**7))
    assert activated == [node], activated   # the node id the SuperLink registered
    waiting = log.index(f"medfl site 0: waiting for the SuperLink at {federation.superlink}")
    assert waiting < found.start(), log[:3000]

    proc = flower_run(federation, cfg, tmp_path, "--debug")
    line = failure_line(proc)
    assert "no site registered" not in line, line
    # client 0 is served, or its site registered but had not answered the hello in 3 s: either way it is named
    assert re.search(rf"; registered: (client 0 \(node {node}\)|node {node} \(no answer to medfl's hello yet\)); "
                     r"late or missing: client\(s\) (0, )?1, 2, not served within --connect-timeout 3 s: raise "
                     r"--connect-timeout for sites still starting", line), line
    assert "Traceback (most recent call last)" in proc.stdout, proc.stdout[-3000:]   # --debug: Flower's report
    failed_to_start(tmp_path / "runs")
