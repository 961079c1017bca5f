"""Start and stop the processes of a Flower deployment of medfl, and launch runs on it.

The three steps (``docs/flower.md``), each a command of its own::

    medfl flower superlink --port 9092                      # 1. the SuperLink (coordinator host)
    medfl flower site --client-id 0 --config train.json \\
        --state-dir state/site0 --superlink HOST:9092       # 2. one SuperNode per site
    medfl flower run train.json --superlink HOST:9092       # 3. launch a run (flwr run)

:func:`superlink_command`, :func:`site_command` and :func:`write_app` build what those
commands execute; :class:`LocalFederation` runs a whole federation of separate processes
on one machine (tests, benchmarks, trying it out) and always takes every process it
started down again, including the ones Flower detaches (SuperExec, ServerApp and
ClientApp processes): every process it starts carries a marker in its environment, and
:meth:`LocalFederation.close` ends each process that still has it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from medfl.flower.transport import RUN_CONFIG

__all__ = ["FlowerDeployError", "flower_env", "free_port", "flower_command", "superlink_command",
           "superexec_command", "site_command",
           "node_config", "write_app", "write_connection", "make_run_config", "run_config_toml", "flwr_run", "flwr_stop",
           "read_json", "read_result", "started_run_id", "run_status", "HeldTraceback",
           "LocalFederation", "MARKER_ENV", "TASK_POLL_ENV", "TELEMETRY_ENV", "SERVERAPP_RAISED", "NODE_ID_LINE"]

#: Environment variable carrying a federation's marker into every process it starts.
MARKER_ENV = "MEDFL_FLOWER_MARKER"
#: How often Flower's SuperExec looks for new tasks (Flower's default is 1 s).
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
#: Flower's telemetry switch (on unless ``"0"``). Off by default in the processes medfl starts:
#: every ClientApp would send two events to Flower's server (HTTPS; about 0.1 s of CPU a
#: message, refused where the site has no internet), and a site sends nothing unasked.
TELEMETRY_ENV = "FLWR_TELEMETRY_ENABLED"
#: Seconds the SuperLink's supervisor has to stop its ServerApps, SuperExec and SuperLink in
#: order (:func:`medfl.flower.flwr_launcher.supervise`) before it is killed.
SUPERLINK_GRACE = 45.0
#: What Flower (1.42) logs, in a run's log stream, when the ServerApp raised; its traceback and
#: exit code follow (:class:`HeldTraceback`).
SERVERAPP_RAISED = "ServerApp raised an exception"
#: What Flower's SuperNode (1.42) logs once the SuperLink registered it: ``SuperNode ID: <node
#: id>`` (:func:`medfl.flower.worker.run_site` says "registered as node N" then).
NODE_ID_LINE = re.compile(r"SuperNode ID: (\d+)")


class FlowerDeployError(RuntimeError):
    """A Flower process could not start, or a run did not finish."""


def _bin(name: str) -> str:
    """The path of a console script installed beside this Python (the venv's ``bin``)."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise FlowerDeployError(f"{name} not found beside {sys.executable} nor on PATH; "
                                "install Flower with `pip install -e '.[flower]'`")
    return found


def flower_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with this Python's script directory first on
    ``PATH``: Flower starts its helpers (``flower-superexec``, ``flwr-serverapp``,
    ``flwr-clientapp``) by name, so they must be found from the same installation. Unless
    ``env`` sets them: a SuperExec looks for tasks every 0.1 s (:data:`TASK_POLL_ENV`, Flower's
    documented setting; its default is 1 s) and Flower's telemetry is off (:data:`TELEMETRY_ENV`; ``FLWR_TELEMETRY_ENABLED=1`` turns it on)."""
    out = dict(os.environ if env is None else env)
    bindir = str(Path(sys.executable).parent)
    parts = out.get("PATH", "").split(os.pathsep) if out.get("PATH") else []
    if bindir not in parts:
        out["PATH"] = os.pathsep.join([bindir, *parts])
    out.setdefault(TASK_POLL_ENV, "0.1")
    out.setdefault(TELEMETRY_ENV, "0")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def flower_command(name: str) -> list[str]:
    """Flower's own command ``name`` (``flower-superlink``, ``flower-supernode``), as installed
    beside this Python: medfl runs Flower's commands unchanged.

    Raises:
        FlowerDeployError: Flower is not installed.
    """
    return [_bin(name)]


