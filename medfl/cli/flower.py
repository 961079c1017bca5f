"""``medfl flower``: the three steps of a Flower deployment (SuperLink, sites, runs) and the
keys and certificates they use (docs/flower.md). Flower and the site that trains (the engine)
are imported inside the commands, so that ``medfl --help`` runs without Flower and loads neither."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from medfl.bundle import load_bundle_config
from medfl.cli.run import add_threads_option, add_tracking, add_tracking_option, apply_threads, parse_overrides
from medfl.cli.site import site_approvals
from medfl.config import check_threads, check_tracking, local_sites, set_threads
from medfl.flower.auth import (AuthError, check_private_key, make_certificates, make_site_key, pin_site,
                               read_site_nodes, register_site)

__all__ = ["add_parsers", "cmd_flower_superlink", "cmd_flower_certs", "cmd_flower_keys",
           "cmd_flower_register_site", "cmd_flower_site", "cmd_flower_run"]

logger = logging.getLogger(__name__)


def _tls_args(args: argparse.Namespace, server: bool) -> tuple[bool, list[str]]:
    """``(insecure, extra Flower arguments)`` from ``--insecure`` or the TLS options."""
    if args.insecure:
        return True, []
    if server:
        files = [args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certfile]
        if not all(files):
            raise SystemExit("medfl flower: pass --insecure (no TLS, e.g. on one machine) or all of "
                             "--ssl-certfile, --ssl-keyfile and --ssl-ca-certfile")
        return False, ["--ssl-certfile", files[0], "--ssl-keyfile", files[1], "--ssl-ca-certfile", files[2]]
    if not args.root_certificates:
        raise SystemExit("medfl flower: pass --insecure (no TLS, e.g. on one machine) or --root-certificates CA.pem")
    return False, ["--root-certificates", args.root_certificates]


def cmd_flower_superlink(args: argparse.Namespace) -> int:
    """Start the SuperLink (step 1) and the SuperExec that starts each run's ServerApp,
    which is started again whenever it exits (:func:`medfl.flower.flwr_launcher.supervise`);
    this process becomes that command (so signals reach it directly)."""
    from medfl.flower.deploy import flower_env, superlink_command

    insecure, extra = _tls_args(args, server=True)
    if args.enable_supernode_auth:
        if insecure:
            raise SystemExit("medfl flower superlink: --enable-supernode-auth needs TLS (Flower signs each "
                             "site's requests over an encrypted connection only): drop --insecure and give "
                             "--ssl-certfile, --ssl-keyfile and --ssl-ca-certfile (`medfl flower certs` makes "
                             "a set for trying it out)")
        extra.append("--enable-supernode-auth")
    cmd = superlink_command(args.host, args.port, insecure=insecure, database=args.database, extra=extra,
                            root_certificates=None if insecure else args.ssl_ca_certfile)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, flower_env())
    return 0  # pragma: no cover - execv does not return


@contextmanager
def _auth_errors(who: str) -> Iterator[None]:
    """Turn a key, certificate or registration error (:class:`medfl.flower.auth.AuthError`)
    into one line of ``who``'s, without a traceback."""
    try:
        yield
    except AuthError as exc:
        raise SystemExit(f"{who}: {exc}") from None


def cmd_flower_certs(args: argparse.Namespace) -> int:
    """Write a certificate authority and a SuperLink certificate for ``--host``."""
    with _auth_errors("medfl flower certs"):
        paths = make_certificates(args.out, args.host, days=args.days)
    print(f"SuperLink: --ssl-certfile {paths['server']} --ssl-keyfile {paths['server_key']} "
          f"--ssl-ca-certfile {paths['ca']}")
    print(f"sites and `medfl flower run`: --root-certificates {paths['ca']}  (keep {paths['ca_key']} offline)")
    return 0


def cmd_flower_keys(args: argparse.Namespace) -> int:
    """Write one key pair per site name."""
    with _auth_errors("medfl flower keys"):
        for name in args.names:
            private, public = make_site_key(args.out, name)
            print(f"{name}: private {private} (stays at the site: --auth-key), public {public} "
                  "(to register at the SuperLink)")
    return 0


