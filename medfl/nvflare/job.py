"""``medfl nvflare job``: an NVIDIA FLARE job folder running a medfl config.

:func:`write_job` writes, with NVFlare's job API (``FedJob``), the folder an NVFlare user
submits as usual (``nvflare job submit -j DIR/medfl`` in a provisioned or POC system, or
``nvflare simulator DIR/medfl -w WORKSPACE -n SITES -t SITES``): ``meta.json`` and one server
app (:class:`medfl.nvflare.controller.MedflController`, carrying the bundle config) and one
client app (:class:`medfl.nvflare.executor.MedflExecutor`, carrying the same config and which
NVFlare client serves which client of the partition: ``site-1`` serves client ``0``...).
medfl must be installed (``medfl[nvflare]``) on the server and at every site.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from medfl.config import ConfigError, resolve_config
from medfl.config_file import load_bundle_config

__all__ = ["write_job", "allow_components", "add_parser", "cmd_nvflare_job", "JOB_NAME", "COMPONENTS", "site_names"]

#: the job's folder name under ``--out``
JOB_NAME = "medfl"


#: what a site's (and the server's) NVFlare ``class_allow_list`` must allow for a medfl job
COMPONENTS = ("medfl.nvflare.controller.MedflController", "medfl.nvflare.executor.MedflExecutor")


def allow_components(local_dir: str | Path) -> Path:
    """Allow medfl's two components in an NVFlare site's ``local/resources.json`` (NVFlare
    builds only the component classes its ``class_allow_list`` names): add them to the list
    there, starting from ``resources.json.default``'s (or NVFlare's default list) when the
    site has none. For the simulator, ``local_dir`` is ``WORKSPACE/local`` (copied to every
    simulated site). Returns the file written.

    Raises:
        ConfigError: an existing resources file is not a JSON object.
    """
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    local = Path(local_dir)
    path = local / "resources.json"
    base = path if path.is_file() else local / "resources.json.default"
    resources: Any = json.loads(base.read_text()) if base.is_file() else {}
    if not isinstance(resources, dict):
        raise ConfigError(f"{base}: expected a JSON object (NVFlare's site resources)")
    allowed = list(resources.get("class_allow_list") or DEFAULT_CLASS_ALLOW_LIST)
    resources["class_allow_list"] = allowed + [c for c in COMPONENTS if c not in allowed]
    local.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resources, indent=2))
    return path


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
        config: the bundle config (``train.json``); relative paths in it are read from the
            directory this is called in (the job records it as ``workdir``).
        sites: how many NVFlare clients (``site-1``...; default: the config's ``num_clients``).
        overrides: ``#``-path overrides of the config.
        resume: a stopped run or experiment directory on the server's machine, to continue
            instead (its saved config is used; ``config`` may then be omitted).
        rounds: with ``resume``, a new total number of rounds.
        result_file: where the server writes the outcome as JSON ("": nowhere).
        round_timeout, connect_timeout: the coordinator's waits for the sites, in seconds.

    Returns:
        The job folder (``out/medfl``).

    Raises:
        ConfigError: no config (and no resume), the config's ``fl.backend`` names another
            backend, or ``sites`` differs from the config's ``num_clients``.
    """
    from nvflare.job_config.api import FedJob

    from medfl.nvflare.controller import MedflController
    from medfl.nvflare.executor import MedflExecutor
    from medfl.nvflare.grid import TASKS

    overrides = dict(overrides or {})
    if resume:
        saved = Path(resume) / "config.json"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.json there (not a medfl run or experiment directory)")
        fl = json.loads(saved.read_text())
        fl = fl.get("fl") if isinstance(fl, dict) else None      # medfl writes {"fl": ..., "engine": ...}
        if not isinstance(fl, dict):
            raise ConfigError(f"--resume {resume}: {saved} has no 'fl' section (not the config.json medfl writes)")
        bundle = {"fl": fl}
    elif config is None:
        raise ConfigError("medfl nvflare job: give --config CONFIG (a bundle config) or --resume RUN_DIR")
    else:
        bundle = json.loads(Path(config).read_text()) if str(config).endswith(".json") else None
        if bundle is None:
            raise ConfigError(f"--config {config}: expected a JSON bundle config (train.json)")
        fl = resolve_config(load_bundle_config(config, overrides))
        backend = fl.get("backend") or "inprocess"
        backend = backend if isinstance(backend, str) else backend.get("name", "inprocess")
        if backend not in ("inprocess", "nvflare"):
            raise ConfigError(f"{config}: fl.backend is {backend!r}; an NVFlare job runs on backend 'nvflare' "
                              "(remove fl.backend or set it to 'nvflare')")
        overrides["fl#backend"] = "nvflare"
    n = int(sites or fl.get("num_clients") or 0)
    if n != int(fl.get("num_clients") or n):
        raise ConfigError(f"--sites {n}: the config's fl.num_clients is {fl.get('num_clients')}; each NVFlare "
                          "client serves one client of the partition")
    if n < 1:
        raise ConfigError(f"--sites {n}: expected at least 1")
    workdir = str(Path.cwd())
    names = site_names(n)
    job = FedJob(name=JOB_NAME, min_clients=n)
    # medfl is installed at the server and the sites (medfl[nvflare]): not copied into the job's custom/
    job.set_app_packages(["medfl", "medfl_plugins"])
    job.to_server(MedflController(bundle=bundle, overrides=overrides, workdir=workdir, resume=str(resume or ""),
                                  rounds=rounds, result_file=result_file, round_timeout=round_timeout,
                                  connect_timeout=connect_timeout))
    job.to_clients(MedflExecutor(bundle=bundle, overrides=overrides, workdir=workdir,
                                 client_ids={name: str(i) for i, name in enumerate(names)}), tasks=list(TASKS))
    Path(out).mkdir(parents=True, exist_ok=True)
    job.export_job(str(out))
    return Path(out) / JOB_NAME