def superlink_command(host: str = "127.0.0.1", port: int = 9092, insecure: bool = True,
                      database: str | None = None, extra: list[str] | None = None,
                      root_certificates: str | Path | None = None) -> list[str]:
    """The command of a medfl federation's SuperLink: Flower's ``flower-superlink``
    (:func:`flower_command`; Fleet, Control and Runtime APIs on ``host:port``, no runtime
    installation of app dependencies: medfl is installed on every machine, Flower would
    otherwise try ``uv sync`` for each run) with ``--isolation process``, and beside it the
    SuperExec that starts each run's ServerApp (:func:`superexec_command`), both under the
    launcher's supervisor (:func:`medfl.flower.flwr_launcher.supervise`), which starts the
    SuperExec again whenever it exits. ``root_certificates``: the CA that signed the
    SuperLink's certificate (its ``--ssl-ca-certfile``), for the SuperExec to check it."""
    from medfl.flower import flwr_launcher

    link = [*flower_command("flower-superlink"), "--host", host, "--port", str(port),
            "--disable-runtime-dependency-installation", "--isolation", "process"]
    if insecure:
        link.append("--insecure")
    if database:
        link += ["--database", database]
    link += list(extra or [])
    return [sys.executable, str(Path(flwr_launcher.__file__).resolve()), "supervise", "--superexec",
            json.dumps(superexec_command(host, port, insecure=insecure, root_certificates=root_certificates)),
            "--", *link]


def superexec_command(host: str, port: int, *, insecure: bool = True,
                      root_certificates: str | Path | None = None) -> list[str]:
    """Flower's ``flower-superexec`` for the SuperLink on ``host:port`` (its Runtime API; a
    bind-all ``host`` is reached on the loop-back address, as Flower's own SuperLink does).

    Raises:
        FlowerDeployError: TLS without ``root_certificates``, or Flower is not installed.
    """
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    address = f"[{reach}]:{port}" if ":" in reach else f"{reach}:{port}"
    cmd = [_bin("flower-superexec"), "--runtime-api-address", address]
    if insecure:
        return cmd + ["--insecure"]
    if not root_certificates:
        raise FlowerDeployError("the SuperLink's SuperExec needs the CA of the SuperLink's certificate "
                                "(--ssl-ca-certfile) to reach it over TLS")
    return cmd + ["--root-certificates", str(Path(root_certificates).resolve())]


def node_config(client_id: str, config: str | Path, state_dir: str | Path, *, overrides: dict[str, Any] | None = None,
                workdir: str | Path | None = None, device: str | None = None, worker: str | None = None,
                superlink: str | None = None) -> str:
    """The ``--node-config`` string of a medfl site (paths made absolute; ``worker``: the
    site worker's socket, see :mod:`medfl.flower.worker`; ``superlink``: the Fleet API
    address the site connects to, which a method may measure its latency against)."""
    def q(v: Any) -> str:
        s = str(v)
        if "'" in s:
            raise FlowerDeployError(f"node config value {s!r} contains a single quote")
        return f"'{s}'"

    items = {"client-id": client_id, "config": Path(config).resolve(), "state-dir": Path(state_dir).resolve()}
    if overrides:
        items["overrides"] = json.dumps(overrides)
    items["workdir"] = Path(workdir).resolve() if workdir else Path.cwd()
    if device:
        items["device"] = device
    if worker:
        items["worker"] = worker
    if superlink:
        items["superlink"] = superlink
    return " ".join(f"{k}={q(v)}" for k, v in items.items())


