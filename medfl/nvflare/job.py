"""``medfl nvflare job``, ``medfl nvflare site`` and ``medfl nvflare simulate``: an NVIDIA FLARE
job folder running a medfl config, an NVFlare site locked down to medfl, and that job run in
NVFlare's simulator.

:func:`write_job` writes, with NVFlare's job API (``FedJob``), the folder an NVFlare user
submits as usual (``nvflare job submit -j DIR/medfl`` in a provisioned or POC system):
``meta.json`` and one app for every site, with a server part
(:class:`medfl.nvflare.controller.MedflController`, carrying the bundle config) and a client part
(:class:`medfl.nvflare.executor.MedflExecutor`, carrying the same config and which NVFlare
client serves which client of the partition: ``site-1`` serves client ``0``...). medfl must be
installed (``medfl[nvflare]``) on the server and at every site. The job names no folder of the
machine that wrote it: relative paths of its config are read at the server and at each site
where that machine says (``MEDFL_WORKDIR``, else the NVFlare workspace the job runs in), so it
can be written anywhere and submitted from anywhere.

:func:`simulate_job` runs such a folder, wherever it is, in NVFlare's simulator through
NVFlare's ``SimEnv`` (``medfl nvflare simulate DIR/medfl --workspace-root ROOT``): NVFlare 2.9
deprecates ``nvflare simulator`` ("Use 'python job.py' with SimEnv instead").

:func:`write_site` writes an NVFlare site's ``local/`` settings so that it builds medfl's
classes alone, deploys no job with custom code, and runs medfl with its own approvals and paths
(docs/nvflare.md, "Securing a site").
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

from medfl.config import ConfigError, resolve_config
from medfl.config_file import PlainDataError, load_bundle_config, refuse_syntax

__all__ = ["write_job", "write_site", "read_job", "simulate_job", "add_parser", "cmd_nvflare_job", "cmd_nvflare_site",
           "cmd_nvflare_simulate", "JOB_NAME", "COMPONENTS", "SITE_ENV_FILE", "site_names", "absolute_paths"]

logger = logging.getLogger(__name__)

#: the job's folder name under ``--out``
JOB_NAME = "medfl"


#: medfl's component classes: what the server's NVFlare and each site's must build for a medfl
#: job, and all that a site written by :func:`write_site` builds
COMPONENTS = ("medfl.nvflare.controller.MedflController", "medfl.nvflare.executor.MedflExecutor")
#: the file in a site's ``local/`` holding its medfl environment (:func:`write_site`)
SITE_ENV_FILE = "medfl_site.env"


def _json_object(path: Path, what: str) -> dict[str, Any] | None:
    """The JSON object in ``path`` (``None`` when there is no such file).

    Raises:
        ConfigError: the file is not a JSON object (one line naming it).
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg}, line {exc.lineno}); {what} must be a JSON object: "
                          "fix it or move it away") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object, not a JSON {type(data).__name__}")
    return data


def _deny_byoc(policy: dict[str, Any], source: Path | str) -> dict[str, Any]:
    """``policy`` (NVFlare's site authorization policy, format 1.0) with the right ``byoc``
    (deploying a job with custom code) set to ``none`` for every role; a role granted every
    right (``"any"``) keeps each other right NVFlare 2.9 names (its admin commands, their
    categories, ``server-predeployed-flwr``), since NVFlare reads a role's single grant before
    its per-right ones.

    Raises:
        ConfigError: the result is not a policy NVFlare accepts (naming ``source``).
    """
    from nvflare.apis.fl_constant import AdminCommandNames
    from nvflare.app_opt.flower.defs import Constant
    from nvflare.fuel.sec.authz import parse_policy_config
    from nvflare.security.security import COMMAND_CATEGORIES

    rights = sorted({*COMMAND_CATEGORIES.values(), Constant.RIGHT_SERVER_PREDEPLOYED_FLWR}
                    | {v for k, v in vars(AdminCommandNames).items() if k.isupper() and v not in COMMAND_CATEGORIES})
    roles = policy.get("permissions")
    if not isinstance(roles, dict) or not roles:
        raise ConfigError(f"{source}: 'permissions' must map each role to its rights (NVFlare's authorization policy)")
    policy = {**policy, "permissions": {role: {**({r: grant for r in rights} if isinstance(grant, (str, list))
                                                 else grant), "byoc": "none"} for role, grant in roles.items()}}
    _, err = parse_policy_config(policy, COMMAND_CATEGORIES)
    if err:
        raise ConfigError(f"{source}: not an authorization policy NVFlare accepts: {err}")
    return policy