def cmd_flower_register_site(args: argparse.Namespace) -> int:
    """Register site public keys at a SuperLink started with ``--enable-supernode-auth``."""
    insecure, _ = _tls_args(args, server=False)
    if args.client_id is not None and (len(args.public_keys) != 1 or not args.nodes_file):
        raise SystemExit("medfl flower register-site: --client-id takes one public key and --nodes-file FILE "
                         "(the sites.json that `medfl flower run --site-nodes` reads)")
    with _auth_errors("medfl flower register-site"):
        if args.nodes_file and Path(args.nodes_file).exists():
            read_site_nodes(args.nodes_file)          # a broken file stops before anything is registered
        for key in args.public_keys:
            node = register_site(key, args.superlink, root_certificates=args.root_certificates,
                                 insecure=insecure, name=args.name)
            print(f"{key}: registered as node {node}")
            if args.client_id is not None:
                pin_site(args.nodes_file, args.client_id, node)
                print(f"{args.nodes_file}: client {args.client_id} is served by node {node} only "
                      "(give it to `medfl flower run --site-nodes`)")
    return 0


def cmd_flower_site(args: argparse.Namespace) -> int:
    """Start one site's SuperNode (step 2)."""
    from medfl.flower.deploy import flower_env, site_command
    from medfl.flower.worker import run_site, shutil_rmtree, socket_for
    from medfl.site import SiteSettings

    # the same overrides as `medfl run` and `medfl flower run`: any '#' path of the bundle
    # config (fl#dataset#root=/data, bundle_root=/x); options may also follow them (main())
    overrides = parse_overrides(args.overrides) or None
    apply_threads(args)   # the worker that trains is this process
    set_threads(None, local_sites())   # "auto" here; a number in the site's fl.threads wins (its Site)
    insecure, extra = _tls_args(args, server=False)
    if not Path(args.config).is_file():
        raise FileNotFoundError(f"{args.config}: config file not found")
    if args.auth_key:
        if insecure:
            raise SystemExit("medfl flower site: --auth-key needs TLS: drop --insecure and give "
                             "--root-certificates CA.pem")
        with _auth_errors("medfl flower site"):
            extra += ["--auth-supernode-private-key", str(check_private_key(args.auth_key).resolve())]
    site_approvals(args)
    sock = socket_for()
    try:
        cmd = site_command(str(args.client_id), args.config, args.state_dir, args.superlink, port=args.port,
                           host=args.host, insecure=insecure, overrides=overrides, device=args.device,
                           worker=sock, extra=extra)
        settings = SiteSettings(client_id=str(args.client_id), config=Path(args.config).resolve(),
                                state_dir=Path(args.state_dir).resolve(), overrides=overrides or {},
                                workdir=Path.cwd().resolve(), device=args.device)
    except BaseException:
        shutil_rmtree(Path(sock).parent)   # run_site removes it from here on
        raise
    return run_site(settings, cmd, env=flower_env(), restart=not getattr(args, "no_restart", False))


def cmd_flower_run(args: argparse.Namespace) -> int:
    """Launch a run on a SuperLink with ``flwr run`` and stream its log (step 3).

    It ends with the ServerApp's outcome (1 and one ``medfl flower run: the run failed:``
    line when it failed; 2 and one ``medfl: error:`` line, as ``medfl run``, when the
    coordinator refused the settings before any run started: the config, or a method's
    ``MethodConfigError``) and leaves nothing running: once the ServerApp wrote its result,
    a run that has not ended at the SuperLink within ``--exit-grace`` seconds is stopped
    (``flwr stop``), and so is the run on Ctrl-C or SIGTERM (exit code 130; the coordinator
    saves its finished rounds: continue with ``--resume``). A failed run's line is all it
    says of the failure: Flower's report of the ServerApp's exception (its traceback) is shown
    only with ``--debug``."""
    from medfl.flower.deploy import make_run_config, write_app

    insecure, _ = _tls_args(args, server=False)
    overrides, threads = _run_overrides(args)
    site_nodes = None
    if args.site_nodes:
        with _auth_errors("medfl flower run: --site-nodes"):
            site_nodes = read_site_nodes(args.site_nodes)
    # the app, Flower's home and (by default) the result file live here until the run has ended
    with tempfile.TemporaryDirectory(prefix="medfl-flower-") as tmp_name:
        tmp = Path(tmp_name)
        result_file = (Path(args.result_file).resolve() if args.result_file
                       else tmp / f"result-{uuid.uuid4().hex}.json")
        rc = make_run_config(workdir=Path.cwd(), result_file=result_file, round_timeout=args.round_timeout,
                             connect_timeout=args.connect_timeout, hello_timeout=args.hello_timeout,
                             config=args.config, overrides=overrides, resume=args.resume, rounds=args.rounds,
                             progress_interval=args.progress_interval, site_nodes=site_nodes,
                             max_reply_mb=args.max_reply_mb, launch=_launch_options(args, insecure),
                             threads=threads if args.resume else None)
        return _follow_run(args, write_app(tmp / "app"), rc, result_file, tmp / "flwr_home", insecure)


