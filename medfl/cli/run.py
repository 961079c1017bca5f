"""``medfl run``, ``resume``, ``report``, ``runs``, ``export`` and ``bundles``: run a bundle
config's experiment, continue a stopped one, print a run's tables and plots again, list the runs
under a folder, write a finished run's models as MONAI bundles, list the bundles medfl ships and
copy one to edit; and the options shared with ``medfl flower`` (config overrides, ``--threads``,
``--tracking``)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from medfl.bundle import load_bundle_config, parse_override_value, run
from medfl.config import THREADS_ENV, check_threads, set_threads
from medfl.plugins import registry
from medfl.report import format_table, print_result, summary_table
from medfl.report_plots import write_experiment_plots, write_plots
from medfl.runs import DEFAULT_DEPTH, format_runs, list_runs, missing_folder, runs_csv, runs_json
from medfl.shipped import BundleError, bundles_dir, format_bundles, init_bundle, list_bundles

__all__ = ["add_parsers", "add_runs_parser", "cmd_run", "cmd_resume", "cmd_report", "cmd_runs", "parse_overrides",
           "add_threads_option", "apply_threads", "add_tracking_option", "add_tracking", "add_export_parser",
           "add_bundles_parser", "cmd_export", "cmd_bundles"]

logger = logging.getLogger(__name__)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """A command's config overrides, ``--fl#rounds 3`` or ``fl#rounds=3``, as ``{"fl#rounds": 3}``.

    Raises:
        SystemExit: an override without a value, or one in neither form.
    """
    out: dict[str, Any] = {}
    rest = iter(items)
    for item in rest:
        if "=" in item:   # --key=value or key=value
            key, value = item.removeprefix("--").split("=", 1)
        elif item.startswith("--"):
            key, value = item[2:], next(rest, None)
            if value is None:
                raise SystemExit(f"medfl: override {item} has no value")
        else:
            raise SystemExit(f"medfl: cannot read override {item!r}; use --fl#rounds 3 or fl#rounds=3")
        out[key] = parse_override_value(value)
    return out


def add_threads_option(sp: argparse.ArgumentParser) -> None:
    """Give the command ``sp`` (``medfl run``, ``resume``, ``flower site``, ``flower run``) the
    ``--threads N|auto`` option (see :func:`apply_threads`)."""
    sp.add_argument("--threads", default=None, metavar="N|auto",
                    help="torch threads of each process that trains: a number, or auto (the default: the cores "
                         "this process may use divided among the processes training on them; Ray actors, sites "
                         "medfl started together, pytest-xdist workers); wins over the config's fl#threads")


def apply_threads(args: argparse.Namespace) -> None:
    """Check ``--threads`` and put it in ``MEDFL_THREADS``, where every process of this command
    reads it (:func:`medfl.config.threads_setting`: before ``fl.threads``; a site's worker and
    Ray actors get the number it gives). Absent: nothing changes."""
    value = getattr(args, "threads", None)
    if value is not None:
        os.environ[THREADS_ENV] = str(check_threads(value, "--threads"))


def add_tracking_option(sp: argparse.ArgumentParser) -> None:
    """Give the command ``sp`` the repeatable ``--tracking NAME`` option (see :func:`add_tracking`)."""
    sp.add_argument("--tracking", action="append", default=None, metavar="NAME",
                    help="track the experiment with this tracker too (repeatable): mlflow (an embedded SQLite "
                         "store in the experiment directory unless fl#tracking gives a uri), tensorboard, or one a "
                         "plugin registered (`medfl plugins`); needs pip install \"medfl[tracking]\"")


def add_tracking(fl: dict[str, Any], names: list[str] | None) -> None:
    """``--tracking NAME``: add each tracker to the config's ``fl.tracking`` (one the config
    names already keeps its options)."""
    if not names:
        return
    entries = fl.get("tracking") or []
    entries = [entries] if isinstance(entries, (str, dict)) else list(entries)
    have = {e if isinstance(e, str) else e.get("name") for e in entries if isinstance(e, (str, dict))}
    fl["tracking"] = entries + [{"name": n} for n in dict.fromkeys(names) if n not in have]


def cmd_run(args: argparse.Namespace) -> int:
    """Run a bundle config's experiment."""
    fl = load_bundle_config(args.config, parse_overrides(args.overrides))
    apply_threads(args)
    if getattr(args, "backend", None):   # keeps the config's backend resources
        backend = fl.get("backend")
        fl["backend"] = {**backend, "name": args.backend} if isinstance(backend, dict) else args.backend
    add_tracking(fl, getattr(args, "tracking", None))
    run(fl, exit_on_error=False)  # main() reports medfl's errors
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a stopped run."""
    from medfl.experiment import resume   # the engine: not loaded for `medfl --help`

    apply_threads(args)
    set_threads(None)   # --threads, else "auto"; a number in the saved fl.threads wins over "auto" (resume)
    print_result(resume(args.run_dir, rounds=args.rounds, tracking=args.tracking))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Print a run's summary table and (re)write its plots (an experiment's too)."""
    path = Path(args.run_dir)
    if missing_folder(path):
        logger.error(f"medfl: {missing_folder(path)}")
        return 2
    is_run = (path / "metrics.csv").is_file()
    run_dirs = [path] if is_run else sorted(
        p.parent for p in path.rglob("metrics.csv"))  # experiments, and their seed_<s>/ or fold_<k>/
    if not run_dirs:
        logger.error(f"medfl: {path}: no metrics.csv here or in its subdirectories")
        return 2
    for table in ("seeds_table.md", "cv_table.md"):
        if (path / table).is_file():
            print(f"\n== {path / table}")
            print((path / table).read_text())
    for run_dir in run_dirs:
        print(f"\n== {run_dir}")
        print(format_table(summary_table(run_dir)))
        for p in write_plots(run_dir):
            print(f"wrote {p}")
    if not is_run:
        for p in write_experiment_plots(path):
            print(f"wrote {p}")
    return 0


