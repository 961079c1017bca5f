"""A slow machine makes a Flower run slower, never wrong or stuck (issue 39, item 6).

Real processes (a SuperLink, ``medfl flower site``, ``flwr run``, ``medfl flower run``) on
127.0.0.1, as in ``test_flower.py``. Load is not simulated by busy loops here (a test must
not depend on how loaded the machine is): the slowness load causes is made exact instead,
by a ``sitecustomize`` that holds a chosen Flower process at its start for a set time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.flower.deploy import LocalFederation  # noqa: E402

from flower_cases import FEDAVG, fl_config, wait_until_empty, write_config  # noqa: E402

#: A ``sitecustomize`` holding a process named ``{name}`` for ``{seconds}`` s at its start
#: (before it imports Flower), as a machine at load 30-70 does: the first such process only
#: (``O_EXCL`` on the marker file) or, with ``every``, each one; the marker file says it happened.
SLOW_START = '''
import os, sys, time
if sys.argv and os.path.basename(sys.argv[0]) == {name!r}:
    try:
        fd = os.open({marker!r}, os.O_CREAT | os.O_WRONLY | os.O_APPEND | (0 if {every!r} else os.O_EXCL))
    except FileExistsError:
        pass
    else:
        os.write(fd, (str(os.getpid()) + "\\n").encode())
        os.close(fd)
        time.sleep({seconds!r})
'''


def slow_start_env(folder: Path, name: str, seconds: float, every: bool = False) -> tuple[dict[str, str], Path]:
    """The environment that holds the first ``name`` process (with ``every``, each one)
    ``seconds`` at its start, and the marker file it writes then."""
    folder.mkdir(parents=True)
    marker = folder / f"{name}.started"
    (folder / "sitecustomize.py").write_text(SLOW_START.format(name=name, marker=str(marker), seconds=seconds,
                                                               every=every))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}, marker


def test_a_clientapp_slow_to_start_keeps_its_task_token(tmp_path: Path) -> None:
    """A ClientApp process that needs 40 s before it reports (Flower gives it 30 s; a
    machine at load 30-70 needs that long to import Flower) still answers its message: its
    task token does not expire, no second process is started for the message, and no
    ``401 Runtime task-token authentication failed`` is logged (before: the token expired
    at 30 s and the late process was refused with that 401). The sites start their
    ClientApps as Flower does (``MEDFL_FLOWER_CLIENTAPP_START=flower``: a new Python process,
    which the hook holds; a forked one imports nothing), as a site whose fork server cannot
    be reached does."""
    env, marker = slow_start_env(tmp_path / "hook", "flwr-clientapp", 40.0)
    env["MEDFL_FLOWER_CLIENTAPP_START"] = "flower"
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "slow", {**FEDAVG, "rounds": 1}))
    with LocalFederation(tmp_path / "fed", env=env) as fed:
        fed.start_superlink()
        for cid in ("0", "1", "2"):
            fed.start_site(cid, cfg, wait=False)
        fed.wait_for_nodes(3)
        res = fed.run(cfg, connect_timeout=400.0, round_timeout=400.0, hello_timeout=400.0, timeout=900.0,
                      name="slow")
        logs = {cid: fed.tail(f"site{cid}", 10**7) for cid in ("0", "1", "2")}
    assert res["ok"], res
    assert marker.is_file(), "no ClientApp was held at its start"
    for cid, log in logs.items():
        assert "task-token authentication failed" not in log, f"site {cid}:\n{log[-3000:]}"
        assert "401 Unauthorized" not in log, f"site {cid}:\n{log[-3000:]}"


#: What a run started by ``medfl flower run`` runs: the command itself, ``flwr run`` and the
#: ServerApp and ClientApp processes Flower starts for it (the SuperLink and the sites stay).
RUN_PROCESSES = ("flwr-serverapp", "flwr-clientapp", "bin/flwr", "medfl.cli")


def run_processes(fed: LocalFederation) -> list[str]:
    """The command lines of the federation's processes that belong to a run (not the
    SuperLink, a site's worker, SuperNode or SuperExec), read from ``/proc``."""
    out = []
    for pid in fed.stray_processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            # a ClientApp forked by a site's fork server runs under the launcher's command line, by its name
            cmd = f"[{Path(f'/proc/{pid}/comm').read_text().strip()}] {cmd}"
        except OSError:
            continue
        if any(name in cmd for name in RUN_PROCESSES) and "flower site" not in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def wait_until_gone(fed: LocalFederation, limit: float = 180.0) -> list[str]:
    """Wait (polling, up to ``limit`` s: a condition, not a sleep) until no process of a run
    is left; what is still there then."""
    return wait_until_empty(lambda: run_processes(fed), limit)


def test_flower_run_command_ends_with_one_error_and_leaves_no_process(tmp_path: Path) -> None:
    """`medfl flower run` on a real deployment whose ServerApp fails after it started (the
    sites answer its hello but draw another partition, so it refuses them all and fails once
    its connect timeout has passed), on a machine so loaded that every ServerApp process
    needs 35 s before it reports: the command exits non-zero with one
    ``medfl flower run: the run failed:`` line, and no process of the run (``flwr run``, the
    ServerApp, a ClientApp) remains. Before, the SuperLink took each ServerApp's task token
    back after 30 s and started another ServerApp every 30 s, each refused with a 401: the
    command never ended (killed here after 400 s)."""
    env, marker = slow_start_env(tmp_path / "hook", "flwr-serverapp", 35.0, every=True)
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "refused", {**FEDAVG, "rounds": 1}))
    with LocalFederation(tmp_path / "fed", env=env) as fed:
        superlink = fed.start_superlink()
        for cid in ("0", "1", "2"):
            fed.start_site(cid, cfg, overrides={"fl#partition#alpha": 0.3}, wait=False)
        fed.wait_for_nodes(3)
        proc = subprocess.run([sys.executable, "-m", "medfl.cli", "flower", "run", str(cfg), "--insecure",
                               "--superlink", superlink, "--connect-timeout", "20", "--progress-interval", "5"],
                              env=fed.env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
        left = wait_until_gone(fed)
    assert marker.read_text().split() and len(marker.read_text().split()) == 1, "one ServerApp, held at its start"
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("medfl flower run: the run failed:")]
    assert len(failed) == 1 and "no SuperNode serves client(s)" in failed[0], proc.stderr[-3000:]
    assert left == [], f"processes of the run left running: {left}"