def write_site(workspace: str | Path, approvals: str | Path, *, config: str | Path | None = None,
               client_id: str = "", state_dir: str | Path | None = None, workdir: str | Path | None = None,
               device: str = "") -> list[Path]:
    """Lock an NVFlare site down to medfl (``medfl nvflare site``): write in ``workspace/local``

    - ``resources.json`` (from itself, else ``resources.json.default``, its other keys kept):
      ``class_allow_list`` is medfl's :data:`COMPONENTS` alone and ``class_list_enforcement_mode``
      is ``enforce``, so the site builds no other class a job names (NVFlare's default list has
      about 90, executors among them that read data and answer without medfl's approvals), and
      ``allow_log_streaming`` is false: the job's log stays at the site (NVFlare would add its
      own ``JobLogStreamer`` to each job to send it to the server);
    - ``authorization.json`` (from itself, else ``authorization.json.default``, else every
      NVFlare role with every right, as a site without one grants): no role may deploy a job
      with custom code (``byoc``), for which NVFlare skips the class allow-list;
    - :data:`SITE_ENV_FILE`: the site's medfl environment as ``export`` lines to source before
      starting the site (``MEDFL_APPROVALS``, ``MEDFL_SITE_CONFIG``, ``MEDFL_CLIENT_ID``,
      ``MEDFL_STATE_DIR``, ``MEDFL_WORKDIR``, ``MEDFL_DEVICE``; those not given are unset).

    Args:
        workspace: the NVFlare site's workspace: a provisioned startup kit, or a simulator
            workspace (its ``local/`` is copied to every simulated site, and so is the
            environment: leave ``client_id`` and ``config`` out there).
        approvals: the site's approvals file (``medfl approve``, ``medfl policy``), or ``none``
            to run any installed plugin a job names (the explicit opt-out).
        config: the site's own bundle config (its data set and root).
        client_id: which client of the partition the site serves (needed with ``config``).
        state_dir: where the site keeps its ledger and state (default: ``medfl_state`` in the
            client's workspace); made absolute.
        workdir: where relative paths of the site's config are read; made absolute.
        device: the site's torch device.

    Returns:
        The three files written.

    Raises:
        ConfigError: an input is missing or invalid, or a file there is not a JSON object.
    """
    from nvflare.app_common.logging.constants import ALLOW_LOG_STREAMING_VAR
    from nvflare.app_common.widgets.component_path_authorizer import (CLASS_ALLOW_LIST, CLASS_LIST_ENFORCEMENT_MODE,
                                                                       ClassListEnforcementMode)

    env = _site_env(approvals, {"config": config, "client-id": client_id, "state-dir": state_dir,
                                "workdir": workdir, "device": device})
    local = Path(workspace) / "local"
    local.mkdir(parents=True, exist_ok=True)
    resources = local / "resources.json"
    kept = _json_object(resources, "NVFlare's site resources")
    if kept is None:
        kept = _json_object(local / "resources.json.default", "NVFlare's site resources") or {}
    kept.update({CLASS_ALLOW_LIST: list(COMPONENTS), ALLOW_LOG_STREAMING_VAR: False,
                 CLASS_LIST_ENFORCEMENT_MODE: ClassListEnforcementMode.ENFORCE.value})
    authz = local / "authorization.json"
    policy = _site_policy(local)
    resources.write_text(json.dumps(kept, indent=2) + "\n")
    authz.write_text(json.dumps(policy, indent=2) + "\n")
    env_file = local / SITE_ENV_FILE
    env_file.write_text(env)
    return [resources, authz, env_file]


