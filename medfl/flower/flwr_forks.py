"""Start a site's ClientApp processes from a warm process instead of from scratch.

Flower 1.42's SuperNode hands every message to a new ``flwr-clientapp`` process (its
SuperExec runs the command found first on ``PATH`` with a task token). Importing Flower in
that process takes about 2 s of CPU before it asks for its message: on 2 cores with three
sites, that was 10 s of a 14 s loopback round (``benchmarks/flower_overhead.py``), and no
Flower setting changes it.

:func:`start` (called by :mod:`medfl.flower.flwr_launcher` before it runs
``flower-supernode``) forks a *fork server*: a single-threaded process that imports Flower's
ClientApp runtime once and then waits on a Unix socket in a private folder (mode 0700). In
that folder it writes an executable ``flwr-clientapp`` (:data:`STUB`, a few lines of Python
run with ``-IS``: no site-packages, no Flower) and puts the folder first on the ``PATH`` that
the SuperNode and its SuperExec inherit. When the SuperExec starts ``flwr-clientapp ARGS``,
the stub hands ``ARGS``, its environment, working folder and standard streams (file
descriptors over the socket) to the fork server, which forks a child that runs Flower's own
``flwr-clientapp`` entry point with them: the same code, arguments and streams, minus the
imports. The stub stays until that child ends, passes SIGTERM/SIGINT on to it, and exits with
its exit code, so to the SuperExec it is the ClientApp process.

The child has the stub's environment, but what Flower reads from the environment when it is
imported (``FLWR_TELEMETRY_ENABLED``, ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``...) it read in the fork server, which has the
SuperNode's environment, as its SuperExec and so Flower's own ClientApps do.

A site's SuperExec, which :mod:`medfl.flower.flwr_launcher` runs, does not start the stub at
all: :func:`launch` sends the stub's request from the SuperExec's own process (one Python
start fewer a message) and falls back to the stub when the fork server does not answer.

Nothing of Flower's code is changed: each task's ClientApp runs Flower's own
``flwr-clientapp`` entry point with Flower's arguments. When the fork server cannot be reached, the stub
replaces itself with Flower's own ``flwr-clientapp`` (:data:`REAL_ENV`), so a message is never
lost to it. :data:`MODE_ENV` = ``flower`` leaves Flower's own start. The fork server ends
with the process that started it (Linux ``PR_SET_PDEATHSIG``), and its children with it.

Like the launcher, this file imports nothing of medfl: it runs beside Flower only.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from typing import Any

__all__ = ["logger", "MODE_ENV", "MODES", "REAL_ENV", "STARTED_ENV", "STUB", "WARM_MODULES",
           "FIRST_PULL_WAIT", "ForkServer", "Launched", "launch", "start", "mode", "pace_pulls"]

#: Environment variable: how a site's ClientApp processes start: ``fork`` (default: from the
#: fork server) or ``flower`` (Flower's own: a new Python process that imports Flower).
MODE_ENV = "MEDFL_FLOWER_CLIENTAPP_START"
MODES = ("fork", "flower")
#: Set in the stub's environment: the path of Flower's own ``flwr-clientapp`` it falls back to.
REAL_ENV = "MEDFL_FLOWER_REAL_CLIENTAPP"
#: Set in a forked ClientApp's environment: when its stub started (``CLOCK_BOOTTIME`` seconds),
#: so the ClientApp's age (``medfl.flower.proxy.process_age``) counts from the start Flower asked for.
STARTED_ENV = "MEDFL_CLIENTAPP_STARTED"
#: The Flower modules the fork server imports once (the ClientApp's command and runtime).
WARM_MODULES = ("flwr.supernode.cli.flwr_clientapp", "flwr.clientapp", "flwr.app", "flwr.common.serde",
                "httpx", "httpcore", "h11")
#: The first wait before asking again for a message's content that has not arrived
#: (:func:`pace_pulls`; Flower's own is 1 s). It doubles on each miss, so a content that takes
#: T seconds to arrive costs about log2(T / FIRST_PULL_WAIT) requests more than Flower's.
FIRST_PULL_WAIT = 0.05
_SOCKET = "forks.sock"
_COMMAND = "flwr-clientapp"
_MAX_REQUEST = 1 << 20

#: The ``flwr-clientapp`` the SuperExec finds first on ``PATH`` (``{python}``, ``{socket}``:
#: filled in by :func:`start`). It imports the standard library only.
STUB = r'''#!{python} -IS
"""medfl: Flower's flwr-clientapp, started by the site's fork server (medfl/flower/flwr_forks.py)."""
import json, os, signal, socket, sys, time
started = time.clock_gettime(time.CLOCK_BOOTTIME)
real = os.environ.get("{real_env}", "")
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect({socket!r})
    request = json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                          "started": started}}).encode()
    socket.send_fds(sock, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    reader = sock.makefile("rb")
    pid = int(json.loads(reader.readline())["pid"])
except (OSError, ValueError, KeyError, TypeError):
    if not real:
        sys.exit("medfl: the site's fork server is not reachable and {real_env} is not set")
    os.execv(real, [real, *sys.argv[1:]])
def _pass_on(signum, _frame):
    try:
        os.kill(pid, signum)
    except OSError:
        pass
signal.signal(signal.SIGTERM, _pass_on)
signal.signal(signal.SIGINT, _pass_on)
line = reader.readline()
sys.exit(int(json.loads(line)["code"]) if line else 1)
'''


logger = logging.getLogger("medfl.flower.forks")
_handler: logging.StreamHandler | None = None   # type: ignore[type-arg]


def _say(message: str, level: int = logging.WARNING, prefix: str = "medfl: ") -> None:
    """One line on this process's stderr through this file's own logger (run beside Flower,
    with no logging set up but Flower's); ``prefix`` starts it."""
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(_handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    _handler.stream = sys.stderr   # the stderr of now (a fork's own); not setStream: it flushes the old one
    logger.log(level, prefix + message)


def mode(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """How the site's ClientApps start: :data:`MODE_ENV` of ``env`` (default: this process's
    environment), else ``fork``.

    Raises:
        ValueError: the variable is set to something else than one of :data:`MODES`.
    """
    raw = (os.environ if env is None else env).get(MODE_ENV, "").strip().lower()
    if not raw:
        return MODES[0]
    if raw not in MODES:
        raise ValueError(f"{MODE_ENV}={raw!r}: expected how a site's ClientApp processes start, one of "
                         f"{', '.join(MODES)} (fork: from medfl's fork server, the default; flower: Flower's own "
                         "new process per message)")
    return raw


def _set_name(name: str) -> None:
    """Linux: this process's name as ``ps -C``/``top`` show it (15 bytes at most; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass


def _set_parent_death_signal(signum: int) -> None:
    """Linux: this process gets ``signum`` when the thread that forked it ends (elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One stub's request (an 8-byte length, then JSON) and the file descriptors sent with it."""
    conn.settimeout(30.0)
    head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    while len(head) < 8:
        more = conn.recv(8 - len(head))
        if not more:
            raise OSError("the stub closed the connection")
        head += more
    size = int.from_bytes(head, "big")
    if size > _MAX_REQUEST:
        raise OSError(f"a request of {size} bytes")
    body = b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise OSError("the stub closed the connection")
        body += more
    request = json.loads(body)
    if (not isinstance(request, dict) or not isinstance(request.get("argv"), list)
            or not all(isinstance(a, str) for a in request["argv"]) or not isinstance(request.get("env"), dict)):
        raise ValueError("a request without argv and env")
    return request, list(fds)


class Launched:
    """A ClientApp the fork server forked for :func:`launch` (the stub's part, in the caller's
    process): its pid, and its exit code once the fork server has said it (:meth:`poll`)."""

    def __init__(self, conn: socket.socket, pid: int, rest: bytes = b"") -> None:
        self.conn: socket.socket | None = conn
        self.pid = pid
        self.returncode: int | None = None
        self._rest = rest
        conn.setblocking(False)

    def poll(self) -> int | None:
        """The ClientApp's exit code if the fork server has said it (the connection is then
        closed), else ``None``; never waits."""
        if self.conn is None:
            return self.returncode
        try:
            while not self._rest.endswith(b"\n"):
                more = self.conn.recv(256)
                if not more:
                    break
                self._rest += more
            self.returncode = int(json.loads(self._rest)["code"]) if self._rest else 1
        except BlockingIOError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            self.returncode = 1
        self.conn.close()
        self.conn = None
        return self.returncode


def launch(argv: list[str], fds: tuple[int, int, int] = (0, 1, 2), command: str | None = None) -> Launched | None:
    """Ask the fork server for a ClientApp with ``argv`` (Flower's ``flwr-clientapp`` arguments),
    this process's environment and working folder, and ``fds`` as its standard streams, as its
    stub would, without starting the stub; ``None`` where that cannot be done (the
    ``flwr-clientapp`` first on ``PATH``, or ``command``, is not a fork server's stub, or its
    server does not answer): then start the command as usual. What a site's SuperExec does for
    each message (:func:`medfl.flower.flwr_launcher.direct_clientapps`): one Python process
    fewer a message. The ClientApp ends with the fork server (it signals its children when
    it ends), and watches its ``--parent-pid`` as Flower's does."""
    found = command or shutil.which(_COMMAND)
    if not found:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(found)), _SOCKET)
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
        started = time.clock_gettime(time.CLOCK_BOOTTIME)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30.0)
        try:
            conn.connect(path)
            request = json.dumps({"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(),
                                  "started": started}).encode()
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], list(fds))
            got = b""
            while b"\n" not in got:
                more = conn.recv(256)
                if not more:
                    raise OSError("the fork server closed the connection")
                got += more
            line, rest = got.split(b"\n", 1)
            pid = int(json.loads(line)["pid"])
        except BaseException:
            conn.close()
            raise
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Launched(conn, pid, rest)


