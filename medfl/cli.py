"""The ``medfl`` command line: plugins, run, resume, report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser"]


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    from medfl.bundle import parse_override_value

    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            key = item[2:]
            if "=" in key:
                key, value = key.split("=", 1)
            else:
                if i + 1 >= len(items):
                    raise SystemExit(f"medfl: override {item} has no value")
                value = items[i + 1]
                i += 1
        elif "=" in item:
            key, value = item.split("=", 1)
        else:
            raise SystemExit(f"medfl: cannot read override {item!r}; use --fl#rounds 3 or fl#rounds=3")
        out[key] = parse_override_value(value)
        i += 1
    return out


def cmd_plugins(args: argparse.Namespace) -> int:
    """List every plugin and what it registered."""
    from medfl.plugins import plugin_info, registry

    if args.json:
        print(json.dumps(plugin_info(), indent=2))
        return 0
    for kind, table in registry().items():
        print(f"{kind}s:")
        for name, reg in sorted(table.items()):
            doc = getattr(reg.obj, "description", "") or (getattr(reg.obj, "__doc__", "") or "").strip().split("\n")[0]
            print(f"  {name:<16} {reg.distribution} ({reg.plugin})  {doc}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a bundle config's experiment."""
    from medfl.bundle import load_bundle_config, run

    fl = load_bundle_config(args.config, _parse_overrides(args.overrides))
    run(fl)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a stopped run."""
    from medfl.bundle import print_result
    from medfl.engine.runner import resume

    print_result(resume(args.run_dir, rounds=args.rounds))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Print a run's summary table and (re)write its plots."""
    from medfl.report import format_table, summary_table, write_plots

    path = Path(args.run_dir)
    run_dirs = [path] if (path / "metrics.csv").is_file() else sorted(
        p.parent for p in path.glob("*/metrics.csv"))
    if not run_dirs:
        print(f"medfl: {path}: no metrics.csv here or in its subdirectories", file=sys.stderr)
        return 2
    for run_dir in run_dirs:
        print(f"\n== {run_dir}")
        print(format_table(summary_table(run_dir)))
        for p in write_plots(run_dir):
            print(f"wrote {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``medfl``."""
    p = argparse.ArgumentParser(prog="medfl", description="Federated learning for medical imaging (MONAI + PyTorch).")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("plugins", help="list registered methods, models, partitioners, datasets, metrics")
    sp.add_argument("--json", action="store_true", help="print every plugin as JSON (name, version, hooks, registered)")
    sp.set_defaults(func=cmd_plugins)
    sp = sub.add_parser("run", help="run a bundle config (e.g. bundles/demo/configs/train.json)",
                        description="Run the experiment in a bundle config's 'fl' section. Overrides use "
                                    "MONAI's '#' paths: --fl#rounds 3  --fl#methods#0#name fedprox  fl#seed=1")
    sp.add_argument("config", help="bundle config file (JSON or YAML)")
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value or key=value overrides")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("resume", help="continue a stopped run or experiment directory")
    sp.add_argument("run_dir")
    sp.add_argument("--rounds", type=int, default=None, help="new total number of rounds (default: as configured)")
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("report", help="print the summary table of a run and write its plots")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``medfl`` command."""
    from medfl.config import ConfigError
    from medfl.data.source import DataError
    from medfl.engine.runner import RunError
    from medfl.plugins import PluginError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, PluginError, RunError, DataError, FileNotFoundError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"medfl: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