def _run_overrides(args: argparse.Namespace) -> tuple[dict[str, Any] | None, int | None]:
    """``(overrides, threads)`` of ``medfl flower run``: a new run's config overrides, with
    ``--threads`` as ``fl#threads`` and ``--tracking`` added to ``fl#tracking`` (``None`` for
    ``--resume``), and the number ``--threads`` gives (``None`` without it)."""
    overrides = None
    if not args.resume:
        if not args.config:
            raise SystemExit("medfl flower run: give a bundle config (or --resume RUN_DIR)")
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"{args.config}: config file not found")
        overrides = parse_overrides(args.overrides)
    threads = None
    if getattr(args, "threads", None) is not None:
        threads = check_threads(args.threads, "--threads")
        if not args.resume:   # a new run's fl#threads; a resumed one's coordinator, as `medfl resume --threads`
            overrides = {**(overrides or {}), "fl#threads": threads}
    if getattr(args, "tracking", None):
        if args.resume:
            raise SystemExit("medfl flower run: --tracking adds trackers to a new run's fl#tracking; a resumed run "
                             "continues with the trackers it started with")
        overrides = {**(overrides or {}), "fl#tracking": _flower_tracking(args.config, overrides, args.tracking)}
    return overrides, threads


def _follow_run(args: argparse.Namespace, app_dir: Path, rc: dict[str, Any], result_file: Path, flwr_home: Path,
                insecure: bool) -> int:
    """Run ``app_dir`` with ``flwr run`` on ``args.superlink`` until it has ended, stopping
    it there on Ctrl-C, SIGTERM or once ``--exit-grace`` has passed after the ServerApp wrote
    ``result_file``; return the exit code of ``medfl flower run`` (:func:`_outcome`)."""
    from medfl.flower.deploy import FlowerDeployError, HeldTraceback, flwr_run, flwr_stop, read_json, started_run_id

    seen: dict[str, float] = {}

    def failed() -> bool:   # the ServerApp wrote a failed result, which the line below reports
        result = read_json(result_file)
        return result is not None and not result.get("ok") and not result.get("refused")

    # Flower's traceback of a ServerApp that failed is held back (shown after all if no line says why)
    output = None if args.debug else HeldTraceback(failed)

    def note(line: str) -> None:
        run_id = started_run_id(line)
        if run_id is not None:
            seen["run"] = run_id

    def ended() -> str | None:
        # the SuperLink runs on this machine and the ServerApp wrote its result: the run is over
        if read_json(result_file) is None:
            return None
        since = seen.setdefault("result", time.monotonic())
        if time.monotonic() - since < args.exit_grace:
            return None
        return (f"the ServerApp wrote its result {args.exit_grace:g} s ago but the run has not ended at the "
                "SuperLink")

    try:
        with _sigterm_as_interrupt():
            code = flwr_run(app_dir, args.superlink, rc, insecure=insecure, flwr_home=flwr_home,
                            root_certificates=None if insecure else args.root_certificates,
                            watch=ended, watch_interval=1.0, on_output=note, stream_to=output,
                            done=lambda: read_json(result_file) is not None)
    except (FlowerDeployError, KeyboardInterrupt) as exc:
        run_id = seen.get("run")
        stopped = run_id is not None and flwr_stop(int(run_id), flwr_home)
        if isinstance(exc, KeyboardInterrupt):
            how = ("stopped at the SuperLink (its coordinator saves the finished rounds; continue with "
                   "--resume)" if stopped else "not stopped at the SuperLink (see `flwr ls`)")
            logger.warning(f"medfl flower run: interrupted; run {int(run_id) if run_id else '(not started)'} {how}")
            raise
        code = 1
        if read_json(result_file) is None:
            logger.error(f"medfl flower run: {exc}" + ("; the run was stopped" if stopped else ""))
            return 1
    result = read_json(result_file)
    if output is not None and not failed():
        output.release()
    return _outcome(result, code)


