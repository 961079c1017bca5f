"""A deployment that survives its database (issue 49, item 5), piece by piece and without a
SuperLink: Flower's SuperNode that ended its work loop on an HTTP 500 ("database is locked")
but whose process lived on is ended by its site, so ``medfl flower site`` starts it
again; ``medfl flower superlink``'s supervisor starts a SuperExec that exited again, and the
ServerApps it had started end with it; ``flwr run`` whose log stream failed is followed until its
run has ended. ``tests/flower/test_superlink_lock.py`` holds a real SuperLink's database
locked for 6 s mid-run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

import medfl.flower.deploy as deploy  # noqa: E402
from medfl.flower import flwr_launcher, worker  # noqa: E402
from medfl.flower.worker import exit_reason  # noqa: E402

LAUNCHER = str(Path(flwr_launcher.__file__).resolve())
#: the launcher loaded by path, as it runs (it imports Flower only)
LOAD = ("import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('launcher', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n")

# a SuperNode whose work loop ended while its Runtime API server thread (non-daemon) lives on:
# ``raises``: an uncaught exception of the main thread; ``500``: Flower's error line, then its
# main thread returns; ``thread``: an exception of another thread only, and a 4xx line
FLOWER = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(3600,), name="supernode-runtime-http-api").start()
if sys.argv[1] == "500":   # Flower 1.42's words, its colours included; then its main thread ends
    print("\\x1b[91mERROR \\x1b[0m:     Server error '500 Internal Server Error' for url "
          "'http://127.0.0.1:1/v1/fleet/pull-messages'", file=sys.stderr, flush=True)
    sys.exit(0)
if sys.argv[1] == "thread":
    print("\\x1b[91mERROR \\x1b[0m:     Server error '404 Not Found' for url 'x'", file=sys.stderr, flush=True)
    threading.Thread(target=lambda: 1 / 0).start()
    time.sleep(3600)
raise RuntimeError("boom")
"""