def cmd_nvflare_job(args: Any) -> int:
    """``medfl nvflare job``: write the job (and, with ``--allow LOCAL``, allow its components
    in that NVFlare ``local/`` folder); say how to run it."""
    import logging

    try:
        overrides = json.loads(args.overrides) if args.overrides else {}
        job = write_job(args.out, args.config, sites=args.sites, overrides=overrides, resume=args.resume,
                        rounds=args.rounds, result_file=args.result_file, round_timeout=args.round_timeout,
                        connect_timeout=args.connect_timeout)
        allowed = [allow_components(d) for d in args.allow]
    except (ConfigError, json.JSONDecodeError, OSError, ImportError) as exc:
        logging.getLogger("medfl").error(f"medfl: error: {exc}")
        return 2
    print(f"wrote NVFlare job {job}")
    for path in allowed:
        print(f"allowed medfl's components in {path}")
    print(f"simulate: nvflare simulator {job} -w WORKSPACE -n N -t N  (first: medfl nvflare job ... --allow "
          f"WORKSPACE/local)\nsubmit:   nvflare job submit -j {job}  (docs/nvflare.md)")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``medfl nvflare job`` to the command line's subcommands ``sub``."""
    np_ = sub.add_parser("nvflare", help="run a config under NVIDIA FLARE: write its job (docs/nvflare.md)")
    nsub = np_.add_subparsers(dest="nvflare_command", required=True)
    sp = nsub.add_parser("job", help="write an NVFlare job folder running a bundle config (needs medfl[nvflare])")
    sp.add_argument("--config", default=None, help="the bundle config (train.json)")
    sp.add_argument("--out", required=True, help="folder the job is written in (OUT/medfl)")
    sp.add_argument("--sites", type=int, default=None, help="NVFlare clients site-1..site-N (default: fl.num_clients)")
    sp.add_argument("--overrides", default="", help='JSON of #-path overrides, e.g. \'{"fl#rounds": 3}\'')
    sp.add_argument("--resume", default=None, help="a stopped run directory (on the server) to continue instead")
    sp.add_argument("--rounds", type=int, default=0, help="with --resume: a new total number of rounds")
    sp.add_argument("--result-file", default="", help="where the server writes the outcome as JSON")
    sp.add_argument("--round-timeout", type=float, default=600.0, help="seconds to wait for one exchange")
    sp.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the sites at the start")
    sp.add_argument("--allow", action="append", default=[], metavar="LOCAL_DIR",
                    help="also allow medfl's components in this NVFlare local/ folder (resources.json); repeatable")
    sp.set_defaults(func=cmd_nvflare_job)