def _outcome(result: dict[str, Any] | None, code: int | None) -> int:
    """Report the ServerApp's ``result`` (when the SuperLink runs on this machine it wrote one)
    in one line and return the exit code of ``medfl flower run``; without one, ``flwr run``'s ``code``."""
    if result is None:
        return int(code or 0)
    if result.get("refused"):   # the config or a method refused it before any run started, as `medfl run`
        logger.error(f"medfl: error: {result['refused']}")
        return 2
    if not result.get("ok"):
        logger.error(f"medfl flower run: the run failed: {result.get('error')}")
        return 1
    print(f"medfl flower run: results in {result['dir']}")
    return 0


def _launch_options(args: argparse.Namespace, insecure: bool) -> str:
    """The options of this ``medfl flower run`` that reach its SuperLink (``--superlink`` and
    TLS, the CA made absolute), which the run's resume hints repeat."""
    tls = ["--insecure"] if insecure else ["--root-certificates", str(Path(args.root_certificates).resolve())]
    return shlex.join(["--superlink", args.superlink, *tls])


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does (in the main
    thread only), so that whoever ends ``medfl flower run`` also stops its run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _flower_tracking(config: str, overrides: dict[str, Any] | None, names: list[str]) -> list[Any]:
    """``medfl flower run --tracking NAME``: the config's ``fl.tracking`` with each tracker
    added (checked here, before anything starts: an unknown name or a tracker whose package
    is missing is refused now, not in the coordinator), as the override the coordinator gets."""
    fl = load_bundle_config(config, overrides or {})
    add_tracking(fl, names)
    check_tracking(fl["tracking"])
    return fl["tracking"]


def add_parsers(sub: Any) -> None:
    """Add the ``medfl flower`` command and its subcommands to ``sub`` (the subparsers of ``medfl``)."""
    fp = sub.add_parser("flower", help="run methods across sites with Flower (SuperLink, sites, runs)",
                        description="The three steps of a Flower deployment; see docs/flower.md.")
    fsub = fp.add_subparsers(dest="flower_command", required=True)

    sp = fsub.add_parser("superlink", help="step 1: start the SuperLink (Fleet, Control and Runtime APIs on one port)",
                         description="Start Flower's SuperLink and, beside it, the SuperExec that starts each run's "
                                     "ServerApp; the SuperExec is started again whenever it exits (an HTTP 500 of a "
                                     "locked --database ends Flower's), the runs it started go on. Ctrl-C or SIGTERM "
                                     "ends both and the runs' ServerApps.")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    sp.add_argument("--port", type=int, default=9092, help="port of the SuperLink's APIs (default 9092)")
    sp.add_argument("--database", default=None, help="SQLite file for the SuperLink's state (default: in memory)")
    sp.add_argument("--insecure", action="store_true", help="no TLS (one machine, or a trusted network)")
    for option in ("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"):
        sp.add_argument(option)
    sp.add_argument("--enable-supernode-auth", action="store_true",
                    help="accept only SuperNodes whose public key was registered (`medfl flower register-site`); "
                         "needs TLS")
    sp.set_defaults(func=cmd_flower_superlink)

    sp = fsub.add_parser("certs", help="write a CA and a SuperLink certificate (trying TLS out; use your PKI "
                                       "in production)")
    sp.add_argument("--out", required=True, help="folder for ca.pem, ca.key, server.pem, server.key (new files only)")
    sp.add_argument("--host", action="append", required=True,
                    help="name or IP address the sites use for the SuperLink (repeat for several)")
    sp.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    sp.set_defaults(func=cmd_flower_certs)

    sp = fsub.add_parser("keys", help="write a SuperNode key pair per site name (<name>.key stays at the site, "
                                      "<name>.pub is registered at the SuperLink)")
    sp.add_argument("names", nargs="+", help="one name per key pair, e.g. site0 site1")
    sp.add_argument("--out", required=True, help="folder for the key files (new files only)")
    sp.set_defaults(func=cmd_flower_keys)

    sp = fsub.add_parser("register-site", help="register site public keys at a SuperLink started with "
                                               "--enable-supernode-auth; prints each node id")
    sp.add_argument("public_keys", nargs="+", help="<name>.pub files from `medfl flower keys`")
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--insecure", action="store_true", help="no TLS (refused by a SuperLink with authentication)")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--name", default=None, help="a name the SuperLink lists the node under")
    sp.add_argument("--client-id", default=None,
                    help="the client this site serves: recorded with its node id in --nodes-file, so that no "
                         "other node may serve it (`medfl flower run --site-nodes`)")
    sp.add_argument("--nodes-file", default=None, help="the sites.json to record --client-id in (created if absent)")
    sp.set_defaults(func=cmd_flower_register_site)
    _add_site_parser(fsub)
    _add_run_parser(fsub)