def site_command(client_id: str, config: str | Path, state_dir: str | Path, superlink: str, *,
                 port: int = 9094, host: str = "127.0.0.1", insecure: bool = True,
                 overrides: dict[str, Any] | None = None, workdir: str | Path | None = None,
                 device: str | None = None, worker: str | None = None, extra: list[str] | None = None) -> list[str]:
    """The ``flower-supernode`` command of one medfl site (:func:`flower_command`; its
    ClientApp runtime API on ``host:port``: give every site on one machine its own port)."""
    cmd = [*flower_command("flower-supernode"), "--superlink", superlink, "--host", host, "--port", str(port),
           "--node-config", node_config(client_id, config, state_dir, overrides=overrides, workdir=workdir,
                                        device=device, worker=worker, superlink=superlink)]
    if insecure:
        cmd.append("--insecure")
    return cmd + list(extra or [])


def write_app(directory: str | Path, **defaults: Any) -> Path:
    """Write medfl's Flower app (a ``pyproject.toml`` naming medfl's ServerApp and
    ClientApp and the run-config keys) to ``directory``, for ``flwr run DIRECTORY``.

    medfl is installed on the SuperLink's and every site's machine and the ServerApp is
    imported from there; the ClientApp is the light :mod:`medfl.flower.proxy`, shipped in
    the app as ``medfl_flower_proxy.py`` so that Flower's per-message ClientApp process
    does not import torch (see that module).
    """
    from medfl.flower import proxy
    from medfl import __version__ as version

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        "[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", 'name = "medfl-flower"', f'version = "{version}"',
        'description = "medfl methods across sites: medfl coordinator as ServerApp, medfl site as ClientApp"',
        'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "medfl"', "",
        "[tool.flwr.app.components]", 'serverapp = "medfl.flower.server:app"',
        'clientapp = "medfl_flower_proxy:app"', "",
        "[tool.flwr.app.config]", run_config_toml({**RUN_CONFIG, **defaults}),
    ]
    (directory / "pyproject.toml").write_text("\n".join(lines))
    (directory / "medfl_flower_proxy.py").write_text(Path(proxy.__file__).read_text())
    return directory