def _site_env(approvals: str | Path, given: dict[str, Any]) -> str:
    """The text of a site's :data:`SITE_ENV_FILE` (:func:`write_site`): ``MEDFL_APPROVALS``
    and the variable of each setting ``given`` a value (paths made absolute) exported, the
    others unset.

    Raises:
        ConfigError: the approvals file does not load, or ``config`` is missing or given
            without ``client-id``.
    """
    from medfl.approval import APPROVALS_ENV, OPT_OUT, ApprovalError, Approvals
    from medfl.nvflare.executor import SITE_ENV

    env: dict[str, str] = {APPROVALS_ENV: OPT_OUT}
    if str(approvals) != OPT_OUT:
        try:
            env[APPROVALS_ENV] = str(Approvals.load(Path(approvals).resolve()).path)
        except ApprovalError as exc:
            raise ConfigError(f"--approvals: {exc}") from None
    config = given["config"]
    if config is not None:
        if not Path(config).is_file():
            raise ConfigError(f"--config {config}: no such file (the site's own bundle config)")
        if not given["client-id"]:
            raise ConfigError(f"--config {config}: a site with its own config names the client it serves: give "
                              "--client-id too")
    for key, value in given.items():
        if value:
            env[SITE_ENV[key]] = str(Path(value).resolve()) if key in ("config", "state-dir", "workdir") else str(value)
    lines = [f"export {k}={shlex.quote(env[k])}" if k in env else f"unset {k}"
             for k in (APPROVALS_ENV, *SITE_ENV.values())]
    return ("# the site's medfl environment (`medfl nvflare site`): source it before starting the site\n"
            + "\n".join(lines) + "\n")


def _site_policy(local: Path) -> dict[str, Any]:
    """The authorization policy of a site's ``local/`` folder (``authorization.json``, else
    ``authorization.json.default``, else every NVFlare role with every right) with no role
    allowed to deploy custom code (:func:`_deny_byoc`)."""
    from nvflare.lighter.constants import DEFINED_ROLES

    for source in (local / "authorization.json", local / "authorization.json.default"):
        policy = _json_object(source, "NVFlare's authorization policy")
        if policy is not None:
            return _deny_byoc(policy, source)
    return _deny_byoc({"format_version": "1.0", "permissions": {r: "any" for r in DEFINED_ROLES}}, "NVFlare's roles")


def site_names(n: int) -> list[str]:
    """NVFlare's default client names for ``n`` sites (its simulator's and POC mode's):
    ``site-1`` ... ``site-n``."""
    return [f"site-{i}" for i in range(1, n + 1)]