def _fresh_randomness() -> None:
    """Seed NumPy's global generator from the OS, as a new process's import would: every fork
    would otherwise draw what the fork server's would (Flower's SecAgg+ quantizes with
    ``np.random.rand``). Python's ``random`` reseeds itself after a fork."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(None)


def _run_clientapp(request: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: become the ClientApp process ``request`` describes; its exit code."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    if isinstance(request.get("started"), (int, float)):
        os.environ[STARTED_ENV] = repr(float(request["started"]))
    try:
        os.chdir(str(request.get("cwd") or "/"))
    except OSError:
        pass
    sys.argv = [_COMMAND, *request["argv"]]
    _fresh_randomness()
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    try:
        flwr_clientapp()
        return 0
    except SystemExit as exc:   # as the interpreter ends a process: a code, or a message on stderr and 1
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        _say(str(exc.code), logging.ERROR, prefix="")
        return 1
    except BaseException:   # noqa: BLE001 - said on the ClientApp's stderr; the exit code says it failed
        _say(traceback.format_exc().rstrip(), logging.ERROR, prefix="")
        return 1


class ForkServer:
    """The fork server's loop (it runs in its own process: :func:`start`).

    Args:
        listener: the listening Unix socket the stubs connect to.
        folder: the private folder that holds the socket and the stub (removed on exit).
    """

    def __init__(self, listener: socket.socket, folder: str) -> None:
        self.listener = listener
        self.folder = folder
        self.waiting: dict[int, socket.socket] = {}   # child pid -> its stub's connection
        self.stop = False

    def _fork(self, conn: socket.socket) -> None:
        """Fork one ClientApp for the stub on ``conn`` and tell the stub its pid."""
        try:
            request, fds = _recv_request(conn)
        except (OSError, ValueError) as exc:
            _say(f"fork server: a bad request ({exc}); the stub falls back to Flower's own start")
            conn.close()
            return
        _flush_streams()
        pid = os.fork()
        if pid == 0:   # the ClientApp
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.listener.close()
                for other in self.waiting.values():
                    other.close()
                conn.close()
                _set_parent_death_signal(signal.SIGTERM)
                _set_name(_COMMAND)   # `ps -C flwr-clientapp` finds it as it finds Flower's own
                code = _run_clientapp(request, fds)
            finally:
                _flush_streams()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass
        self.waiting[pid] = conn

    def _reap(self) -> None:
        """Tell each stub whose ClientApp has ended its exit code."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.waiting.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(json.dumps({"code": code if code >= 0 else 128 - code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()

    def serve(self) -> None:
        """Answer stubs until SIGTERM/SIGINT or the process that started this one is gone."""
        def stop(_signum: int, _frame: Any) -> None:
            self.stop = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            while not self.stop:
                ready, _, _ = select.select([self.listener, wake_r], [], [], 1.0)
                if wake_r in ready:
                    os.read(wake_r, 4096)
                self._reap()
                if self.listener in ready:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    self._fork(conn)
        finally:
            self.listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            for pid in list(self.waiting):
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass


