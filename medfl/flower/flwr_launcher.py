"""Supervise Flower's SuperLink and its SuperExec: ``medfl flower superlink`` runs this file.

``python flwr_launcher.py supervise --superexec JSON -- flower-superlink ARGS...`` starts
Flower's ``flower-superlink`` (with ``--isolation process``) and its ``flower-superexec`` (the
process that starts each run's ServerApp) side by side, both Flower's own documented commands
unchanged, and starts the SuperExec again whenever it exits while the SuperLink runs: Flower's
SuperExec exits at the first HTTP 500 of its task poll (SQLite's "database is locked" behind
``--database``), and a SuperLink that started it itself never starts another, so no later run
would start (:func:`supervise`). It only starts, watches and stops those commands: nothing of
Flower is changed in any process.

The file is run by path, not as ``python -m medfl...``: it imports the standard library only,
not medfl (and torch), so the SuperLink starts as fast as Flower's own command.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["supervise", "main"]

logger = logging.getLogger("medfl.flower.launcher")


def _say(message: str, level: int = logging.WARNING) -> None:
    """One ``medfl: ...`` line on stderr, through this file's own logger (run by path, it sets
    up no other logging)."""
    if not logger.handlers:
        handler = logging.StreamHandler()   # stderr
        handler.setFormatter(logging.Formatter("medfl: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.log(level, message)


def _prctl(option: int, value: int) -> None:
    """Linux's ``prctl(option, value)`` for this process; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass


def _signal_all(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each process of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; elsewhere none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:   # pragma: no cover - not Linux
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _reap_adopted(own: set[int]) -> list[int]:
    """Reap the adopted children of this process that have ended (not the ones in ``own``,
    which their ``Popen`` waits for); return the adopted children still running."""
    running = []
    for pid in _children(os.getpid()):
        if pid in own:
            continue
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if not done:
            running.append(pid)
    return running


def supervise(link_cmd: list[str], exec_cmd: list[str], *, backoff: float = 1.0, max_backoff: float = 30.0,
              poll: float = 0.2, grace: float = 10.0) -> int:
    """Run the SuperLink ``link_cmd`` and its SuperExec ``exec_cmd`` (``--parent-pid`` of this
    process is added) as children of this process until the SuperLink exits or this process
    is told to stop (SIGTERM, SIGINT); return the SuperLink's exit code.

    A SuperExec that exits while the SuperLink runs is started again after ``backoff``
    seconds, doubling up to ``max_backoff`` (reset after one that ran ``max_backoff``), with a
    line on stderr each time. The ServerApps it had started end with it (Flower's ServerApp
    watches the process that started it): their runs stop, and later runs start on the new
    SuperExec. Orphaned ServerApps are adopted by this process (a child subreaper) and reaped.

    Both children run in sessions of their own, so that a signal to this process's group
    (Ctrl-C, a service manager's stop) reaches this process only, and it stops them in
    order, as Flower's SuperLink stops its own SuperExec: the ServerApps first (SIGTERM, up to
    ``grace`` seconds), which tell the SuperLink that their runs stopped while it still
    answers, then the SuperExec, then the SuperLink. A supervisor that is killed takes both
    children down at once (a crash)."""
    stopping = threading.Event()
    exec_cmd = [*exec_cmd, "--parent-pid", str(os.getpid())]
    # orphaned descendants are handed to this process (Linux: PR_SET_CHILD_SUBREAPER), so that
    # the ServerApps of a SuperExec that died stay its descendants
    _prctl(36, 1)

    def start(cmd: list[str]) -> "subprocess.Popen[bytes]":
        # each child gets SIGKILL when the supervisor dies (PR_SET_PDEATHSIG): one that is killed
        # (a crash) takes them down at once, as a crash of Flower's SuperLink would
        return subprocess.Popen(cmd, start_new_session=True,   # noqa: PLW1509 - one thread here
                                preexec_fn=lambda: _prctl(1, int(signal.SIGKILL)))

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()

    link = start(link_cmd)
    superexec = start(exec_cmd)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _say(f"SuperLink pid {link.pid}, SuperExec pid {superexec.pid} (started again whenever it exits)", logging.INFO)
    delay, started, due, reaped = backoff, time.monotonic(), None, time.monotonic()
    while link.poll() is None:
        if stopping.wait(poll):
            break
        if time.monotonic() - reaped >= 2.0:     # a /proc scan: not at every poll
            _reap_adopted({link.pid, superexec.pid})
            reaped = time.monotonic()
        if superexec.poll() is None:
            continue
        if due is None:
            if time.monotonic() - started >= max_backoff:
                delay = backoff
            _say(f"the SuperExec exited with code {superexec.returncode} (an error of the SuperLink it polls, "
                 f"such as HTTP 500 'database is locked': see above); starting it again in {delay:g} s; "
                 "runs started from now on start on the new one")
            due, delay = time.monotonic() + delay, min(delay * 2, max_backoff)
        elif time.monotonic() >= due:
            superexec, started, due = start(exec_cmd), time.monotonic(), None
            _say(f"SuperExec pid {superexec.pid}", logging.INFO)
    _stop_in_order(link, superexec, grace)
    return int(link.returncode or 0)


def _stop_in_order(link: "subprocess.Popen[bytes]", superexec: "subprocess.Popen[bytes]", grace: float) -> None:
    """Stop what :func:`supervise` ran: the ServerApps first (the SuperExec's, and those a
    SuperExec that died left to this process), while the SuperLink still answers them; then
    the SuperExec; then the SuperLink; each given ``grace`` seconds after SIGTERM."""
    own = {link.pid, superexec.pid}
    apps = _reap_adopted(own) + (_children(superexec.pid) if superexec.poll() is None else [])
    _signal_all(apps, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(pid) for pid in apps):
        _reap_adopted(own)
        time.sleep(0.1)
    for child in (superexec, link):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    _signal_all(_reap_adopted(own) + _children(superexec.pid), signal.SIGKILL)
    _reap_adopted(own)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def main(argv: list[str]) -> int:
    """``flwr_launcher.py supervise --superexec JSON -- SUPERLINK_COMMAND...``: run the
    SuperLink command and the SuperExec command ``JSON`` (a list of words) side by side
    (:func:`supervise`); the SuperLink's exit code."""
    if argv[:2] != ["supervise", "--superexec"] or len(argv) < 5 or argv[3] != "--":
        _say(f"usage: {os.path.basename(__file__)} supervise --superexec JSON -- flower-superlink ARGS...")
        return 2
    try:
        exec_cmd = json.loads(argv[2])
    except ValueError:
        exec_cmd = None
    if not isinstance(exec_cmd, list) or not all(isinstance(a, str) for a in exec_cmd) or not exec_cmd:
        _say(f"error: --superexec {argv[2]!r}: expected a JSON list of the SuperExec command's words")
        return 2
    return supervise(argv[4:], exec_cmd)


if __name__ == "__main__":
    # run by path: Python put this file's folder (medfl/flower, with modules named site, server,
    # proxy...) first on sys.path, where it could shadow a module of the standard library
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