def write_job(out: str | Path, config: str | Path | None = None, *, sites: int | None = None,
              overrides: dict[str, Any] | None = None, resume: str | Path | None = None, rounds: int = 0,
              result_file: str = "", round_timeout: float = 600.0, connect_timeout: float = 300.0) -> Path:
    """Write the NVFlare job of a medfl bundle config (or of a stopped run to resume).

    Args:
        out: the folder the job is written in (``out/medfl``).
        config: the bundle config (``train.json``), read here by MONAI's parser (the
            coordinator's own text); the job carries its ``fl`` section as plain data, which is
            all a site reads of it. Relative paths in it are read at the server and at each
            site in that machine's ``MEDFL_WORKDIR`` (``medfl nvflare site --workdir``), else in
            the NVFlare workspace the job runs in; an absolute one is read as it is on every
            machine, and is logged as a warning (:func:`absolute_paths`). The job names no
            folder of this machine (not the one this is called in).
        sites: how many NVFlare clients (``site-1``...; default: the config's ``num_clients``).
        overrides: ``#``-path overrides of the config.
        resume: a stopped run or experiment directory on the server's machine, to continue
            instead (its saved config is used; ``config`` may then be omitted).
        rounds: with ``resume``, a new total number of rounds.
        result_file: where the server writes the outcome as JSON ("": nowhere; relative: in
            the server's working folder, as the config's paths).
        round_timeout, connect_timeout: the coordinator's waits for the sites, in seconds.

    Returns:
        The job folder (``out/medfl``).

    Raises:
        ConfigError: no config (and no resume), the config's ``fl.backend`` names another
            backend, ``sites`` differs from the config's ``num_clients``, or its ``fl`` section
            is not plain JSON once read (a value MONAI built, an expression's result).
    """
    from medfl.nvflare.transport import TASKS

    if resume:
        saved = Path(resume) / "config.json"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.json there (not a medfl run or experiment directory)")
        fl = json.loads(saved.read_text())
        fl = fl.get("fl") if isinstance(fl, dict) else None      # medfl writes {"fl": ..., "engine": ...}
        if not isinstance(fl, dict):
            raise ConfigError(f"--resume {resume}: {saved} has no 'fl' section (not the config.json medfl writes)")
        bundle, resolved = {"fl": fl}, fl
    elif config is None:
        raise ConfigError("medfl nvflare job: give --config CONFIG (a bundle config) or --resume RUN_DIR")
    else:
        if not str(config).endswith(".json"):
            raise ConfigError(f"--config {config}: expected a JSON bundle config (train.json)")
        fl = load_bundle_config(config, overrides)
        resolved = resolve_config(fl)
        backend = resolved.get("backend") or "inprocess"
        backend = backend if isinstance(backend, str) else backend.get("name", "inprocess")
        if backend not in ("inprocess", "nvflare"):
            raise ConfigError(f"{config}: fl.backend is {backend!r}; an NVFlare job runs on backend 'nvflare' "
                              "(remove fl.backend or set it to 'nvflare')")
        bundle = {"fl": {**fl, "backend": "nvflare"}}
    try:   # what a site reads of the job: plain data, or every site refuses it
        refuse_syntax(bundle, f"{config or resume}: the job's config")
    except PlainDataError as exc:
        raise ConfigError(str(exc)) from None
    n = int(sites or resolved.get("num_clients") or 0)
    if n != int(resolved.get("num_clients") or n):
        raise ConfigError(f"--sites {n}: the config's fl.num_clients is {resolved.get('num_clients')}; each NVFlare "
                          "client serves one client of the partition")
    if n < 1:
        raise ConfigError(f"--sites {n}: expected at least 1")
    for key, value in absolute_paths(bundle["fl"], "fl"):
        logger.warning(f"medfl nvflare job: {key} is an absolute path ({value}); the server and every site read it "
                       "as it is on their own machine: give a relative path (read in each machine's MEDFL_WORKDIR, "
                       "else its NVFlare workspace), or give each site its own config (medfl nvflare site --config)")
    names = site_names(n)
    # no overrides: `nvflare job submit` rewrites '#'-path keys into nested objects; no workdir:
    # the job names no folder of this machine (each machine reads relative paths in its own)
    server = {"bundle": bundle, "resume": str(resume or ""), "rounds": rounds, "result_file": result_file,
              "round_timeout": round_timeout, "connect_timeout": connect_timeout}
    client = {"bundle": bundle, "client_ids": {name: str(i) for i, name in enumerate(names)}}
    job = _fed_job(JOB_NAME, n, server, client, list(TASKS))
    Path(out).mkdir(parents=True, exist_ok=True)
    job.export_job(str(out))
    return Path(out) / JOB_NAME


def absolute_paths(value: Any, key: str) -> list[tuple[str, str]]:
    """The strings of ``value`` (a config section, at ``key``) that are absolute paths (or start
    at a home folder, ``~``), with the dotted key of each (``fl.dataset.root``): what a job would
    read as it is on every machine."""
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in absolute_paths(v, f"{key}.{k}")]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in absolute_paths(v, f"{key}[{i}]")]
    if isinstance(value, str) and (value.startswith(("/", "~")) or (len(value) > 2 and value[1] == ":"
                                                                    and value[2] in "\\/")):
        return [(key, value)]
    return []