def _flush_streams() -> None:
    """Flush this process's stdout and stderr (before a fork: a child would write them again)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _exit_now(_signum: int, _frame: Any) -> None:
    """A signal handler that ends the process through its ``finally`` blocks."""
    raise SystemExit(0)


def _warm_up() -> None:
    """Import what every ClientApp imports, once, in the fork server; then freeze what that
    made (:func:`gc.freeze`), so that a forked ClientApp's garbage collections never visit, and
    so never copy, the memory pages it shares with the fork server."""
    import gc
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:   # a module a later Flower no longer needs: its ClientApps import what they need
            pass
    try:   # httpx imports its transport (httpcore's connection pool) on a client's first use
        import httpx

        httpx.Client().close()
    except Exception:   # noqa: BLE001 - a warm-up only
        pass
    gc.collect()
    gc.freeze()


def pace_pulls(seconds: float = FIRST_PULL_WAIT) -> bool:
    """Make this process's Flower ask again for a message's content that is not there yet
    after ``seconds`` (doubling from there, as Flower does) instead of after 1 s; return
    whether it was done. Flower lists a message before its content has arrived: a SuperNode
    hands a message to its ClientApp before it has pulled the content from the SuperLink, and
    the SuperLink gives out a message before its sender has pushed all of it. A ClientApp that
    took 2 s to import Flower never found the content missing; a forked one often does, and
    each side's first wait was then a whole 1 s (``PULL_INITIAL_BACKOFF``). Nothing is done
    for ``seconds`` of 1 or more, nor, with a line on stderr, when this Flower release pulls
    otherwise (it keeps its waits: slower, not wrong)."""
    try:
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError:
        inflatable_utils = None
    found = [getattr(getattr(inflatable_utils, name, None), "__kwdefaults__", None)
             for name in ("pull_objects", "pull_and_inflate_object_from_tree")]
    if not all(isinstance(d, dict) and isinstance(d.get("initial_backoff"), (int, float)) for d in found):
        _say("warning: this Flower release pulls a message's content otherwise than Flower 1.42; it keeps its "
             "own waits")
        return False
    done = False
    for defaults in found:
        if float(seconds) < float(defaults["initial_backoff"]):
            defaults["initial_backoff"] = float(seconds)
            done = True
    return done


def start(real_command: str | None = None, first_pull_wait: float | None = None) -> str | None:
    """Fork the fork server and put its ``flwr-clientapp`` first on this process's ``PATH``;
    return the folder that holds them, or ``None`` where it could not be done (not Linux, a
    ``TMPDIR`` too long for a Unix socket, ...: a line on stderr says why, and the site keeps
    Flower's own start). Call it before anything starts a thread: the fork server is a fork.

    Args:
        real_command: Flower's own ``flwr-clientapp`` (default: the one on ``PATH`` now); the
            stub runs it when the fork server cannot be reached.
        first_pull_wait: :func:`pace_pulls` in the forked ClientApps (``None``: Flower's 1 s).
    """
    real = real_command or shutil.which(_COMMAND)
    if not real:
        _say(f"{_COMMAND} not found on PATH; the SuperNode starts its ClientApps as Flower does")
        return None
    try:
        folder = tempfile.mkdtemp(prefix="medfl-clientapps-")
        path = os.path.join(folder, _SOCKET)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        stub = os.path.join(folder, _COMMAND)
        with open(stub, "w", encoding="utf-8") as fh:
            fh.write(STUB.format(python=sys.executable, socket=path, real_env=REAL_ENV))
        os.chmod(stub, stat.S_IRWXU)
    except (OSError, AttributeError) as exc:
        _say(f"the ClientApp fork server could not start ({exc}); the SuperNode starts its ClientApps as "
             "Flower does")
        return None
    _flush_streams()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:   # the fork server
        code = 0
        try:
            signal.signal(signal.SIGTERM, _exit_now)   # until serve() takes over: while it imports Flower
            signal.signal(signal.SIGINT, _exit_now)
            _set_parent_death_signal(signal.SIGTERM)
            _set_name("medfl-forks")
            if os.getppid() != parent:   # the parent ended before the line above
                raise SystemExit(0)
            _warm_up()
            if first_pull_wait is not None:
                pace_pulls(first_pull_wait)
            ForkServer(listener, folder).serve()
        except SystemExit:
            pass
        except BaseException:   # noqa: BLE001 - said; the stubs fall back to Flower's own start
            _say("the ClientApp fork server stopped; the SuperNode's ClientApps start as Flower starts them:\n"
                 + traceback.format_exc().rstrip(), logging.ERROR)
            code = 1
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(code)
    listener.close()
    os.environ[REAL_ENV] = real
    os.environ["PATH"] = os.pathsep.join([folder, *[p for p in os.environ.get("PATH", "").split(os.pathsep) if p]])
    return folder
