"""Glue between MONAI bundle configs and the engine.

A bundle's ``configs/train.json`` holds the experiment in its ``fl`` section and runs it with
``"run": "$medfl.bundle.run(@fl)"``, so ``python -m monai.bundle run --config_file
bundles/<name>/configs/train.json --fl#rounds 3`` works like ``medfl run``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from medfl.config import resolve_config

__all__ = ["run", "print_result", "infer", "load_bundle_config", "parse_override_value"]


def run(fl: dict[str, Any]) -> dict[str, Any]:
    """Resolve and run the ``fl`` section of a bundle config; print where results went."""
    from medfl.engine.runner import run_experiment

    cfg = resolve_config(fl)
    result = run_experiment(cfg)
    print_result(result)
    return result


def print_result(result: dict[str, Any]) -> None:
    """Print each method's summary table (or, cross-validated, the CV table) and where the
    results are; a stopped run gets the command that continues it."""
    from medfl.report import format_table, summary_table

    base = Path(result["dir"])
    if "folds" in result:  # cross-validation: the table of mean ± std over folds
        if result.get("cv"):
            print(f"\n== {result['folds']}-fold cross-validation ({base / 'cv_table.md'})")
            print((base / "cv_table.md").read_text())
        else:
            print(f"\n== cross-validation stopped before every fold finished; continue with "
                  f"`medfl resume {base}`")
        print(f"\nresults: {base}")
        return
    for label, summary in result["summaries"].items():
        run_dir = base if (base / "metrics.csv").is_file() else base / label
        if summary:
            print(f"\n== {label} ({run_dir})")
            print(format_table(summary_table(run_dir)))
        else:
            print(f"\n== {label}: stopped early; continue with `medfl resume {run_dir}`")
    print(f"\nresults: {base}")


def infer(run_dir: str | Path, dataset: dict[str, Any] | None = None, output: str | Path | None = None,
          clients: list[str] | None = None, split: str | None = None) -> Path:
    """A bundle's ``inference.json`` entry point: predict with a finished run's client
    models (see :func:`medfl.engine.runner.predict`) and print where the CSV went."""
    from medfl.engine.runner import predict
    from medfl.plugins import registry

    registry()
    path = predict(run_dir, dataset, output, clients, split)
    print(f"predictions: {path}")
    return path


def parse_override_value(text: str) -> Any:
    """Parse a command-line value: JSON, else a Python literal, else the string itself."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text


def load_bundle_config(config_file: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a bundle config with MONAI's ConfigParser, apply ``#``-path overrides, and return
    the parsed ``fl`` section (references such as ``@bundle_root`` resolved).

    Raises:
        FileNotFoundError: the config file does not exist.
        KeyError: the config has no ``fl`` section.
    """
    from monai.bundle import ConfigParser

    path = Path(config_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config file not found")
    parser = ConfigParser()
    parser.read_config(str(path))
    for key, value in (overrides or {}).items():
        parser[key] = value
    if "fl" not in parser.get():
        raise KeyError(f"{path}: no 'fl' section; a medfl bundle config keeps the experiment under 'fl'")
    return parser.get_parsed_content("fl")