def test_a_supernode_whose_work_loop_raised_does_not_keep_its_process_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the process lived on with its server thread: the SuperNode had left the
    federation, and `medfl flower site`, waiting for it to exit, never started it again. Now
    the site ends it once Python's traceback of its main thread came; a thread's does not."""
    monkeypatch.setattr(worker, "LINGER", 0.5)
    ended: set[int] = set()
    proc = worker._start_supernode([sys.executable, "-c", FLOWER, "raises"], None, "site 0", ended)
    assert proc.wait(timeout=300) != 0 and ended == {proc.pid}
    logged = worker._start_supernode([sys.executable, "-c", FLOWER, "500"], None, "site 0", ended)
    assert logged.wait(timeout=300) != 0 and ended == {proc.pid, logged.pid}
    assert "left the federation while its process lived on: medfl ended it" in exit_reason(1, left=True)
    assert "left the federation" not in exit_reason(1)
    other = worker._start_supernode([sys.executable, "-c", FLOWER, "thread"], None, "site 1", ended)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=4.0)
        assert other.pid not in ended
    finally:
        other.kill()
        other.wait()


SUPERVISE = LOAD + """
import json
link = [sys.executable, "-c", sys.argv[2], sys.argv[4]]
superexec = [sys.executable, "-c", sys.argv[3], sys.argv[4]]
sys.exit(m.supervise(link, superexec, backoff=0.1, max_backoff=0.4, poll=0.05))
"""
# the SuperLink: until SIGTERM, or exit with code N after 0.5 s
LINK = ("import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "code = {code}\n"
        "time.sleep(0.5 if code else 3600)\n"
        "sys.exit(code)\n")
# the SuperExec: note the start and what it was told; the first one starts a "ServerApp" (a
# grandchild) and every one exits with code 1 soon after, as Flower's does on an HTTP 500
SUPEREXEC = ("import os, subprocess, sys, time\n"
             "d = sys.argv[1]\n"
             "first = not os.path.exists(os.path.join(d, 'starts.txt'))\n"
             "open(os.path.join(d, 'starts.txt'), 'a').write(os.environ.get('MEDFL_SUPEREXEC_SUPERVISED', '-') + ' '"
             " + ' '.join(sys.argv[2:]) + '\\n')\n"
             "if first:\n"
             "    app = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
             "    open(os.path.join(d, 'app.pid'), 'w').write(str(app.pid))\n"
             "time.sleep(0.2)\n"
             "sys.exit(1)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def test_the_superlink_supervisor_starts_a_superexec_that_exited_again(tmp_path: Path) -> None:
    """Before, Flower's SuperLink started its SuperExec once: after an HTTP 500 of its task
    poll no run ever started again. Now it is started again, and stopping the supervisor ends
    everything, a ServerApp its SuperExec left behind included."""
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISE, LAUNCHER, LINK.format(code=0), SUPEREXEC, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    starts = tmp_path / "starts.txt"
    deadline = time.monotonic() + 600    # a condition, with a generous limit (loaded machine)
    while time.monotonic() < deadline and (not starts.is_file() or len(starts.read_text().splitlines()) < 5):
        time.sleep(0.1)
    app = int((tmp_path / "app.pid").read_text())
    assert proc.poll() is None, "the supervisor runs on"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    lines = starts.read_text().splitlines()
    assert len(lines) >= 5 and all(ln.startswith(f"- --parent-pid {proc.pid}") for ln in lines), lines
    assert "medfl: the SuperExec exited with code 1" in err
    # the wait starts at backoff and doubles up to max_backoff, or starts again at backoff after a
    # SuperExec that ran max_backoff (which one depends on how loaded the machine is: both are right)
    waits = [float(w) for w in re.findall(r"starting it again in ([\d.]+) s", err)]
    assert len(waits) >= 4 and waits[0] == 0.1, err
    assert all(w in (0.1, min(2 * v, 0.4)) for v, w in zip(waits, waits[1:])), waits
    deadline = time.monotonic() + 120
    while _alive(app) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(app), "the ServerApp a SuperExec left behind was ended with the supervisor"


def test_the_supervisor_ends_with_its_superlink(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SUPERVISE, LAUNCHER, LINK.format(code=3),
                           "import time; time.sleep(3600)", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr          # the SuperLink's code; its SuperExec was ended


def _fake_flwr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, statuses: list[str | None], last: str = "") -> list[int]:
    """``flwr run`` that starts run 42 and ends at once (its log stream failed; ``last``: its
    last line); the run's status at the SuperLink goes through ``statuses``; return the list
    of asked run ids."""
    script = tmp_path / "flwr"
    script.write_text(f"#!{sys.executable}\nprint('Successfully started run 42', flush=True)\nprint({last!r})\n")
    script.chmod(0o755)
    monkeypatch.setattr(deploy, "_bin", lambda name: str(script))
    monkeypatch.setattr(deploy, "FOLLOW_INTERVAL", 0.01)
    asked: list[int] = []

    def status(run_id: int, home: Path, env: dict[str, str] | None = None) -> str | None:
        asked.append(run_id)
        return statuses[min(len(asked), len(statuses)) - 1]

    monkeypatch.setattr(deploy, "run_status", status)
    return asked


def test_flwr_run_whose_log_stream_ended_follows_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `flwr run --stream` returned when an HTTP 500 broke its log stream, and the run
    was reported as ended without a result while it went on."""
    asked = _fake_flwr(tmp_path, monkeypatch, ["running", None, "running", "finished:completed"])
    log = tmp_path / "out.log"
    with open(log, "wb") as fh:
        assert deploy.flwr_run(tmp_path / "app", "127.0.0.1:1", {}, flwr_home=tmp_path / "home", stream_to=fh) == 0
    assert asked == [42] * 4
    text = log.read_text()
    assert "Successfully started run 42" in text
    assert text.count("medfl: the log stream of run 42 ended before the run (running); waiting for the run to end "
                      "at the SuperLink (its whole log: `flwr log 42`)") == 1
    # the ServerApp's result is there: nothing to ask
    asked = _fake_flwr(tmp_path, monkeypatch, ["running"])
    with open(log, "wb") as fh:
        deploy.flwr_run(tmp_path / "app", "127.0.0.1:1", {}, flwr_home=tmp_path / "home", stream_to=fh,
                        done=lambda: True)
    assert asked == []
    # the stream ended because the SuperLink went away: its ServerApp went with it (a restarted
    # SuperLink on its database would say "running" until the run's heartbeat window ran out)
    asked = _fake_flwr(tmp_path, monkeypatch, ["running"], last="Connection to the SuperLink is unavailable. Please")
    with open(log, "wb") as fh:
        deploy.flwr_run(tmp_path / "app", "127.0.0.1:1", {}, flwr_home=tmp_path / "home", stream_to=fh)
    assert asked == []
    # the ServerApp writes its result while the run is followed
    asked = _fake_flwr(tmp_path, monkeypatch, ["running"])
    with open(log, "wb") as fh:
        deploy.flwr_run(tmp_path / "app", "127.0.0.1:1", {}, flwr_home=tmp_path / "home", stream_to=fh,
                        done=lambda: len(asked) >= 3)
    assert len(asked) == 3
    # a SuperLink that no longer answers is not waited for beyond FOLLOW_SILENCE
    asked = _fake_flwr(tmp_path, monkeypatch, [None])
    monkeypatch.setattr(deploy, "FOLLOW_SILENCE", 0.05)
    with open(log, "wb") as fh:
        deploy.flwr_run(tmp_path / "app", "127.0.0.1:1", {}, flwr_home=tmp_path / "home", stream_to=fh)
    assert len(asked) >= 2 and "the SuperLink has not answered about run 42 for 0.05 s" in log.read_text()


# a process that says in ``up.txt`` that it runs, notes in ``order.txt`` that it got SIGTERM, then ends
NOTE_TERM = ("import os, signal, sys, time\n"
             "def note(*_):\n"
             "    open(os.path.join(sys.argv[1], 'order.txt'), 'a').write('{who}\\n')\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, note)\n"
             "{before}"
             "open(os.path.join(sys.argv[1], 'up.txt'), 'a').write('{who}\\n')\n"
             "time.sleep(3600)\n")
# the SuperExec: starts a ServerApp (that notes its SIGTERM) and runs on
KEEPS = NOTE_TERM.format(who="superexec", before=(
    "import subprocess\n"
    f"subprocess.Popen([sys.executable, '-c', {NOTE_TERM.format(who='serverapp', before='')!r}, sys.argv[1]])\n"))


def test_a_stop_signal_to_the_group_stops_the_serverapps_then_the_superexec_then_the_superlink(tmp_path: Path) -> None:
    """Ctrl-C or a service manager signal the supervisor's whole process group: before, it
    reached the SuperLink with everything else, so a run's ServerApp could not tell the
    SuperLink that it stopped, and the restarted SuperLink sent its old messages to the sites."""
    link = NOTE_TERM.format(who="superlink", before="")
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISE, LAUNCHER, link, KEEPS, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    up = tmp_path / "up.txt"
    deadline = time.monotonic() + 600    # a condition, with a generous limit (loaded machine)
    while time.monotonic() < deadline and (not up.is_file() or len(up.read_text().split()) < 3):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (tmp_path / "order.txt").read_text().split() == ["serverapp", "superexec", "superlink"]