def add_parsers(sub: Any) -> None:
    """Add the ``medfl run``, ``resume`` and ``report`` commands to ``sub`` (the subparsers of ``medfl``)."""
    sp = sub.add_parser("run", help="run a bundle config (e.g. bundles/demo/configs/train.json)",
                        description="Run the experiment in a bundle config's 'fl' section. Overrides use "
                                    "MONAI's '#' paths: --fl#rounds 3  --fl#methods#0#name fedprox  fl#seed=1")
    sp.add_argument("config", help="bundle config file (JSON or YAML)")
    sp.add_argument("--backend", default=None,
                    help="where the clients run: one after another in this process (inprocess, the default), in "
                         "parallel on Flower's simulation runtime (ray; the config's fl#backend sets its resources, "
                         "e.g. {\"name\": \"ray\", \"client_cpus\": 1, \"client_gpus\": 0.5}) or a backend a "
                         "plugin registered (`medfl plugins` lists them); same as --fl#backend ray")
    add_threads_option(sp)
    add_tracking_option(sp)
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value or key=value overrides")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("resume", help="continue a stopped run or experiment directory")
    sp.add_argument("run_dir")
    sp.add_argument("--rounds", type=int, default=None, help="new total number of rounds (default: as configured)")
    add_threads_option(sp)
    add_tracking_option(sp)
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("report", help="print the summary table of a run (or of every run of an experiment) "
                                       "and draw its plots again (runs with \"plots\": false or "
                                       "MEDFL_NO_PLOTS drew none)")
    sp.add_argument("run_dir", help="a run directory, or an experiment's (its comparison, seeds and CV "
                                    "figures are drawn too)")
    sp.set_defaults(func=cmd_report)


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs under a folder as one table (or JSON / CSV), oldest first; say on stderr
    how many folders at ``--depth`` were not searched further, and the commands that reach them."""
    if args.depth < 0:
        logger.error(f"medfl: error: --depth: expected how many folders deep to look (0: DIR itself), got {args.depth}")
        return 2
    unsearched: list[Path] = []
    try:
        rows = list_runs(args.dir, depth=args.depth, unsearched=unsearched)
    except NotADirectoryError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    if unsearched:   # never silent: runs there would be missing from the list
        logger.warning(f"medfl runs: {len(unsearched)} folder(s) {args.depth} level(s) below {args.dir} have subfolders "
                       f"that were not searched (e.g. {unsearched[0]}); to list runs there: medfl runs "
                       f"{shlex.quote(str(args.dir))} --depth {args.depth + DEFAULT_DEPTH}, or medfl runs "
                       f"{shlex.quote(str(unsearched[0]))}")
    if args.json:
        print(runs_json(rows))
    elif args.csv:
        print(runs_csv(rows), end="")
    elif not rows:
        print(f"medfl runs: no runs under {args.dir} (looked {args.depth} folder level(s) deep; --depth looks "
              "deeper)")
    else:
        print(format_runs(rows))
    return 0


def add_runs_parser(sub: Any) -> None:
    """Add the ``medfl runs`` command to ``sub`` (the subparsers of ``medfl``)."""
    sp = sub.add_parser("runs", help="list the runs under a folder: status, method, rounds, headline metric, "
                                     "epsilon, last modified",
                        description="List every run under DIR (searched recursively: experiments, their folds and "
                                    "seeds, each method's run), oldest first: status (finished, running (locked), "
                                    "stopped, interrupted, failed, failed to start, crashed, or corrupt: <why>), method, "
                                    "rounds done/"
                                    "planned, the headline metric (the run's own: fl.early_stopping's metric, else "
                                    "fl.cv.metric under cross-validation, else accuracy; on local_test where "
                                    "evaluated; the value's column is named by it) of the final "
                                    "round (early stopping's best round) or, before the end, of the last round, the "
                                    "epsilon spent by the worst client ('-' without differential privacy) and when "
                                    "the run last wrote a file.")
    sp.add_argument("dir", nargs="?", default=".", help="folder to search (default: the current one)")
    fmt = sp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    fmt.add_argument("--csv", action="store_true", help="print the rows as CSV")
    sp.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                    help=f"how many folders deep to look for runs (default {DEFAULT_DEPTH}); stderr says how many "
                         "folders at that depth have subfolders left unsearched")
    sp.set_defaults(func=cmd_runs)


def cmd_export(args: argparse.Namespace) -> int:
    """Export a finished run's models as MONAI bundles and print what was written."""
    from medfl.export import export_run   # torch: not loaded for `medfl --help`

    registry()
    summary = export_run(args.run_dir, args.out, args.license)
    for b in summary["bundles"]:
        ts = b["torchscript"] or "no TorchScript (see its metadata.json)"
        print(f"{Path(args.out) / b['folder']}: {b['model']} ({b['network']}; model.ts: {ts})")
    for s in summary["not_exported"]:
        print(f"not exported: {s['model']}: {s['reason']}")
    return 0


