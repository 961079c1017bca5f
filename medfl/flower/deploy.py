"""Start and stop the processes of a Flower deployment of medfl, and launch runs on it.

The three steps (``docs/flower.md``), each a command of its own::

    medfl flower superlink --port 9092                      # 1. the SuperLink (coordinator host)
    medfl flower site --client-id 0 --config train.json \\
        --state-dir state/site0 --superlink HOST:9092       # 2. one SuperNode per site
    medfl flower run train.json --superlink HOST:9092       # 3. launch a run (flwr run)

:func:`superlink_command`, :func:`site_command` and :func:`write_app` build what those
commands execute, :func:`flwr_run` launches a run and follows it to its end.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from medfl.flower.transport import RUN_CONFIG

__all__ = ["FlowerDeployError", "flower_env", "free_port", "flower_command", "superlink_command", "superexec_command",
           "site_command", "node_config", "write_app", "write_connection", "make_run_config", "run_config_toml",
           "flwr_run", "flwr_stop", "read_json", "started_run_id", "run_status", "terminate", "HeldTraceback",
           "TASK_POLL_ENV", "TELEMETRY_ENV", "SERVERAPP_RAISED", "NODE_ID_LINE"]

#: How often Flower's SuperExec looks for new tasks (Flower's default is 1 s).
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
#: Flower's telemetry switch (on unless ``"0"``). Off by default in the processes medfl starts:
#: every ClientApp would send two events to Flower's server (HTTPS; about 0.1 s of CPU a
#: message, refused where the site has no internet), and a site sends nothing unasked.
TELEMETRY_ENV = "FLWR_TELEMETRY_ENABLED"
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

    items = {"client-id": client_id, "config": Path(config).resolve(), "state-dir": Path(state_dir).resolve(),
             "overrides": json.dumps(overrides) if overrides else "",
             "workdir": Path(workdir).resolve() if workdir else Path.cwd(), "device": device, "worker": worker,
             "superlink": superlink}
    return " ".join(f"{k}={q(v)}" for k, v in items.items() if v or k == "client-id")


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
    the app as ``medfl_flower_proxy.py`` with medfl's codec beside it (:mod:`medfl.wire_format`
    as ``medfl_wire_format.py``) so that Flower's per-message ClientApp process does not
    import torch (see that module).
    """
    from medfl import wire_format
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
    (directory / "medfl_wire_format.py").write_text(Path(wire_format.__file__).read_text())
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
    returns the CLI's exit code once the run has ended, also when its log stream ended first
    (:func:`_follow`).

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
    limits = _Limits(timeout, watch)
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
    try:
        while True:
            try:
                code = int(proc.wait(timeout=limits.capped(watch_interval if watch else None)))
                break
            except subprocess.TimeoutExpired:
                limits.check()
        pump.join(5.0)
        # a stream that ended because the SuperLink went away ("Connection to the SuperLink is
        # unavailable") is not followed: the run's ServerApp went down with it
        if seen.get("run") is not None and not seen.get("gone"):
            _follow(seen["run"], home, env, stream_to, done, limits)
        return code
    finally:
        terminate(proc, 10.0)


def terminate(proc: subprocess.Popen[bytes], wait: float) -> None:
    """End ``proc`` if it still runs: SIGTERM, then SIGKILL when it has not exited ``wait``
    seconds later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Limits:
    """How long :func:`flwr_run` waits: ``timeout`` seconds (``None``: no end), and while
    ``watch`` (asked at each :meth:`check`) gives no reason to stop."""

    def __init__(self, timeout: float | None, watch: Callable[[], str | None] | None) -> None:
        self.timeout, self.watch = timeout, watch
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def capped(self, step: float | None) -> float | None:
        """``step`` seconds (``None``: no end), but no further than the deadline."""
        if self.deadline is None:
            return step
        left = max(0.0, self.deadline - time.monotonic())
        return left if step is None else min(step, left)

    def check(self) -> None:
        """Raise :class:`FlowerDeployError` at the deadline, or with ``watch``'s reason."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise FlowerDeployError(f"flwr run did not end within {self.timeout} s")
        reason = self.watch() if self.watch else None
        if reason:
            raise FlowerDeployError(reason)


def _follow(run_id: int, home: Path, env: dict[str, str] | None, stream_to: Any, done: Callable[[], bool] | None,
            limits: _Limits) -> None:
    """Wait for run ``run_id`` to end at the SuperLink after ``flwr run --stream`` ended, which
    it also does without a word when its log stream fails (an HTTP 500 of a SuperLink whose
    database is locked, while the run goes on): with one line (to ``stream_to``) saying so,
    the run's status is asked (:func:`run_status`) every :data:`FOLLOW_INTERVAL` seconds
    until it has finished, ``done`` says so, or the SuperLink has not answered for
    :data:`FOLLOW_SILENCE` seconds. ``limits`` raises at the deadline or on ``watch``'s reason."""
    said, silent_since = False, None
    while True:
        if done is not None and done():
            return
        status = run_status(run_id, home, env=env)
        if status is not None and status.startswith("finished"):
            return
        now = time.monotonic()
        silent_since = (silent_since or now) if status is None else None
        if silent_since is not None and now - silent_since > FOLLOW_SILENCE:
            _say_to(stream_to, f"medfl: the SuperLink has not answered about run {run_id} for "
                               f"{FOLLOW_SILENCE:g} s; no longer waiting for it\n")
            return
        if not said:
            _say_to(stream_to, f"medfl: the log stream of run {run_id} ended before the run "
                               f"({status or 'no answer from the SuperLink'}); waiting for the run to end at the "
                               f"SuperLink (its whole log: `flwr log {run_id}`)\n")
            said = True
        limits.check()
        time.sleep(limits.capped(FOLLOW_INTERVAL) or 0.0)


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