def write_connection(flwr_home: str | Path, superlink: str, name: str = "medfl", insecure: bool = True,
                     root_certificates: str | None = None) -> Path:
    """Write a Flower CLI configuration (``$FLWR_HOME/config.toml``) whose default
    connection ``name`` points at ``superlink``."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{superlink}"',
             f"insecure = {'true' if insecure else 'false'}"]
    if root_certificates:
        lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_run_config(*, workdir: str | Path, result_file: str | Path, round_timeout: float, connect_timeout: float,
                    hello_timeout: float, config: str | Path | None = None, overrides: dict[str, Any] | None = None,
                    resume: str | Path | None = None, rounds: int | None = None,
                    progress_interval: float | None = None, site_nodes: dict[str, int] | None = None,
                    max_reply_mb: float | None = None, launch: str = "", threads: int | str | None = None
                    ) -> dict[str, Any]:
    """The run config (keys of :data:`~medfl.flower.transport.RUN_CONFIG`) of one ``flwr run``
    of medfl's app: a bundle ``config`` with its ``#``-path ``overrides``, or a stopped run
    directory to ``resume`` (optionally to a new total of ``rounds``); paths made absolute.
    ``progress_interval``: seconds between the coordinator's "waiting for sites" lines
    (``None``: the app's default); ``site_nodes``: ``{client id: node id}``, the only node
    that may serve each client (:func:`medfl.flower.auth.pin_site`); ``max_reply_mb``: the
    largest answer taken from a site (``None``: bounded by what the method sends); ``launch``:
    the options of ``medfl flower run`` that reach this SuperLink, which the resume hints name
    (:attr:`~medfl.engine.remote_sites.RemoteSettings.launch`); ``threads``: with ``resume``,
    the coordinator's torch threads (as ``medfl resume --threads``; a new run gets them as
    ``fl#threads``)."""
    rc: dict[str, Any] = {"workdir": str(Path(workdir).resolve()), "result-file": str(result_file),
                          "round-timeout": float(round_timeout), "connect-timeout": float(connect_timeout),
                          "hello-timeout": float(hello_timeout)}
    if progress_interval is not None:
        rc["progress-interval"] = float(progress_interval)
    if max_reply_mb is not None:
        rc["max-reply-mb"] = float(max_reply_mb)
    if site_nodes:
        rc["site-nodes"] = json.dumps({str(k): int(v) for k, v in site_nodes.items()})
    if launch:
        rc["launch"] = str(launch)
    if resume:
        rc.update(resume=str(Path(resume).resolve()), rounds=int(rounds or 0))
        if threads is not None:
            rc["threads"] = str(threads)
    else:
        rc.update(config=str(Path(str(config)).resolve()), overrides=json.dumps(overrides or {}))
    return rc


def run_config_toml(run_config: dict[str, Any]) -> str:
    """A Flower run config (flat ``{key: str | int | float | bool}``) as TOML text.

    Raises:
        FlowerDeployError: a value of another type.
    """
    lines = []
    for k, v in run_config.items():
        if isinstance(v, bool):
            val = "true" if v else "false"
        elif isinstance(v, (int, float)):
            val = repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
        elif isinstance(v, str):
            val = json.dumps(v)   # a JSON string is a valid TOML basic string
        else:
            raise FlowerDeployError(f"run config {k!r}: expected a string, number or bool, got {type(v).__name__}")
        lines.append(f"{json.dumps(str(k))} = {val}")
    return "\n".join(lines) + "\n"


def flwr_run(app_dir: str | Path, superlink: str, run_config: dict[str, Any], *, insecure: bool = True,
             flwr_home: str | Path | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None, stream_to: Any = None, root_certificates: str | None = None,
             watch: Callable[[], str | None] | None = None, watch_interval: float = 0.5,
             on_output: Callable[[str], None] | None = None, done: Callable[[], bool] | None = None) -> int:
    """``flwr run APP_DIR --stream`` against ``superlink`` with ``run_config`` overrides;
    returns the CLI's exit code once the run has ended. ``flwr run`` also ends, without a
    word, when its log stream fails (an HTTP 500 of a SuperLink whose database is locked,
    while the run goes on): then, with one line saying so, the run's status is asked
    (:func:`run_status`) every :data:`FOLLOW_INTERVAL` seconds until it has finished,
    ``done`` says so, or the SuperLink has not answered for :data:`FOLLOW_SILENCE` seconds.
    A stream that ended because the SuperLink went away ("Connection to the SuperLink is
    unavailable") is not followed: the run's ServerApp went down with it.

    Args:
        stream_to: a binary file for ``flwr run``'s output (default: this process's stdout).
        watch: called every ``watch_interval`` seconds while the run goes on; a string it
            returns (why the run cannot succeed) ends the ``flwr run`` process and is raised.
        on_output: called with each line of ``flwr run``'s output as it comes (the output
            still goes to ``stream_to``), e.g. to learn the run id (:func:`started_run_id`).
        done: says whether the run is known to have ended (its ServerApp wrote its result
            file): then the SuperLink is not asked (again).

    Raises:
        FlowerDeployError: the run did not end within ``timeout`` seconds, or ``watch``
            gave a reason to stop waiting. The run itself goes on at the SuperLink
            (:func:`flwr_stop` stops it).
    """
    home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="medfl-flwr-home-"))
    write_connection(home, superlink, insecure=insecure, root_certificates=root_certificates)
    cmd = [_bin("flwr"), "run", str(Path(app_dir).resolve()), "medfl", "--stream"]
    if run_config:
        # as a TOML file: Flower's inline `key=value` form cannot carry a value holding both
        # quote characters (the JSON of config overrides)
        rc_file = home / f"run-config-{uuid.uuid4().hex[:8]}.toml"
        rc_file.write_text(run_config_toml(run_config))
        cmd += ["--run-config", str(rc_file)]
    full_env = {**flower_env(), **(env or {}), "FLWR_HOME": str(home)}
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: dict[str, int] = {}

    def note(line: str) -> None:
        run_id = started_run_id(line)
        if run_id is not None:
            seen["run"] = run_id
        if "SuperLink is unavailable" in line:
            seen["gone"] = 1
        if on_output is not None:
            on_output(line)

    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pump = threading.Thread(target=_pump, args=(proc.stdout, stream_to, note), daemon=True)
    pump.start()

    def pause(step: float) -> None:
        """Wait up to ``step`` seconds; raise at the deadline or on ``watch``'s reason."""
        if deadline is not None:
            if time.monotonic() >= deadline:
                raise FlowerDeployError(f"flwr run did not end within {timeout} s")
            step = min(step, max(0.0, deadline - time.monotonic()))
        time.sleep(step)
        reason = watch() if watch else None
        if reason:
            raise FlowerDeployError(reason)

    try:
        while True:
            wait = watch_interval if watch else None
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            try:
                code = int(proc.wait(timeout=wait))
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise FlowerDeployError(f"flwr run did not end within {timeout} s")
            reason = watch() if watch else None
            if reason:
                raise FlowerDeployError(reason)
        pump.join(5.0)
        run_id = seen.get("run")
        if run_id is None or seen.get("gone"):
            # no run, or the SuperLink went away (its ServerApp goes down with it): nothing to follow
            return code
        # `flwr run --stream` also ends without a word when its log stream fails (an HTTP 500
        # of a SuperLink whose database is locked): follow the run at the SuperLink until it
        # has ended, or its ServerApp has written its result
        said, silent_since = False, None
        while True:
            if done is not None and done():
                return code
            status = run_status(run_id, home, env=env)
            if status is not None and status.startswith("finished"):
                return code
            now = time.monotonic()
            silent_since = (silent_since or now) if status is None else None
            if silent_since is not None and now - silent_since > FOLLOW_SILENCE:
                _say_to(stream_to, f"medfl: the SuperLink has not answered about run {run_id} for "
                                   f"{FOLLOW_SILENCE:g} s; no longer waiting for it\n")
                return code
            if not said:
                _say_to(stream_to, f"medfl: the log stream of run {run_id} ended before the run "
                                   f"({status or 'no answer from the SuperLink'}); waiting for the run to end at the "
                                   f"SuperLink (its whole log: `flwr log {run_id}`)\n")
                said = True
            pause(FOLLOW_INTERVAL)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


