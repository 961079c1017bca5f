"""``medfl export`` and ``medfl bundles``: write a finished run's models as MONAI bundles;
list the bundles medfl ships and copy one to edit."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path
from typing import Any

from medfl.plugins import registry
from medfl.shipped import BundleError, bundles_dir, format_bundles, init_bundle, list_bundles

__all__ = ["add_export_parser", "add_bundles_parser", "cmd_export", "cmd_bundles"]

logger = logging.getLogger(__name__)


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

