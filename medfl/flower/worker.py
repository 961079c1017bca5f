"""The site worker: a long-lived process beside a site's SuperNode that handles its messages.

``medfl flower site`` runs :func:`run_site`: it opens the worker's Unix socket, starts
``flower-supernode`` as its child with the socket in the node config (``worker=...``), and
answers the messages the per-message ClientApp processes (:mod:`medfl.flower.proxy`)
forward to it, one at a time, with :func:`medfl.site_messages.handle`. The site's config,
its split of the data, torch, MONAI and the method plugins stay loaded between messages;
the persistent client state is on disk in the site's state directory either way, so a
worker that is restarted continues where it left off.

When the SuperNode exits, the worker exits too; when the worker is ended (SIGTERM,
SIGINT), it ends the SuperNode first.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from medfl.config_file import refuse_syntax
from medfl.flower.deploy import NODE_ID_LINE, terminate
from medfl.flower.proxy import recv_frame, send_frame
from medfl.site import Site, SiteSettings
from medfl.site_messages import handle

__all__ = ["SiteWorker", "run_site", "socket_for", "exit_reason"]

logger = logging.getLogger(__name__)


#: Seconds a SuperNode whose work loop ended (:func:`_loop_ended`) is given to exit before its
#: site ends it: Flower's Runtime API server thread would
#: keep its process alive after it left the federation.
LINGER = 5.0


def exit_reason(code: int | None, left: bool = False) -> str:
    """What a SuperNode's exit status tells the site's operator. Flower exits with 0 when
    the SuperLink drops the node (a SuperLink restarted without its database answers 401)
    and with 1 on any error, a refused authentication included; ``left``: its work loop had
    raised and the site ended the process that lived on (:data:`LINGER`)."""
    if left:
        return ("it stopped on an error of the SuperLink, quoted above (an HTTP 500 when the SuperLink's database "
                "is locked), and left the federation while its process lived on: medfl ended it")
    if code == 0:
        return "the SuperLink may have restarted or dropped this node"
    return ("no connection to the SuperLink, or it refused this node: its message is above; is the SuperLink "
            "up, do the TLS settings match, and where it requires authentication, is this site's public key "
            "registered there (`medfl flower register-site`) and its private key given with --auth-key?")


class SiteWorker:
    """Answer forwarded messages for one site on a Unix socket.

    Args:
        settings: the site's node config.
        socket_path: where to listen (created; removed on close).
    """

    def __init__(self, settings: SiteSettings, socket_path: str | Path) -> None:
        self.settings = settings
        self.socket_path = str(socket_path)
        self.site: Site | None = None
        Path(self.socket_path).unlink(missing_ok=True)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.socket_path)
        self.server.listen(16)
        self._stop = threading.Event()

    def _site(self) -> Site:
        if self.site is None:
            self.site = Site(self.settings)
        return self.site

    def handle_connection(self, conn: socket.socket) -> None:
        """Read one request from ``conn``, answer it (an error travels back as text)."""
        with conn:
            try:
                header = json.loads(recv_frame(conn))
                data = recv_frame(conn)
            except Exception:  # noqa: BLE001 - a broken request: drop the connection
                return
            try:
                if "run_config" in header:   # the ClientApp does not check it (it does not import medfl)
                    refuse_syntax(header["run_config"], f"medfl site {self.settings.client_id}: the Flower run config")
                age = header.get("age")
                answer = handle(self._site(), str(header.get("type", "")), data,
                                clientapp_age=float(age) if isinstance(age, (int, float)) else None)
            except Exception as exc:  # noqa: BLE001 - reported to the ClientApp, which raises it
                msg = f"{type(exc).__name__}: {exc}"
                logger.error(f"medfl site {self.settings.client_id}: {msg}\n{traceback.format_exc()}")
                send_frame(conn, json.dumps({"ok": False, "error": msg}).encode())
                return
            send_frame(conn, json.dumps({"ok": True}).encode())
            send_frame(conn, answer)

    def serve_forever(self) -> None:
        """Handle connections one after another until :meth:`stop`."""
        self.server.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            conn.settimeout(None)
            self.handle_connection(conn)

    def stop(self) -> None:
        """Stop serving and remove the socket."""
        self._stop.set()
        try:
            self.server.close()
        finally:
            Path(self.socket_path).unlink(missing_ok=True)


def _loop_ended(line: str, previous: str) -> bool:
    """Whether ``line`` of a SuperNode's stderr (after ``previous``) says that its work loop
    has ended: Flower 1.42 logs an HTTP 5xx of the SuperLink (``ERROR : Server error '500
    ...'``, which its retries do not cover) and leaves the federation; or Python's traceback
    of the main thread (not another thread's, ``Exception in thread ...``)."""
    if line.startswith("Traceback (most recent call last):"):
        return not previous.startswith("Exception in thread")
    return line.lstrip("\x1b[0123456789;m").startswith("ERROR") and "Server error '5" in line


def _start_supernode(cmd: list[str], env: dict[str, str] | None, who: str,
                     ended: set[int] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (the SuperNode), saying first that the site waits for the SuperLink its
    ``--superlink`` names; its log (stderr) is passed on line by line through this module's
    logger, with ``WHO: registered as node N at the SuperLink ADDRESS`` after Flower's line
    that gives the node id (:data:`medfl.flower.deploy.NODE_ID_LINE`; a release that words it
    otherwise gets no such line, its own lines pass unchanged).

    When a line says that Flower's work loop has ended (:func:`_loop_ended`: an HTTP 5xx of the
    SuperLink; the node has left the federation) and the process has not exited
    :data:`LINGER` seconds later, it is ended (SIGTERM, which Flower's command handles; SIGKILL if that did not end it) and its
    pid added to ``ended``."""
    superlink = cmd[cmd.index("--superlink") + 1] if "--superlink" in cmd else "it was given"
    if "--superlink" in cmd:
        logger.info(f"{who}: waiting for the SuperLink at {superlink}")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)

    def end_if_alive() -> None:
        if proc.poll() is None:
            if ended is not None:
                ended.add(proc.pid)
            terminate(proc, LINGER)

    def relay(pipe: Any) -> None:
        previous = ""
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            if _loop_ended(text, previous):
                timer = threading.Timer(LINGER, end_if_alive)
                timer.daemon = True
                timer.start()
            previous = text
            # Flower's own level, so that -q still shows its warnings and errors
            level = next((lv for name, lv in (("ERROR", logging.ERROR), ("WARNING", logging.WARNING))
                          if text.lstrip("\x1b[0123456789;m").startswith(name)), logging.INFO)
            logger.log(level, text)
            found = NODE_ID_LINE.search(text)
            if found:
                logger.info(f"{who}: registered as node {found.group(1)} at the SuperLink {superlink}")
        pipe.close()

    threading.Thread(target=relay, args=(proc.stderr,), name="medfl-supernode-log", daemon=True).start()
    return proc


def run_site(settings: SiteSettings, supernode_cmd: list[str], env: dict[str, str] | None = None, *,
             restart: bool = True, backoff: float = 1.0, max_backoff: float = 60.0) -> int:
    """Run a site: the worker in this process, ``supernode_cmd`` (whose node config must
    carry ``worker='<socket>'``, see :func:`socket_for`) as its child, until told to stop
    (SIGTERM or SIGINT). Returns the SuperNode's last exit code.

    With ``restart`` (the default), a SuperNode that exits on its own (a SuperLink that
    restarted without its database no longer knows the node and answers 401; a network
    outage longer than Flower's retries; an error of the SuperLink that ended its work loop,
    after which the site ends its process, see :func:`_start_supernode`) is started again after ``backoff`` seconds, doubling
    up to ``max_backoff`` (reset after a SuperNode that ran for ``max_backoff``), with a log
    line each time: a site keeps serving until its operator stops it.

    Args:
        settings: the site's node config.
        supernode_cmd: the ``flower-supernode`` command, built with the socket path.
        env: the SuperNode's environment.
        restart: start the SuperNode again when it exits on its own.
        backoff: the first wait before a restart, in seconds.
        max_backoff: the longest wait between restarts.
    """
    from medfl.code_identity import private_bytecode

    # bytecode of the code imported from now on is read and written only in the site's own
    # folder: a __pycache__/*.pyc planted beside a plugin's source is never run
    private_bytecode(settings.state_dir / "pycache")
    sock_path = _socket_from_command(supernode_cmd)
    worker = SiteWorker(settings, sock_path)
    who = f"medfl site {settings.client_id}"
    try:
        worker._site()  # load config and data now: errors show at start, not at the first message
        ended: set[int] = set()
        procs = [_start_supernode(supernode_cmd, env, who, ended)]
    except BaseException:
        worker.stop()
        shutil_rmtree(Path(sock_path).parent)   # the socket's folder from socket_for
        raise
    stopping = threading.Event()

    def _end(signum: int, _frame: Any) -> None:
        stopping.set()
        if procs[-1].poll() is None:
            procs[-1].send_signal(signal.SIGTERM)
        worker.stop()

    def _supervise() -> None:
        delay = backoff
        while True:
            started = time.monotonic()
            code = procs[-1].wait()
            if stopping.is_set() or not restart:
                break
            if time.monotonic() - started >= max_backoff:
                delay = backoff
            print(f"{who}: the SuperNode exited with code {code} ({exit_reason(code, procs[-1].pid in ended)}); "
                  f"starting it again in {delay:g} s (stop the site with Ctrl-C or SIGTERM)", flush=True)
            if stopping.wait(delay):
                break
            delay = min(delay * 2, max_backoff)
            procs.append(_start_supernode(supernode_cmd, env, who, ended))
            print(f"{who}: SuperNode pid {procs[-1].pid}", flush=True)
        worker.stop()

    signal.signal(signal.SIGTERM, _end)
    signal.signal(signal.SIGINT, _end)
    watcher = threading.Thread(target=_supervise, daemon=True)
    watcher.start()
    print(f"{who}: worker on {sock_path}, SuperNode pid {procs[-1].pid}", flush=True)
    try:
        worker.serve_forever()
    finally:
        stopping.set()
        worker.stop()
        terminate(procs[-1], 10.0)
        shutil_rmtree(Path(sock_path).parent)
    return int(procs[-1].returncode or 0)


def socket_for() -> str:
    """A fresh short Unix-socket path (socket paths are limited to about 100 characters)."""
    return str(Path(tempfile.mkdtemp(prefix="medfl-site-")) / "worker.sock")


def _socket_from_command(cmd: list[str]) -> str:
    i = cmd.index("--node-config")
    for item in cmd[i + 1].split(" "):
        if item.startswith("worker="):
            return item.split("=", 1)[1].strip("'\"")
    raise ValueError("the SuperNode command's --node-config has no worker='<socket>' entry")


def shutil_rmtree(path: Path) -> None:
    """Remove the worker's temporary socket directory (ignoring errors)."""
    if path.name.startswith("medfl-site-"):
        shutil.rmtree(path, ignore_errors=True)
