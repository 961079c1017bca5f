"""A whole Flower federation of medfl as separate processes on this machine, for the tests and
benchmarks that run real deployments: :class:`LocalFederation`.

It starts the same commands a hospital runs (``medfl flower superlink``, ``medfl flower site``,
``flwr run`` of medfl's app: :mod:`medfl.flower.deploy` builds them) on loopback with free ports,
and always takes every process it started down again, including the ones Flower detaches
(SuperExec, ServerApp and ClientApp processes): every process it starts carries a marker in
its environment, and :meth:`LocalFederation.close` ends each process that still has it.
``benchmarks/flower_overhead.py`` and ``benchmarks/flower_soak.py`` load it from here.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medfl.flower.deploy import (TASK_POLL_ENV, FlowerDeployError, flower_env, flwr_run, flwr_stop, free_port,
                                 make_run_config, read_json, started_run_id, superlink_command, write_app)

__all__ = ["LocalFederation", "MARKER_ENV", "read_result", "descendants", "end_group", "kill_group"]

#: Environment variable carrying a federation's marker into every process it starts.
MARKER_ENV = "MEDFL_FLOWER_MARKER"
#: Seconds the SuperLink's supervisor has to stop its ServerApps, SuperExec and SuperLink in
#: order (:func:`medfl.flower.flwr_launcher.supervise`) before it is killed.
SUPERLINK_GRACE = 45.0


def read_result(result_file: Path, log: Path, code: int | None, wait: float = 30.0) -> dict[str, Any]:
    """The JSON a ServerApp wrote to ``result_file`` once ``flwr run`` returned (waiting up to
    ``wait`` seconds: the SuperLink may still be writing it).

    Raises:
        FlowerDeployError: no result came: quotes ``flwr run``'s exit ``code`` and the end of ``log``.
    """
    deadline = time.monotonic() + wait
    result = read_json(result_file)
    while result is None and time.monotonic() < deadline:
        time.sleep(0.2)
        result = read_json(result_file)
    if result is None:
        raise FlowerDeployError(f"flwr run exited with {code} and the ServerApp wrote no result:\n"
                                f"{log.read_text(errors='replace')[-4000:]}")
    return result


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


def _marked_pids(marker: str) -> list[int]:
    """Processes of this user whose environment carries ``marker`` (Linux ``/proc``)."""
    out = []
    needle = f"{MARKER_ENV}={marker}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
        except (OSError, PermissionError):
            continue
    return out


class LocalFederation:
    """A SuperLink and sites as separate processes on this machine (loopback, free ports).

    Use as a context manager; every process started is ended on exit, even on error::

        with LocalFederation(tmp) as fed:
            fed.start_superlink()
            for cid in ("0", "1", "2"):
                fed.start_site(cid, "train.json")
            fed.wait_for_nodes(3)
            result = fed.run("train.json", {"fl#rounds": 2})

    Args:
        workdir: where logs, site state and the app go.
        host: the loopback address to bind.
        env: extra environment for every process.
        task_poll_interval: Flower SuperExec's task polling interval in seconds (default
            0.1; Flower's own default is 1.0).
        tls: encrypt every connection with a certificate authority and SuperLink
            certificate made for this federation (``certs/``; :mod:`medfl.flower.auth`).
        auth: SuperNode authentication (implies ``tls``): the SuperLink accepts only sites
            registered with :meth:`register_site`.
        sites: how many sites will run here at once (``MEDFL_LOCAL_SITES`` in every process's
            environment), so that a site's ``fl.threads`` ``"auto"`` gives it its share of
            the cores (:func:`medfl.config.local_sites`); ``None``: not set (each site takes
            every core unless ``fl.threads`` or ``--threads`` says otherwise).
    """

    def __init__(self, workdir: str | Path, host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 task_poll_interval: float = 0.1, tls: bool = False, auth: bool = False,
                 sites: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.marker = uuid.uuid4().hex
        self.env = {**flower_env(), **(env or {}), MARKER_ENV: self.marker,
                    TASK_POLL_ENV: str(task_poll_interval), "FLWR_HOME": str(self.workdir / "flwr_home"),
                    "PYTHONUNBUFFERED": "1"}
        if sites is not None:
            from medfl.config import LOCAL_SITES_ENV

            self.env[LOCAL_SITES_ENV] = str(int(sites))
        self.superlink: str | None = None
        self.procs: dict[str, _Proc] = {}
        self.app_dir = write_app(self.workdir / "app")
        self.auth = auth
        self.tls = tls or auth
        self.certs: dict[str, Path] = {}
        self.keys: dict[str, Path] = {}          # client id -> its private key (registered sites)
        if self.tls:
            from medfl.flower.auth import certificate_paths, make_certificates

            certs = self.workdir / "certs"
            self.certs = (certificate_paths(certs) if (certs / "ca.pem").is_file()
                          else make_certificates(certs, [host, "localhost"]))

    def _client_tls(self) -> list[str]:
        """A site's (or the CLI's) TLS arguments: the federation's CA, or ``--insecure``."""
        return ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]

    # ------------------------------------------------------------------ processes
    def _start(self, name: str, cmd: list[str]) -> _Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        fh = open(log, "ab")  # noqa: SIM115 - the child owns it
        popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                 start_new_session=True)
        fh.close()
        proc = _Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def _wait_port(self, port: int, proc: _Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise FlowerDeployError(f"{proc.name} exited with {proc.popen.returncode}:\n{self.tail(proc.name)}")
            with socket.socket() as s:
                if s.connect_ex((self.host, port)) == 0:
                    return
            time.sleep(0.1)
        raise FlowerDeployError(f"{proc.name} did not open port {port} within {timeout} s:\n{self.tail(proc.name)}")

    def tail(self, name: str, chars: int = 3000) -> str:
        """The end of a process's log."""
        p = self.procs.get(name)
        return p.log.read_text(errors="replace")[-chars:] if p and p.log.is_file() else ""

    def last_lines(self, name: str, lines: int = 12) -> str:
        """The last ``lines`` non-empty lines of a process's log."""
        return "\n".join([ln for ln in self.tail(name, 20000).splitlines() if ln.strip()][-lines:])

    def sites_gone(self) -> str | None:
        """Why no site of this federation can join a run, or ``None``: every site process
        started here (and not ended by :meth:`kill_site`) has exited, or the SuperLink has.
        The message names each such process, its exit code and the end of its log."""
        sites = {n: p for n, p in self.procs.items() if n.startswith("site")}
        link = self.procs.get("superlink")
        if link is not None and link.popen.poll() is not None:
            return (f"the SuperLink exited with code {link.popen.returncode}:\n"
                    + _indent(self.last_lines("superlink")))
        if not sites or any(p.popen.poll() is None for p in sites.values()):
            return None
        parts = [f"site {n[len('site'):]} exited with code {p.popen.returncode} ({p.log}):\n"
                 + _indent(self.last_lines(n)) for n, p in sites.items()]
        return "every site of this federation has exited, so none can join the run:\n" + "\n".join(parts)

    def start_superlink(self, port: int | None = None, timeout: float = 60.0, database: str | Path | None = None
                        ) -> str:
        """Start the SuperLink; return its address ``host:port`` once it listens. With
        ``database`` (an SQLite file) its state survives a restart (:meth:`stop_superlink`
        and start it again on the same port)."""
        port = port or free_port(self.host)
        extra: list[str] = []
        if self.tls:
            extra = ["--ssl-certfile", str(self.certs["server"]), "--ssl-keyfile", str(self.certs["server_key"]),
                     "--ssl-ca-certfile", str(self.certs["ca"])] + (["--enable-supernode-auth"] if self.auth else [])
        proc = self._start("superlink", superlink_command(self.host, port, insecure=not self.tls,
                                                          database=database, extra=extra,
                                                          root_certificates=self.certs.get("ca")))
        self._wait_port(port, proc, timeout)
        self.superlink = f"{self.host}:{port}"
        return self.superlink

    def stop_superlink(self) -> None:
        """End the SuperLink (SIGTERM to its supervisor, which stops the runs' ServerApps, its
        SuperExec and the SuperLink in order; SIGKILL after :data:`SUPERLINK_GRACE` s), as an
        outage or an upgrade would; the sites stay up and keep trying to reach it."""
        proc = self.procs.pop("superlink", None)
        if proc is None:
            return
        end_group(proc.popen, SUPERLINK_GRACE)
        proc.log.rename(proc.log.with_name(f"superlink-{uuid.uuid4().hex[:6]}.log"))

    def register_site(self, client_id: str) -> int:
        """Make site ``client_id`` a key pair (``keys/site<id>.key``) and register its public
        key at the SuperLink (``auth`` federations); return the node id bound to it. The
        site started next with :meth:`start_site` uses the key."""
        from medfl.flower.auth import make_site_key, register_site

        if self.superlink is None:
            raise FlowerDeployError("start the SuperLink first")
        private, public = make_site_key(self.workdir / "keys", f"site{client_id}")
        node = register_site(public, self.superlink, root_certificates=self.certs.get("ca"), insecure=not self.tls,
                             env=self.env)
        self.keys[str(client_id)] = private
        return node

    def start_site(self, client_id: str, config: str | Path, *, state_dir: str | Path | None = None,
                   overrides: dict[str, Any] | None = None, timeout: float = 120.0, wait: bool = True,
                   auth_key: str | Path | None = None, restart: bool = True, name: str | None = None) -> Path:
        """Start site ``client_id`` (``medfl flower site``: its worker and SuperNode); return
        its state directory. With ``wait``, return once its SuperNode listens (sites started
        with ``wait=False`` start in parallel: see :meth:`wait_for_nodes`). ``auth_key``: the
        private key to sign with (default: the one :meth:`register_site` made, if any);
        ``restart=False`` passes ``--no-restart``; ``name``: the process's name here (default
        ``site<id>``; another name is not counted as a site of the federation)."""
        if self.superlink is None:
            raise FlowerDeployError("start the SuperLink first")
        state = Path(state_dir) if state_dir else self.workdir / "sites" / f"site{client_id}"
        port = free_port(self.host)
        cmd = [sys.executable, "-m", "medfl.cli", "flower", "site", "--client-id", str(client_id),
               "--config", str(Path(config).resolve()), "--state-dir", str(state), "--superlink", self.superlink,
               "--host", self.host, "--port", str(port), *self._client_tls()]
        key = auth_key or self.keys.get(str(client_id))
        if key:
            cmd += ["--auth-key", str(key)]
        if not restart:
            cmd.append("--no-restart")
        if overrides:
            cmd += [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        proc = self._start(name or f"site{client_id}", cmd)
        if wait:
            self._wait_port(port, proc, timeout)
        return state

    def kill_site(self, client_id: str) -> None:
        """End site ``client_id`` at once (SIGKILL to its process group and to everything
        it started), as a site that crashes or loses its network."""
        if f"site{client_id}" not in self.procs:
            return
        self._signal_site(client_id, signal.SIGKILL)
        self.procs.pop(f"site{client_id}").popen.wait(timeout=10)

    def pause_site(self, client_id: str) -> None:
        """Stop site ``client_id`` where it stands (SIGSTOP to its process group and to
        everything it started), as a site whose machine hangs or is starved of CPU: it
        neither answers nor exits until :meth:`resume_site`."""
        self._signal_site(client_id, signal.SIGSTOP)

    def resume_site(self, client_id: str) -> None:
        """Let a site :meth:`pause_site` stopped go on (SIGCONT)."""
        self._signal_site(client_id, signal.SIGCONT)

    def _signal_site(self, client_id: str, sig: int) -> None:
        proc = self.procs.get(f"site{client_id}")
        if proc is None:
            raise FlowerDeployError(f"no site {client_id} was started here")
        children = descendants(proc.popen.pid)
        kill_group(proc.popen, sig)
        for pid in children:
            _kill_pid(pid, sig)

    def wait_for_nodes(self, count: int, timeout: float = 180.0) -> None:
        """Wait until ``count`` SuperNodes have registered with the SuperLink (counted in its
        log; a restarted site registers again and counts again).

        Raises:
            FlowerDeployError: a process exited, or too few registered in time.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.tail("superlink", 10**7).count("Activated node_id=") >= count:
                return
            for name, proc in self.procs.items():
                if proc.popen.poll() is not None:
                    raise FlowerDeployError(f"{name} exited with {proc.popen.returncode}:\n{self.tail(name)}")
            time.sleep(0.2)
        raise FlowerDeployError(f"fewer than {count} SuperNodes registered within {timeout} s")

    # ------------------------------------------------------------------ runs
    def run(self, config: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
            resume: str | Path | None = None, rounds: int = 0, round_timeout: float = 120.0,
            connect_timeout: float = 120.0, hello_timeout: float = 30.0, timeout: float = 600.0,
            name: str = "run", progress_interval: float | None = None,
            site_nodes: dict[str, int] | None = None) -> dict[str, Any]:
        """Launch a run with ``flwr run`` and wait for its end.

        While it waits, it watches the processes it started (:meth:`sites_gone`): once every
        site has exited (a site whose config fails exits at once) no site can ever join, so
        the run is stopped at once instead of waiting out ``connect_timeout``.

        Returns:
            The ServerApp's result: ``{"ok": True, "dir": experiment directory}`` or
            ``{"ok": False, "error": ..., "traceback": ...}``; ``log`` is the ``flwr run``
            output file.

        Raises:
            FlowerDeployError: no result came back (the ServerApp did not start), the run
                did not end within ``timeout`` seconds, or every site (or the SuperLink)
                exited: the message gives their exit codes and the ends of their logs.
        """
        if self.superlink is None:
            raise FlowerDeployError("start the SuperLink first")
        result_file = self.workdir / f"{name}-{uuid.uuid4().hex[:8]}.json"
        rc = make_run_config(workdir=self.workdir, result_file=result_file, round_timeout=round_timeout,
                             connect_timeout=connect_timeout, hello_timeout=hello_timeout, config=config,
                             overrides=overrides, resume=resume, rounds=rounds, progress_interval=progress_interval,
                             site_nodes=site_nodes, launch=shlex.join(["--superlink", self.superlink,
                                                                        *self._client_tls()]))
        gone = self.sites_gone()
        if gone:
            raise FlowerDeployError(f"run {name!r} not started: {gone}")
        log = self.workdir / "logs" / f"{result_file.stem}.log"
        log.parent.mkdir(exist_ok=True)
        with open(log, "wb") as fh:
            try:
                code = flwr_run(self.app_dir, self.superlink, rc, flwr_home=self.workdir / "flwr_home",
                                env=self.env, timeout=timeout, stream_to=fh, watch=self.sites_gone,
                                done=lambda: read_json(result_file) is not None,
                                insecure=not self.tls, root_certificates=str(self.certs["ca"]) if self.tls else None)
            except FlowerDeployError as exc:
                # stop the run at the SuperLink too: its ServerApp would wait out connect_timeout
                run_id = started_run_id(log.read_text(errors="replace"))
                stopped = run_id is not None and flwr_stop(run_id, self.workdir / "flwr_home", env=self.env)
                how = "stopped" if stopped else "given up (flwr stop failed; close() ends its processes)"
                raise FlowerDeployError(f"run {name!r} {how}: {exc}") from None
        result = read_result(result_file, log, code)
        result["log"] = str(log)
        return result

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """End every process this federation started: sites, then the SuperLink (SIGTERM,
        SIGKILL after 5 s), then any process still carrying the marker."""
        for name in [n for n in self.procs if n != "superlink"] + (["superlink"] if "superlink" in self.procs else []):
            end_group(self.procs.pop(name).popen, SUPERLINK_GRACE if name == "superlink" else 5.0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = _marked_pids(self.marker)
            if not left:
                return
            for pid in left:
                _kill_pid(pid, signal.SIGKILL)
            time.sleep(0.2)
        left = _marked_pids(self.marker)
        if left:
            raise FlowerDeployError(f"processes {left} of this federation would not end")

    def stray_processes(self) -> list[int]:
        """Processes started by this federation that are still alive."""
        return _marked_pids(self.marker)

    def __enter__(self) -> "LocalFederation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(popen: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """End a process group: SIGTERM (and SIGCONT, for a paused one), then SIGKILL after
    ``grace`` seconds."""
    kill_group(popen, signal.SIGTERM)
    kill_group(popen, signal.SIGCONT)
    try:
        popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        kill_group(popen, signal.SIGKILL)
        popen.wait(timeout=grace)


def kill_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        _kill_pid(popen.pid, sig)