def _fed_job(name: str, min_clients: int, server: dict[str, Any], client: dict[str, Any], tasks: list[str]) -> Any:
    """NVFlare's ``FedJob`` of a medfl job: one app for every site, :class:`MedflController` with
    the arguments ``server`` on the server, :class:`MedflExecutor` with ``client`` for ``tasks``."""
    from nvflare.job_config.api import FedJob

    from medfl.nvflare.controller import MedflController
    from medfl.nvflare.executor import MedflExecutor

    job = FedJob(name=name, min_clients=min_clients)
    # medfl is installed at the server and the sites (medfl[nvflare]): not copied into the job's custom/
    job.set_app_packages(["medfl", "medfl_plugins"])
    job.to_server(MedflController(**server))
    job.to_clients(MedflExecutor(**client), tasks=tasks)
    return job


def read_job(job: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[str]]:
    """The job folder ``job`` that :func:`write_job` wrote (wherever it was moved since): its
    ``meta.json``, the controller's and the executor's arguments, and the executor's tasks.

    Raises:
        ConfigError: ``job`` is not such a folder: no ``meta.json`` or app config, another
            component or filter, another app layout, or custom code.
    """
    job = Path(job)
    app = job / "app"
    what = "a job folder `medfl nvflare job` writes (meta.json, app/config/config_fed_{server,client}.json)"
    meta = _json_object(job / "meta.json", "a job's meta.json")
    server = _json_object(app / "config" / "config_fed_server.json", "a job's server config")
    client = _json_object(app / "config" / "config_fed_client.json", "a job's client config")
    if meta is None or server is None or client is None:
        raise ConfigError(f"{job}: not {what}")
    workflows, executors = server.get("workflows") or [], client.get("executors") or []
    others = [k for conf in (server, client) for k in ("components", "task_data_filters", "task_result_filters")
              if conf.get(k)]
    if (meta.get("deploy_map") != {"app": ["@ALL"]} or len(workflows) != 1 or len(executors) != 1
            or workflows[0].get("path") != COMPONENTS[0]
            or (executors[0].get("executor") or {}).get("path") != COMPONENTS[1] or others
            or (app / "custom").exists()):
        raise ConfigError(f"{job}: not {what}: medfl simulates only its controller and executor, in one app for "
                          "every site, with no other component, filter or custom code; run any other job with "
                          "NVFlare's own tools")
    tasks = executors[0].get("tasks") or []
    return meta, dict(workflows[0].get("args") or {}), dict(executors[0]["executor"].get("args") or {}), list(tasks)


def simulate_job(job: str | Path, workspace_root: str | Path, *, sites: int | None = None,
                 threads: int | None = None) -> Path:
    """Run the job folder ``job`` (:func:`write_job`'s, from wherever it is now) in NVFlare's
    simulator through NVFlare's ``SimEnv`` (NVFlare 2.9's replacement of ``nvflare simulator``,
    as its deprecation warning says): the job's two components are built again from the
    folder's arguments into a ``FedJob``, which ``SimEnv`` exports to a temporary folder and runs
    with ``sites`` clients ``site-1``... in ``workspace_root/NAME`` (``NAME``: the job's name,
    ``medfl``; NVFlare's ``NVFLARE_SIMULATOR_WORKSPACE_ROOT`` wins over ``workspace_root``).
    That folder's ``local/`` must hold medfl's class allow-list (``medfl nvflare site
    --workspace workspace_root/NAME``): without one, ``SimEnv`` installs NVFlare's own list,
    which builds no medfl class. The server and the sites get this process's environment.

    Args:
        job: the job folder (``OUT/medfl``).
        workspace_root: where ``SimEnv`` keeps its workspaces.
        sites: how many NVFlare clients (default: as many as the job's ``client_ids``).
        threads: how many run at once (default: ``sites``).

    Returns:
        The simulator's workspace (``workspace_root/NAME``): the server's log is
        ``server/simulate_job/log.txt`` there.

    Raises:
        ConfigError: ``job`` is not a job ``medfl nvflare job`` writes, or the workspace is not
            locked down to medfl.
        RuntimeError: the simulator failed (``SimEnv``'s error, naming its logs).
    """
    from nvflare.app_common.widgets.component_path_authorizer import CLASS_ALLOW_LIST
    from nvflare.recipe import SimEnv

    meta, server, client, tasks = read_job(job)
    name = str(meta.get("name") or JOB_NAME)
    n = int(sites or len(client.get("client_ids") or {}) or meta.get("min_clients") or 0)
    if n < 1:
        raise ConfigError(f"--sites {n}: expected at least 1")
    try:
        fed_job = _fed_job(name, int(meta.get("min_clients") or n), server, client, tasks)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{job}: {exc}") from None
    env = SimEnv(num_clients=n, num_threads=threads or n, workspace_root=str(workspace_root))
    workspace = Path(env.workspace_root) / name
    resources = _json_object(workspace / "local" / "resources.json", "NVFlare's site resources") or {}
    if list(resources.get(CLASS_ALLOW_LIST) or []) != list(COMPONENTS):
        raise ConfigError(f"{workspace}/local: not locked down to medfl (no class allow-list of medfl's classes); "
                          f"run `medfl nvflare site --workspace {workspace} --approvals FILE|none` first (NVFlare's "
                          "SimEnv would install its own list, which builds no medfl class)")
    env.deploy(fed_job)
    return workspace