#: How often :func:`flwr_run` asks the SuperLink whether a run whose log stream ended has ended.
FOLLOW_INTERVAL = 2.0
#: How long :func:`flwr_run` keeps asking a SuperLink that does not answer.
FOLLOW_SILENCE = 60.0


def _say_to(sink: Any, text: str) -> None:
    """Write one line of medfl's to ``sink`` (a binary file; default: stdout)."""
    try:
        out = sink if sink is not None else sys.stdout.buffer
        out.write(text.encode())
        out.flush()
    except (OSError, ValueError):
        pass


def run_status(run_id: int, flwr_home: str | Path, env: dict[str, str] | None = None,
               timeout: float = 30.0) -> str | None:
    """Run ``run_id``'s status at the SuperLink of ``flwr_home``'s default connection (``flwr
    ls --run-id``: ``"running"``, ``"finished:completed"``, ...); ``None`` when it did not
    answer (unreachable, an HTTP error, no such run)."""
    full_env = {**flower_env(), **(env or {}), "FLWR_HOME": str(flwr_home)}
    try:
        proc = subprocess.run([_bin("flwr"), "ls", "--run-id", str(run_id), "--format", "json"], env=full_env,
                              capture_output=True, timeout=timeout, check=False)
        answer = json.loads(proc.stdout.decode(errors="replace") or "{}")
    except (subprocess.TimeoutExpired, ValueError):
        return None
    runs = answer.get("runs") if isinstance(answer, dict) and answer.get("success") else None
    for row in runs or []:
        if isinstance(row, dict) and str(row.get("run-id")) == str(run_id):
            return str(row.get("status", "")) or None
    return None


