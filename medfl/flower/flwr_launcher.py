"""Start Flower's SuperLink or SuperNode with a task-start window a loaded machine can meet.

A SuperNode (and the SuperLink, for the ServerApp) hands each task to a fresh process
(``flwr-clientapp``, ``flwr-serverapp``) with a task token, and takes the token back when the
process has not sent its first heartbeat within Flower's heartbeat interval (30 s). That
first heartbeat comes only once the new process has imported Flower (about 1.4 s of CPU
time); on a machine at load 30-70 that takes longer than 30 s, so the token expires, the task
is handed to yet another process (every 30 s, each adding to the load), and the late one is
refused with ``401 Runtime task-token authentication failed``: no site ever answers.

``medfl flower superlink`` and ``medfl flower site`` therefore start Flower through this file
(``python flwr_launcher.py flower-supernode ARGS...``), which widens the window of the task
states in that process to :func:`task_window` seconds (environment variable
:data:`TASK_WINDOW_ENV`, default :data:`DEFAULT_TASK_WINDOW`) before it runs Flower's own
command. A task process that dies without a word is then noticed after twice the window
instead of after 60 s; the coordinator's round timeout covers a site whose answer does not
come either way.

It also keeps a Flower process that has stopped working from looking alive. Flower's
SuperNode ends its work loop on an error of the SuperLink that its retries do not cover (an
HTTP 500, as SQLite's "database is locked" behind ``--database`` gives): it leaves the
federation (it unregisters itself), but its runtime API server is a non-daemon thread, so its
process lives on and ``medfl flower site`` never learns that it should start it again. Here,
once Flower's command has returned, a thread that keeps the process alive is given
:data:`LINGER` seconds, and then the process ends with :data:`LEFT_EXIT` (said on stderr).

``flwr_launcher.py supervise --superexec JSON -- flower-superlink ARGS...`` (what ``medfl
flower superlink`` runs) starts the SuperLink with ``--isolation process`` and its SuperExec
(the process that starts each run's ServerApp) beside it, and starts the SuperExec again
whenever it exits while the SuperLink runs: Flower's SuperExec exits at the first HTTP 500
of its task poll, and a SuperLink that started it itself never starts another, so no later
run would start (:func:`supervise`).

It also takes the SuperNode's idle waits down to :func:`node_poll` seconds (environment
variable :data:`NODE_POLL_ENV`, default :data:`DEFAULT_NODE_POLL`): Flower's SuperNode asks the
SuperLink for a message and, when there is none, sleeps a fixed 3 s before asking again
(``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``, Flower 1.42; no flag, no
environment variable, no constant), so every message waited up to 3 s before its site saw it,
and the evaluation that follows a training exchange nearly the whole 3 s (the site that answered
last had just gone back to sleep); it waits for its ClientApp's reply in 0.5 s steps too.
:func:`pace_supernode` gives that module its own view of ``time`` whose ``sleep`` waits at most
the interval (at most :data:`LOCAL_WAIT`, 0.02 s, for the looks at its own memory for the reply):
Flower's loop is unchanged otherwise, and a value of 3 or more leaves Flower's own waits. A
smaller interval is more requests to the SuperLink while sites are idle (one per site per
interval): ``docs/flower.md`` says what to choose.

It wakes a site's SuperExec when a message comes in. Flower's SuperNode starts a SuperExec
(``flower-superexec``) that asks it for a task every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
seconds (an HTTP request each time; medfl set 0.1 s, so that a message did not wait for it):
with four sites on 2 cores, asks and answers were about 7 % of a loopback round's CPU, and more than
half of an idle federation's. Here
(:func:`wake_superexec`) the SuperNode starts its SuperExec through this file with the read end
of a pipe, and writes a byte to it whenever it stores a message for a ClientApp; the
SuperExec's wait between two asks (:class:`WokenTime`) ends at that byte, and otherwise lasts
at least :data:`WOKEN_POLL` seconds; it asks the site's ClientApp fork server for each
ClientApp itself instead of starting the fork server's ``flwr-clientapp`` command
(:func:`direct_clientapps`). The SuperLink's SuperExec (which starts each run's
ServerApp) is woken the same way by the SuperLink when it creates a run (:func:`supervise`,
:func:`wake_on_runs`). Flower's loops are unchanged; a Flower release that starts its SuperExec,
stores messages or creates runs otherwise keeps its polling, with a warning.

Before it runs ``flower-supernode``, it starts the site's ClientApp fork server
(:mod:`medfl.flower.flwr_forks`; :data:`~medfl.flower.flwr_forks.MODE_ENV` = ``flower`` leaves
Flower's own start): each message's ClientApp is then forked from a process that has Flower
imported instead of importing it anew (about 2 s of CPU a message).

The file is run by path, not as ``python -m medfl...``: it imports Flower only, not medfl
(and torch), so the SuperLink and SuperNodes start as fast as Flower's own commands.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping

__all__ = ["TASK_WINDOW_ENV", "DEFAULT_TASK_WINDOW", "NODE_POLL_ENV", "DEFAULT_NODE_POLL",
           "LOCAL_WAIT", "COMMANDS", "LEFT_EXIT", "LINGER", "SUPERVISED_ENV", "task_window",
           "widen_task_window", "node_poll", "PacedTime", "pace_supernode", "WAKE_FD_ENV",
           "direct_clientapps", "WAKER_FD_ENV", "WOKEN_POLL", "WokenTime", "wake_superexec",
           "wait_for_wakes", "wake_on_runs", "run_flower", "supervise", "outlive_superexec", "main"]

#: Environment variable: seconds a new ClientApp/ServerApp process has to report (default below).
TASK_WINDOW_ENV = "MEDFL_FLOWER_TASK_WINDOW"
#: The default window, in seconds (Flower's own is 30 s).
DEFAULT_TASK_WINDOW = 300.0
#: Environment variable: the longest a site's SuperNode waits before asking the SuperLink
#: for a message again when it had none.
NODE_POLL_ENV = "MEDFL_FLOWER_NODE_POLL"
#: The default, in seconds (Flower's own SuperNode waits 3 s when idle, 0.5 s for a reply).
DEFAULT_NODE_POLL = 0.2
#: Flower's fixed idle wait; an interval of at least this leaves Flower's SuperNode as it is.
FLOWER_NODE_POLL = 3.0
#: The SuperNode's shorter waits (Flower: 0.5 s), for its ClientApp's reply and for content on
#: its way into its own store, look at memory of its own process, not over the network: medfl's
#: launcher takes them down to this many seconds (at most the polling interval).
LOCAL_WAIT = 0.02
_MIN_NODE_POLL = 0.01
#: Flower's SuperNode work loop (the module whose ``time.sleep`` calls are its waits).
_NODE_LOOP = "flwr.supernode.start_client_internal"
#: Flower's SuperExec loop (its ``time.sleep(task_poll_interval)`` is the wait between two asks).
_EXEC_LOOP = "flwr.supercore.superexec.run_superexec"
#: Flower's SuperExec executor that starts each task's process (``subprocess.Popen(args)``).
_EXECUTOR = "flwr.supercore.superexec.executor.subprocess_executor"
#: Flower's in-memory state of a SuperNode (its ``store_message`` takes each message that comes in).
_NODE_STATE = "flwr.supernode.nodestate.in_memory_nodestate"
#: Set for the SuperExec a SuperNode starts through :func:`wake_superexec`: the number of the
#: file descriptor (the read end of a pipe) on which its SuperNode wakes it.
WAKE_FD_ENV = "MEDFL_FLOWER_WAKE_FD"
#: Set for a SuperLink started by :func:`supervise`: the number of the file descriptor (the
#: write end of a pipe) on which it wakes its SuperExec when it creates a run.
WAKER_FD_ENV = "MEDFL_FLOWER_WAKER_FD"
#: Flower's SuperLink states (each ``create_run`` makes a run's ServerApp task).
_LINK_STATES = (("flwr.server.superlink.linkstate.in_memory_linkstate", "InMemoryLinkState"),
                ("flwr.server.superlink.linkstate.sql_linkstate", "SqlLinkState"))
#: The longest a woken SuperExec waits between two asks for a task when no wake comes (or
#: ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` if longer): Flower's own default interval.
WOKEN_POLL = 1.0
#: The Flower commands this starts: name -> (module, function) of its console script.
COMMANDS = {"flower-superlink": ("flwr.superlink.cli", "flower_superlink"),
            "flower-supernode": ("flwr.supernode.cli", "flower_supernode"),
            "flower-superexec": ("flwr.supercore.cli", "flower_superexec")}
#: Flower's task-state modules whose heartbeat interval sets how long a claimed task may stay silent.
_STATE_MODULES = ("flwr.supercore.corestate.in_memory_corestate", "flwr.supercore.corestate.sql_corestate")
_FLOWER_WINDOW = 30.0
#: The exit status of a Flower process whose command returned (its work loop ended: a SuperNode
#: has left the federation) while a thread of it would have kept the process alive.
LEFT_EXIT = 75
#: Seconds such a thread is given to end on its own once Flower's command has returned.
LINGER = 5.0
#: Set in the environment of the SuperExec :func:`supervise` starts (and so of its ServerApps).
SUPERVISED_ENV = "MEDFL_SUPEREXEC_SUPERVISED"


logger = logging.getLogger("medfl.flower.launcher")


def _say(message: str, level: int = logging.WARNING) -> None:
    """One ``medfl: ...`` line on stderr, through this file's own logger (run by path, it
    imports Flower only and sets up no other logging; Flower keeps its own)."""
    if not logger.handlers:
        handler = logging.StreamHandler()   # stderr
        handler.setFormatter(logging.Formatter("medfl: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.log(level, message)


def task_window(env: Mapping[str, str] | None = None) -> float:
    """The task-start window in seconds: :data:`TASK_WINDOW_ENV` of ``env`` (default: this
    process's environment), else :data:`DEFAULT_TASK_WINDOW`.

    Raises:
        ValueError: the variable is not a finite number of at least Flower's 30 s.
    """
    raw = (os.environ if env is None else env).get(TASK_WINDOW_ENV, "").strip()
    if not raw:
        return DEFAULT_TASK_WINDOW
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < _FLOWER_WINDOW:
        raise ValueError(f"{TASK_WINDOW_ENV}={raw!r}: expected the seconds a new ClientApp or ServerApp process "
                         f"has to report to its SuperNode or SuperLink, a number of at least {_FLOWER_WINDOW:g} "
                         f"(Flower's own window; default {DEFAULT_TASK_WINDOW:g})")
    return value


def widen_task_window(seconds: float) -> None:
    """Give a claimed task ``seconds`` (instead of Flower's 30 s) to send its first heartbeat,
    in this process's Flower task states.

    Raises:
        RuntimeError: this Flower release keeps the window elsewhere (medfl must be updated
            for it; starting anyway would bring back the 401s on a loaded machine).
    """
    for name in _STATE_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)):
            raise RuntimeError(f"{name} has no HEARTBEAT_DEFAULT_INTERVAL: this Flower release keeps the task "
                               "heartbeat window elsewhere; medfl cannot widen it")
        module.HEARTBEAT_DEFAULT_INTERVAL = max(float(seconds), float(module.HEARTBEAT_DEFAULT_INTERVAL))


def node_poll(env: Mapping[str, str] | None = None) -> float:
    """The SuperNode's polling interval in seconds: :data:`NODE_POLL_ENV` of ``env`` (default:
    this process's environment), else :data:`DEFAULT_NODE_POLL`.

    Raises:
        ValueError: the variable is not a finite number of seconds from 0.01 to 3600.
    """
    raw = (os.environ if env is None else env).get(NODE_POLL_ENV, "").strip()
    if not raw:
        return DEFAULT_NODE_POLL
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not _MIN_NODE_POLL <= value <= 3600.0:
        raise ValueError(f"{NODE_POLL_ENV}={raw!r}: expected the seconds a site's SuperNode waits before asking the "
                         f"SuperLink for a message again, a number from {_MIN_NODE_POLL:g} to 3600 (Flower's own "
                         f"wait is {FLOWER_NODE_POLL:g}; default {DEFAULT_NODE_POLL:g})")
    return value


def _source(module: Any) -> str:
    """The source of a Flower ``module`` (what the hooks below check before they touch it), or
    ``""`` where it cannot be read (no ``.py`` beside the bytecode)."""
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


class _ModuleView:
    """A stand-in for a module (``time``, ``subprocess``) that a Flower module sees instead of
    it: everything is the module's but what a subclass defines."""

    _module: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inherited_fd(name: str, env: Mapping[str, str] | None) -> int | None:
    """The open file descriptor that environment variable ``name`` of ``env`` (default: this
    process's) names, else ``None``; the variable is taken out of this process's environment
    (not for the processes it starts)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    os.environ.pop(name, None)
    if not raw.isdigit():
        return None
    try:
        os.fstat(int(raw))
    except OSError:
        return None
    return int(raw)


class PacedTime(_ModuleView):
    """The ``time`` module as Flower's SuperNode loop sees it once :func:`pace_supernode` ran:
    the same module, except that :meth:`sleep` waits at most :attr:`cap` seconds for Flower's
    idle wait (3 s: asking the SuperLink again) and at most :data:`LOCAL_WAIT` seconds (and at
    most :attr:`cap`) for its shorter ones (0.5 s: looking again at its own process's memory
    for its ClientApp's reply).

    Args:
        module: the ``time`` module (or a stand-in: tests).
        cap: the longest single wait, in seconds.
    """

    def __init__(self, module: Any, cap: float) -> None:
        self._module = module
        self.cap = float(cap)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or :attr:`cap` seconds if that is shorter; a wait shorter than
        Flower's idle wait (a look at the SuperNode's own memory) at most :data:`LOCAL_WAIT`."""
        seconds = float(seconds)
        limit = self.cap if seconds >= FLOWER_NODE_POLL else min(self.cap, LOCAL_WAIT)
        self._module.sleep(min(seconds, limit))


def pace_supernode(seconds: float) -> bool:
    """Make Flower's SuperNode in this process wait at most ``seconds`` between two asks for a
    message (instead of its fixed 3 s) and at most :data:`LOCAL_WAIT` between two looks for its
    ClientApp's reply (instead of 0.5 s); return whether it was done. Nothing is done for
    ``seconds`` of 3 or more (Flower's own waits), nor, with a warning, when this Flower
    release's loop is not the one this was written for (Flower 1.42's
    ``start_client_internal``): the SuperNode then keeps Flower's waits, which is slower, not
    wrong."""
    module = importlib.import_module(_NODE_LOOP)
    current = getattr(module, "time", None)
    if isinstance(current, PacedTime):
        current.cap = min(float(seconds), FLOWER_NODE_POLL)
        return True
    if float(seconds) >= FLOWER_NODE_POLL:
        return False
    source = _source(module)
    if current is not time or "time.sleep(3)" not in source:
        _say(f"warning: this Flower release's SuperNode ({_NODE_LOOP}) does not wait as Flower 1.42's does; it "
             f"keeps its own waits ({NODE_POLL_ENV} not applied)")
        return False
    module.time = PacedTime(time, seconds)
    return True


class WokenTime(_ModuleView):
    """The ``time`` module as Flower's SuperExec loop sees it once :func:`wait_for_wakes` ran:
    the same module, except that :meth:`sleep` (its wait between two asks for a task) ends as
    soon as a byte comes on ``fd`` (its SuperNode stored a message for a ClientApp) and lasts
    at least ``floor`` seconds otherwise.

    Each byte is one message: when several came during one ask, as many waits after it end at
    once, so no message waits for the fallback. Once the pipe has no writer left (the
    SuperNode is gone), the waits are the plain ``time.sleep`` again.

    Args:
        module: the ``time`` module (or a stand-in: tests).
        fd: the read end of the pipe the SuperNode writes to (made non-blocking here).
        floor: the shortest wait when no byte comes, in seconds.
    """

    def __init__(self, module: Any, fd: int, floor: float = WOKEN_POLL) -> None:
        self._module = module
        self.fd: int | None = fd
        self.floor = float(floor)
        self.pending = 0
        os.set_blocking(fd, False)

    def _drain(self) -> int:
        """Read what is on the pipe; the bytes read, or -1 at its end (no writer left)."""
        got = 0
        while self.fd is not None:
            try:
                data = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                os.close(self.fd)
                self.fd = None
                return got or -1
            got += len(data)
        return got

    def sleep(self, seconds: float) -> None:
        """Wait until the SuperNode's next byte, or ``max(seconds, floor)`` seconds; at once
        when a byte read before is still owed its ask."""
        if self.pending > 0:
            self.pending -= 1
            return
        if self.fd is None:
            self._module.sleep(seconds)
            return
        ready, _, _ = select.select([self.fd], [], [], max(float(seconds), self.floor))
        if ready:
            got = self._drain()
            if got < 0:                      # the SuperNode is gone: Flower's own waits
                self._module.sleep(seconds)
            else:
                self.pending += max(got - 1, 0)


class _SuperExecStarter(_ModuleView):
    """The ``subprocess`` module as Flower's SuperNode loop sees it once :func:`wake_superexec`
    ran: ``Popen(["flower-superexec", ...])`` (and only that) runs this file's
    ``flower-superexec`` with the pipe's read end (:data:`WAKE_FD_ENV`) instead."""

    def __init__(self, module: Any, fd: int) -> None:
        self._module = module
        self.fd: int | None = fd

    def Popen(self, args: Any, *more: Any, **options: Any) -> Any:  # noqa: N802 - subprocess's name
        """``subprocess.Popen``, except for the SuperNode's ``flower-superexec`` (see above)."""
        if (self.fd is None or more or options or not isinstance(args, list) or not args
                or args[0] != "flower-superexec"):
            return self._module.Popen(args, *more, **options)
        fd, self.fd = self.fd, None
        try:
            return self._module.Popen([sys.executable, os.path.abspath(__file__), *args],
                                      env={**os.environ, WAKE_FD_ENV: str(fd)}, pass_fds=(fd,))
        finally:
            os.close(fd)   # the SuperExec has its own; a byte written without it is dropped


def _wake(fd: int) -> None:
    """Write one byte to the SuperExec's pipe; a full pipe (it has bytes enough to wake) or one
    without a reader (the SuperExec is gone) is left as it is."""
    try:
        os.write(fd, b"\0")
    except OSError:
        pass


def wake_superexec() -> bool:
    """In a SuperNode's process, before Flower's command runs: start its SuperExec through
    this file (``flower-superexec``, with :func:`wait_for_wakes`) and wake it whenever a message
    for a ClientApp is stored (see the module's docstring); return whether it was done. Not
    done, with a warning, when this Flower release's SuperNode does not start its SuperExec
    and store its messages as Flower 1.42's does: the SuperExec then polls as Flower's does."""
    module = importlib.import_module(_NODE_LOOP)
    if isinstance(getattr(module, "subprocess", None), _SuperExecStarter):
        return True
    try:
        state_class = importlib.import_module(_NODE_STATE).InMemoryNodeState
    except (ImportError, AttributeError):
        state_class = None
    source = _source(module)
    if (state_class is None or getattr(module, "subprocess", None) is not subprocess
            or 'command = ["flower-superexec"]' not in source or "subprocess.Popen(command)" not in source
            or not callable(getattr(state_class, "store_message", None))):
        _say("warning: this Flower release's SuperNode does not start its SuperExec as Flower 1.42's does; the "
             "SuperExec looks for tasks every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds instead of being woken")
        return False
    read, write = os.pipe()
    os.set_blocking(write, False)
    store = state_class.store_message

    def store_message(self: Any, message: Any) -> Any:
        stored = store(self, message)
        if stored is not None and not getattr(message.metadata, "reply_to_message_id", ""):
            _wake(write)
        return stored

    store_message.__doc__ = store.__doc__
    state_class.store_message = store_message
    module.subprocess = _SuperExecStarter(subprocess, read)
    return True


def wake_on_runs(env: Mapping[str, str] | None = None) -> bool:
    """In a SuperLink started by :func:`supervise`: write a byte on the descriptor
    :data:`WAKER_FD_ENV` names whenever a run is created (its ServerApp's task), so that the
    SuperLink's SuperExec starts it at once; return whether it was done. Not done when the
    variable is absent or names no open descriptor, nor, with a warning, when this Flower
    release's SuperLink states have no ``create_run`` (its SuperExec then polls)."""
    fd = _inherited_fd(WAKER_FD_ENV, env)
    if fd is None:
        return False
    try:
        classes = [getattr(importlib.import_module(module), name) for module, name in _LINK_STATES]
    except (ImportError, AttributeError):
        classes = []
    if not classes or not all(callable(getattr(c, "create_run", None)) for c in classes):
        _say("warning: this Flower release's SuperLink does not create runs as Flower 1.42's does; its SuperExec "
             "looks for a run's ServerApp every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds instead of being woken")
        return False
    os.set_blocking(fd, False)
    for cls in classes:
        create = cls.__dict__.get("create_run")
        if create is None or getattr(create, "_medfl_wakes", False):
            continue

        def create_run(self: Any, *args: Any, _create: Any = create, **kwargs: Any) -> Any:
            run_id = _create(self, *args, **kwargs)
            if run_id:
                _wake(fd)
            return run_id

        create_run.__doc__ = create.__doc__
        create_run._medfl_wakes = True   # type: ignore[attr-defined]
        cls.create_run = create_run
    return True


class _ClientAppStarter(_ModuleView):
    """The ``subprocess`` module as Flower's SuperExec executor sees it once
    :func:`direct_clientapps` ran: ``Popen(["flwr-clientapp", ...])`` asks the site's fork
    server for the ClientApp itself (:func:`medfl.flower.flwr_forks.launch`) instead of starting
    the fork server's stub, a Python process, to ask it; anything else, and a ClientApp the
    fork server cannot start, is ``subprocess.Popen`` as before (the stub, which falls back to
    Flower's own ``flwr-clientapp``)."""

    def __init__(self, module: Any, forks: Any) -> None:
        self._module = module
        self._forks = forks
        self.running: list[Any] = []

    def Popen(self, args: Any, *more: Any, **options: Any) -> Any:  # noqa: N802 - subprocess's name
        """``subprocess.Popen``, except for ``flwr-clientapp`` (see above)."""
        self.running = [app for app in self.running if app.poll() is None]   # closes the ended ones' sockets
        quiet = options.get("stdout") == self._module.DEVNULL and options.get("stderr") == self._module.DEVNULL
        if (more or not isinstance(args, list) or not args or args[0] != "flwr-clientapp"
                or (options and (set(options) != {"stdout", "stderr"} or not quiet))):
            return self._module.Popen(args, *more, **options)
        null = os.open(os.devnull, os.O_RDWR) if quiet else None
        try:
            app = self._forks.launch(args[1:], (0, null, null) if quiet else (0, 1, 2))
        finally:
            if null is not None:
                os.close(null)
        if app is None:
            return self._module.Popen(args, *more, **options)
        self.running.append(app)
        return app


def direct_clientapps(forks: Any) -> bool:
    """In a site's SuperExec whose ``flwr-clientapp`` is the fork server's stub: have Flower's
    executor ask the fork server for each ClientApp itself (:class:`_ClientAppStarter`), one
    Python process fewer a message; return whether it was done. Not done, with a warning, when
    this Flower release's executor does not start its ClientApps with ``subprocess.Popen``."""
    module = importlib.import_module(_EXECUTOR)
    if isinstance(getattr(module, "subprocess", None), _ClientAppStarter):
        return True
    if getattr(module, "subprocess", None) is not subprocess or "subprocess.Popen(args)" not in _source(module):
        _say("warning: this Flower release's SuperExec starts its ClientApps otherwise than Flower 1.42's; each "
             "starts through the fork server's flwr-clientapp command instead")
        return False
    module.subprocess = _ClientAppStarter(subprocess, forks)
    return True


def wait_for_wakes(env: Mapping[str, str] | None = None) -> bool:
    """In a SuperExec started by :func:`wake_superexec`: make Flower's SuperExec loop wait for
    its SuperNode's bytes (:class:`WokenTime`) on the descriptor :data:`WAKE_FD_ENV` names;
    return whether it was done. Not done (the SuperExec polls as Flower's does) when the
    variable is absent or names no open descriptor, nor, with a warning, when this Flower
    release's loop waits otherwise."""
    fd = _inherited_fd(WAKE_FD_ENV, env)   # and not for the ClientApps it starts
    if fd is None:
        return False
    module = importlib.import_module(_EXEC_LOOP)
    if getattr(module, "time", None) is not time or "time.sleep(task_poll_interval)" not in _source(module):
        os.close(fd)
        _say("warning: this Flower release's SuperExec does not wait as Flower 1.42's does; it looks for tasks every "
             "FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds instead of being woken")
        return False
    module.time = WokenTime(time, fd)
    return True


def _lingering() -> list[threading.Thread]:
    """The threads other than this one that keep the process from exiting (non-daemon, alive)."""
    return [t for t in threading.enumerate()
            if t is not threading.current_thread() and not t.daemon and t.is_alive()]


def run_flower(entry: Callable[[], Any], name: str, linger: float = LINGER) -> int:
    """Run Flower's console function ``entry`` (command ``name``) here; its exit code.

    When it returns (or raises) while a non-daemon thread of it is still alive after
    ``linger`` seconds, the process ends at once (:func:`os._exit`) with :data:`LEFT_EXIT`
    (or the command's own non-zero code), saying so: a SuperNode whose work loop has ended
    must not look alive to the ``medfl flower site`` that would start it again."""
    how = "returned"
    try:
        result = entry()
        code = int(result) if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        how = f"exited with code {code}"
    except BaseException as exc:  # noqa: BLE001 - said, and the process ends with a code
        _say(f"{name} raised:\n{traceback.format_exc()}", logging.ERROR)
        code = 1
        how = f"stopped on {type(exc).__name__}: {exc}"
    deadline = time.monotonic() + linger
    for thread in _lingering():
        thread.join(max(0.0, deadline - time.monotonic()))
    left = _lingering()
    if left:
        code = code or LEFT_EXIT
        _say(f"{name} {how}, but its thread(s) {', '.join(t.name for t in left)} kept its process alive; "
             f"ending the process (exit code {code}) so that whoever runs it can start it again")
        sys.stdout.flush()
        for handler in logger.handlers:
            handler.flush()
        os._exit(code)
    return code


def _killed_with_parent() -> None:
    """In a child, before it runs: SIGKILL when the supervisor dies (Linux; elsewhere nothing).
    A supervisor that ends on its own first stops its children in order; one that is killed
    (a crash) takes them down at once, as a crash of Flower's SuperLink would."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass


def _adopt_orphans() -> None:
    """Make this process the one that orphaned descendants are handed to (Linux: a child
    subreaper), so that the ServerApps of a SuperExec that died stay its descendants."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):   # pragma: no cover - not Linux
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
    line on stderr each time. The ServerApps it had started go on (their environment names
    this process in :data:`SUPERVISED_ENV`: medfl's ServerApp then does not end with its
    SuperExec while this process lives, see :func:`outlive_superexec`); they stay
    descendants of this process.

    Flower's ``flower-superexec`` (an ``exec_cmd`` whose first word is named so) runs through
    this file with the read end of a pipe whose write end the SuperLink gets: the SuperLink
    writes a byte when it creates a run (:func:`wake_on_runs`) and the SuperExec starts its
    ServerApp at once instead of at its next look (:func:`wait_for_wakes`, at least every
    :data:`WOKEN_POLL` seconds). Both ends stay open here, so a SuperExec started again reads
    on the same pipe.

    Both children run in sessions of their own, so that a signal to this process's group
    (Ctrl-C, a service manager's stop) reaches this process only, and it stops them in
    order, as Flower's SuperLink stops its own SuperExec: the ServerApps first (SIGTERM, up to
    ``grace`` seconds), which tell the SuperLink that their runs stopped while it still
    answers, then the SuperExec, then the SuperLink. A supervisor that is killed takes both
    children down at once (a crash)."""
    stopping = threading.Event()
    exec_cmd = [*exec_cmd, "--parent-pid", str(os.getpid())]
    exec_env = {**os.environ, SUPERVISED_ENV: str(os.getpid())}
    link_env, link_fds, exec_fds = None, (), ()
    if os.path.basename(exec_cmd[0]) == "flower-superexec":   # woken by the SuperLink (see the module)
        read, write = os.pipe()   # both ends stay here: a SuperExec started again reads on
        exec_cmd = [sys.executable, os.path.abspath(__file__), "flower-superexec", *exec_cmd[1:]]
        exec_env[WAKE_FD_ENV], exec_fds = str(read), (read,)
        link_env, link_fds = {**os.environ, WAKER_FD_ENV: str(write)}, (write,)
    _adopt_orphans()

    def start(cmd: list[str], env: dict[str, str] | None = None,
              fds: tuple[int, ...] = ()) -> "subprocess.Popen[bytes]":
        return subprocess.Popen(cmd, env=env, start_new_session=True,   # noqa: PLW1509 - one thread here
                                preexec_fn=_killed_with_parent, pass_fds=fds)

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()

    link = start(link_cmd, link_env, link_fds)
    superexec = start(exec_cmd, exec_env, exec_fds)
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
                 "the runs it started go on")
            due, delay = time.monotonic() + delay, min(delay * 2, max_backoff)
        elif time.monotonic() >= due:
            superexec, started, due = start(exec_cmd, exec_env, exec_fds), time.monotonic(), None
            _say(f"SuperExec pid {superexec.pid}", logging.INFO)
    # the ServerApps first (the SuperExec's, and those a SuperExec that died left to this
    # process), while the SuperLink still answers them; then the SuperExec; then the SuperLink
    own = {link.pid, superexec.pid}
    apps = _reap_adopted(own) + (_children(superexec.pid) if superexec.poll() is None else [])
    for pid in apps:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
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
    for pid in _reap_adopted(own) + _children(superexec.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_adopted(own)
    return int(link.returncode or 0)


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


def outlive_superexec() -> bool:
    """In a ServerApp started by a SuperExec under :func:`supervise` (:data:`SUPERVISED_ENV`
    names the supervisor): do not end when that SuperExec ends while the supervisor lives
    (Flower's ServerApp watches the process that started it and stops itself when it is
    gone); return whether that was done. The supervisor starts another SuperExec, and the run
    goes on; a supervisor that is gone ends the run as before, a SuperLink that is gone too
    (its calls fail), and stopping the supervisor ends it (SIGTERM)."""
    raw = os.environ.get(SUPERVISED_ENV, "")
    if not raw.isdigit():
        return False
    try:
        from flwr.supercore import app_utils
    except ImportError:   # pragma: no cover - Flower reorganised
        return False
    exists = getattr(app_utils, "_pid_exists", None)
    if not callable(exists):
        _say("warning: this Flower release watches the ServerApp's SuperExec elsewhere: a run ends with its SuperExec")
        return False
    starter, supervisor = os.getppid(), int(raw)

    def alive(pid: int) -> bool:
        return bool(exists(supervisor)) if pid == starter else bool(exists(pid))

    app_utils._pid_exists = alive
    return True


def _forks() -> Any:
    """:mod:`medfl.flower.flwr_forks`, imported without the ``medfl`` package (this file is run
    by path, beside it)."""
    if __package__:
        from medfl.flower import flwr_forks
    else:
        spec = importlib.util.spec_from_file_location(
            "medfl_flwr_forks", os.path.join(os.path.dirname(os.path.abspath(__file__)), "flwr_forks.py"))
        flwr_forks = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(flwr_forks)
    return flwr_forks


def main(argv: list[str]) -> int:
    """``flwr_launcher.py NAME ARGS...``: run Flower's command ``NAME`` (one of
    :data:`COMMANDS`) with ``ARGS`` after widening the task window (:func:`run_flower`); its
    exit code. ``flwr_launcher.py supervise --superexec JSON -- NAME ARGS...``: run that
    command and the SuperExec command ``JSON`` (a list) side by side (:func:`supervise`)."""
    if argv[:2] == ["supervise", "--superexec"] and len(argv) > 4 and argv[3] == "--":
        try:
            exec_cmd = json.loads(argv[2])
        except ValueError:
            exec_cmd = None
        if not isinstance(exec_cmd, list) or not all(isinstance(a, str) for a in exec_cmd) or not exec_cmd:
            _say(f"error: --superexec {argv[2]!r}: expected a JSON list of the SuperExec command's words")
            return 2
        return supervise([sys.executable, os.path.abspath(__file__), *argv[4:]], exec_cmd)
    if not argv or argv[0] not in COMMANDS:
        _say(f"usage: {os.path.basename(__file__)} {{{','.join(COMMANDS)}}} ARGS... | "
             "supervise --superexec JSON -- flower-superlink ARGS...")
        return 2
    try:
        window = task_window()
        poll = node_poll()
        forks = _forks()   # loaded once: run by path, each call would load the file anew
        start_mode = forks.mode()
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2
    if argv[0] == "flower-superexec":
        forks._set_name(argv[0])   # as `ps -C` finds Flower's own (its first 15 bytes)
        wait_for_wakes()
        if start_mode == "fork":   # a site's ClientApps from its fork server (the SuperLink's starts none)
            direct_clientapps(forks)
    else:
        widen_task_window(window)
    if argv[0] == "flower-superlink":
        wake_on_runs()
    if argv[0] == "flower-supernode":
        pace_supernode(poll)
        forks.pace_pulls()
        if start_mode == "fork":
            forks.start(first_pull_wait=forks.FIRST_PULL_WAIT)
        wake_superexec()   # after the fork server: its pipe is not the fork server's
    module, function = COMMANDS[argv[0]]
    entry = getattr(importlib.import_module(module), function)
    # Flower reads its own name from argv[0] (logs, exit handling), as its console script sets it
    sys.argv = [os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]]
    return run_flower(entry, argv[0])


if __name__ == "__main__":
    # run by path: Python put this file's folder (medfl/flower, with modules named site, server,
    # proxy...) first on sys.path, where it could shadow what Flower imports
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