def _error(exc: BaseException) -> int:
    """Say ``exc`` as medfl's one-line error; the exit status 2."""
    logging.getLogger("medfl").error(f"medfl: error: {exc}")
    return 2


def cmd_nvflare_job(args: Any) -> int:
    """``medfl nvflare job``: write the job; say how to run it."""
    try:
        overrides = json.loads(args.overrides) if args.overrides else {}
        job = write_job(args.out, args.config, sites=args.sites, overrides=overrides, resume=args.resume,
                        rounds=args.rounds, result_file=args.result_file, round_timeout=args.round_timeout,
                        connect_timeout=args.connect_timeout)
    except (ConfigError, json.JSONDecodeError, OSError, ImportError) as exc:
        return _error(exc)
    print(f"wrote NVFlare job {job}")
    print(f"simulate: medfl nvflare simulate {job} --workspace-root ROOT  (first: medfl nvflare site --workspace "
          f"ROOT/{JOB_NAME} --approvals FILE)\nsubmit:   nvflare job submit -j {job}  (docs/nvflare.md)")
    return 0


def cmd_nvflare_simulate(args: Any) -> int:
    """``medfl nvflare simulate``: run a written job in NVFlare's simulator (:func:`simulate_job`)."""
    try:
        workspace = simulate_job(args.job, args.workspace_root, sites=args.sites, threads=args.threads)
    except (ConfigError, OSError, ImportError, RuntimeError) as exc:
        return _error(exc)
    print(f"simulated NVFlare job {args.job} in {workspace} (NVFlare's SimEnv); the server's log: "
          f"{workspace / 'server' / 'simulate_job' / 'log.txt'}")
    return 0