def _pump(pipe: Any, sink: Any, on_output: Callable[[str], None]) -> None:
    """Copy ``flwr run``'s output from ``pipe`` to ``sink`` (default: stdout) line by line,
    handing each line to ``on_output``."""
    out = sink if sink is not None else sys.stdout.buffer
    for raw in iter(pipe.readline, b""):
        try:
            out.write(raw)
            out.flush()
        except (OSError, ValueError):   # stdout closed: keep reading, so flwr run is never blocked
            pass
        on_output(raw.decode(errors="replace"))
    pipe.close()


class HeldTraceback:
    """``flwr run``'s output (:func:`flwr_run`'s ``stream_to``), passed on to ``sink`` (a binary
    file; default: stdout) line by line, except Flower's report of a ServerApp that raised: from
    its first line (:data:`SERVERAPP_RAISED`) on, when ``hold()`` says that medfl will say why
    in a line of its own (the ServerApp wrote its failed result), the lines are kept in
    :attr:`held` instead (the traceback, Flower's exit code and its link), for
    :meth:`release` to write after all where medfl has nothing to say
    (``medfl flower run --debug`` shows them as they come)."""

    def __init__(self, hold: Callable[[], bool], sink: Any = None) -> None:
        self.hold = hold
        self.sink = sink
        self.held: list[bytes] = []
        self.holding = False

    def _out(self) -> Any:
        return self.sink if self.sink is not None else sys.stdout.buffer

    def write(self, data: bytes) -> int:
        if not self.holding and SERVERAPP_RAISED.encode() in data and self.hold():
            self.holding = True
        if self.holding:
            self.held.append(bytes(data))
        else:
            self._out().write(data)
        return len(data)

    def flush(self) -> None:
        if not self.holding:
            self._out().flush()

    def release(self) -> None:
        """Write what was held (and stop holding)."""
        held, self.held, self.holding = self.held, [], False
        for data in held:
            self.write(data)
        self.flush()


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or ``None`` while it is absent or not complete yet (a
    ServerApp may be writing it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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


def started_run_id(output: str) -> int | None:
    """The run id in ``flwr run``'s output ("Successfully started run 123..."), if any."""
    found = re.findall(r"started run (\d+)", output)
    return int(found[-1]) if found else None


def flwr_stop(run_id: int, flwr_home: str | Path, env: dict[str, str] | None = None, timeout: float = 30.0) -> bool:
    """``flwr stop RUN_ID`` on the default connection of ``flwr_home`` (see
    :func:`write_connection`); ``True`` if the SuperLink accepted it."""
    full_env = {**flower_env(), **(env or {}), "FLWR_HOME": str(flwr_home)}
    try:
        proc = subprocess.run([_bin("flwr"), "stop", str(run_id)], env=full_env, capture_output=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


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
        _end(proc.popen, SUPERLINK_GRACE)
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
        children = _descendants(proc.popen.pid)
        _kill_group(proc.popen, sig)
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
            _end(self.procs.pop(name).popen, SUPERLINK_GRACE if name == "superlink" else 5.0)
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


def _descendants(pid: int) -> list[int]:
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


def _end(popen: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """End a process group: SIGTERM (and SIGCONT, for a paused one), then SIGKILL after
    ``grace`` seconds."""
    _kill_group(popen, signal.SIGTERM)
    _kill_group(popen, signal.SIGCONT)
    try:
        popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _kill_group(popen, signal.SIGKILL)
        popen.wait(timeout=grace)


def _kill_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        _kill_pid(popen.pid, sig)