def _add_site_parser(fsub: Any) -> None:
    """Add ``medfl flower site`` to ``fsub`` (the subparsers of ``medfl flower``)."""
    sp = fsub.add_parser("site", help="step 2: start one site's SuperNode (serves one client id with its data)")
    sp.add_argument("--client-id", required=True, help="the client of the partition this site serves (0, 1, ...)")
    sp.add_argument("--config", required=True, help="bundle config: where this site's data is and how the "
                                                    "partition is drawn (same split settings as the run)")
    sp.add_argument("--state-dir", required=True, help="where this site keeps its persistent client state")
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--host", default="127.0.0.1", help="address of this SuperNode's ClientApp runtime API")
    sp.add_argument("--port", type=int, default=9094, help="port of that API; one per site on a machine")
    sp.add_argument("--device", default=None, help="torch device of this site (default: the config's)")
    sp.add_argument("--insecure", action="store_true", help="no TLS")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--auth-key", default=None,
                    help="this site's private key (`medfl flower keys`), for a SuperLink started with "
                         "--enable-supernode-auth; its public key must be registered there")
    sp.add_argument("--approvals", default=None,
                    help="approvals file (`medfl approve`): run only the methods it approves, with the same "
                         "version and code hash; without it, or with 'none', the site runs any installed method "
                         "(and warns)")
    sp.add_argument("--no-restart", action="store_true",
                    help="end the site when its SuperNode exits (default: start it again with a growing wait, "
                         "1 s to 60 s, so a SuperLink restart or an outage never ends the site)")
    sp.add_argument("overrides", nargs=argparse.REMAINDER,
                    help="config overrides after the options, as for `medfl run`: any '#' path of the bundle "
                         "config (fl#dataset#root=/data bundle_root=/x; key=value first, then also --key value)")
    add_threads_option(sp)
    sp.set_defaults(func=cmd_flower_site)


def _add_run_parser(fsub: Any) -> None:
    """Add ``medfl flower run`` to ``fsub`` (the subparsers of ``medfl flower``)."""
    sp = fsub.add_parser("run", help="step 3: run a bundle config's experiment over the federation (flwr run)")
    sp.add_argument("config", nargs="?", help="bundle config file, read on the SuperLink's machine")
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value or key=value overrides")
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--resume", default=None, help="continue a stopped Flower run directory instead")
    sp.add_argument("--rounds", type=int, default=None, help="with --resume: a new total number of rounds")
    sp.add_argument("--round-timeout", type=float, default=600.0,
                    help="seconds a site has to answer one exchange before it is left out (default 600)")
    sp.add_argument("--connect-timeout", type=float, default=300.0,
                    help="seconds to wait for every site at the start (default 300)")
    sp.add_argument("--hello-timeout", type=float, default=60.0,
                    help="seconds to wait for a site that (re)joins mid-run (default 60)")
    sp.add_argument("--progress-interval", type=float, default=15.0,
                    help="while waiting for the sites at the start, say every so many seconds which clients "
                         "have no site yet (default 15)")
    sp.add_argument("--max-reply-mb", type=float, default=None,
                    help="the largest answer (MiB) taken from a site; a larger one is refused like a bad reply "
                         "(default: four times what the method sends, plus 64 MiB)")
    sp.add_argument("--result-file", default=None, help="where the ServerApp writes its result (JSON)")
    sp.add_argument("--exit-grace", type=float, default=120.0,
                    help="once the ServerApp wrote its result (SuperLink on this machine), seconds to wait for the "
                         "run to end at the SuperLink before it is stopped there (default 120)")
    sp.add_argument("--site-nodes", default=None,
                    help="sites.json from `medfl flower register-site --client-id`: each client is served only "
                         "by the node registered for it (with SuperNode authentication, by the site's key)")
    sp.add_argument("--insecure", action="store_true", help="no TLS")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--debug", action="store_true",
                    help="when the run fails, show the ServerApp's traceback too (Flower's report of it, in the "
                         "run's output); without it the failure is one line")
    add_threads_option(sp)
    add_tracking_option(sp)   # only the coordinator tracks (docs/flower.md)
    sp.set_defaults(func=cmd_flower_run)