def add_export_parser(sub: Any) -> None:
    """Add the ``medfl export`` command to ``sub`` (the subparsers of ``medfl``)."""
    sp = sub.add_parser(
        "export", help="write a finished run's models as MONAI bundles (model.pt, model.ts, inference.json)",
        description="Write the final global model of a finished method run, and each client's personalised model "
                    "where the method has one, as MONAI bundles under OUT: OUT/global, OUT/final_<name>, "
                    "OUT/client_<id>, each with models/model.pt (a state dict in MONAI's key names), models/model.ts "
                    "(TorchScript), configs/inference.json (MONAI transforms and a MONAI or TorchScript network: "
                    "runs without medfl), configs/metadata.json, configs/logging.conf, LICENSE and docs/README.md; "
                    "OUT/export.json lists them and every model left out, with the reason. Infer with: python -m "
                    "monai.bundle run --config_file OUT/global/configs/inference.json --bundle_root OUT/global "
                    "[--dataset_dir DIR] [--split test]")
    sp.add_argument("run_dir", help="a finished method run directory (e.g. runs/demo/fedavg)")
    sp.add_argument("--out", required=True, help="folder to write; must not exist or be empty (nothing is overwritten)")
    sp.add_argument("--license", metavar="FILE", default=None,
                    help="licence text written as each bundle's LICENSE (default: medfl's, Apache-2.0); the "
                         "training data's terms may restrict the model further")
    sp.set_defaults(func=cmd_export)


def cmd_bundles(args: argparse.Namespace) -> int:
    """``medfl bundles``: list the shipped bundles; ``medfl bundles init NAME DIR``: copy one."""
    try:
        if args.bundles_command != "init":
            print(format_bundles(list_bundles(), bundles_dir()))
            return 0
        out = init_bundle(args.name, args.dir)
    except BundleError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    where = shlex.quote(str(out))
    print(f"copied bundle {args.name!r} to {out} ({sum(1 for f in out.rglob('*') if f.is_file())} files)\n"
          f"run it:       medfl run {shlex.quote(str(out / 'configs' / 'train.json'))} --bundle_root {where}\n"
          f"what it does: {out / 'docs' / 'README.md'} (its commands are written from medfl's repository root: "
          f"read bundles/{args.name} as {where}, and python data_prep/<dataset>.py as "
          "python -m medfl.prep.<dataset>)")
    return 0


def add_bundles_parser(sub: Any) -> None:
    """Add the ``medfl bundles`` command (and ``bundles init``) to ``sub`` (the subparsers of ``medfl``)."""
    sp = sub.add_parser("bundles", help="list the bundles medfl ships; bundles init NAME DIR copies one to edit",
                        description="Without a subcommand: every bundle medfl ships (its name and what it runs) "
                                    "and the folder they are installed in. `medfl bundles init NAME DIR` copies "
                                    "one into DIR (new or empty) to edit and run: medfl run DIR/configs/train.json "
                                    "--bundle_root DIR.")
    sp.set_defaults(func=cmd_bundles, bundles_command=None)
    bsub = sp.add_subparsers(dest="bundles_command")
    ip = bsub.add_parser("init", help="copy a shipped bundle into a new or empty folder to edit",
                         description="Copy bundle NAME (configs, docs, LICENSE, models/README.md) into DIR, which "
                                     "must not exist or be empty: nothing is overwritten.")
    ip.add_argument("name", metavar="NAME", help="a bundle `medfl bundles` lists, e.g. demo")
    ip.add_argument("dir", metavar="DIR", help="the folder to copy it into (new or empty)")