def cmd_nvflare_site(args: Any) -> int:
    """``medfl nvflare site``: lock an NVFlare site's workspace down to medfl (:func:`write_site`);
    say what was written and how to start the site."""
    try:
        written = write_site(args.workspace, args.approvals, config=args.config, client_id=args.client_id,
                             state_dir=args.state_dir, workdir=args.workdir, device=args.device)
    except (ConfigError, OSError, ImportError) as exc:
        return _error(exc)
    resources, authz, env = written
    print(f"wrote {resources}: class_allow_list {', '.join(COMPONENTS)} only, class_list_enforcement_mode enforce, "
          "allow_log_streaming false")
    print(f"wrote {authz}: no role may deploy a job with custom code (byoc: none); other rights kept")
    print(f"wrote {env}:\n  " + "\n  ".join(env.read_text().splitlines()[1:]))
    if args.approvals == "none":
        print("WARNING: --approvals none: this site runs any installed plugin a job names (no approvals file)")
    start, source = Path(args.workspace) / "startup" / "start.sh", f". {shlex.quote(str(env))} &&"
    ws = Path(args.workspace)
    print(f"start the site: {source} {shlex.quote(str(start))}" if start.is_file() else
          f"simulate: {source} medfl nvflare simulate JOB --workspace-root {shlex.quote(str(ws.parent))}  "
          f"(SimEnv runs a job in ROOT/ITS_NAME: this workspace serves a job named {ws.name!r})")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``medfl nvflare job``, ``medfl nvflare site`` and ``medfl nvflare simulate`` to the
    command line's subcommands ``sub``."""
    np_ = sub.add_parser("nvflare", help="run a config under NVIDIA FLARE: write its job, lock a site down, "
                                         "simulate the job (docs/nvflare.md)")
    nsub = np_.add_subparsers(dest="nvflare_command", required=True)
    sp = nsub.add_parser("job", help="write an NVFlare job folder running a bundle config (needs medfl[nvflare])")
    sp.add_argument("--config", default=None, help="the bundle config (train.json)")
    sp.add_argument("--out", required=True, help="folder the job is written in (OUT/medfl)")
    sp.add_argument("--sites", type=int, default=None, help="NVFlare clients site-1..site-N (default: fl.num_clients)")
    sp.add_argument("--overrides", default="", help='JSON of #-path overrides, e.g. \'{"fl#rounds": 3}\'')
    sp.add_argument("--resume", default=None, help="a stopped run directory (on the server) to continue instead")
    sp.add_argument("--rounds", type=int, default=0, help="with --resume: a new total number of rounds")
    sp.add_argument("--result-file", default="", help="where the server writes the outcome as JSON (relative: "
                                                      "in the server's working folder)")
    sp.add_argument("--round-timeout", type=float, default=600.0, help="seconds to wait for one exchange")
    sp.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the sites at the start")
    sp.set_defaults(func=cmd_nvflare_job)
    sp = nsub.add_parser("site", help="lock an NVFlare site down to medfl: only medfl's executor, no custom code, "
                                      "the site's approvals and paths (docs/nvflare.md, Securing a site)")
    sp.add_argument("--workspace", required=True, metavar="DIR", help="the site's NVFlare workspace (its startup kit, "
                                                                      "or a simulator workspace: ROOT/medfl for "
                                                                      "`medfl nvflare simulate`); written: DIR/local")
    sp.add_argument("--approvals", required=True, metavar="FILE|none",
                    help="the site's approvals file (medfl approve, medfl policy); none: run any installed plugin")
    sp.add_argument("--config", default=None, help="the site's own bundle config (its data set and root)")
    sp.add_argument("--client-id", default="", help="the client of the partition this site serves (needed with "
                                                    "--config; default: the job's site-K -> K-1)")
    sp.add_argument("--state-dir", default=None, help="where the site keeps its ledger and state, outside the "
                                                      "workspace (default: medfl_state in the client's workspace)")
    sp.add_argument("--workdir", default=None, help="where relative paths of the site's config are read")
    sp.add_argument("--device", default="", help="the site's torch device (e.g. cuda:1)")
    sp.set_defaults(func=cmd_nvflare_site)
    sp = nsub.add_parser("simulate", help="run a job `medfl nvflare job` wrote in NVFlare's simulator (its SimEnv, "
                                          "which replaces the deprecated `nvflare simulator`)")
    sp.add_argument("job", help="the job folder (OUT/medfl), wherever it is now")
    sp.add_argument("--workspace-root", required=True, metavar="ROOT",
                    help="SimEnv's workspace root: the job runs in ROOT/medfl, which `medfl nvflare site --workspace "
                         "ROOT/medfl` locks down first")
    sp.add_argument("-n", "--sites", type=int, default=None, help="NVFlare clients site-1..site-N (default: the "
                                                                  "job's)")
    sp.add_argument("-t", "--threads", type=int, default=None, help="clients run at once (default: N)")
    sp.set_defaults(func=cmd_nvflare_simulate)
