"""Run a bundle README's "Try it on fixture data" commands as written (the tests of the
bundles import it: tests/test_bundle_readmes.py, and the end-to-end bundle tests that train
a bundle once, through its README)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "readme_commands", "repository_like", "run_as_written", "default_split_fits", "run_readme"]

REPO = Path(__file__).resolve().parents[1]


def readme_commands(bundle: str) -> list[str]:
    """The commands of the README's first section, "Try it on fixture data" (its fenced
    ``bash`` block, one command a line; blank and comment lines left out)."""
    text = (REPO / "bundles" / bundle / "docs" / "README.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)
    assert len(sections) > 1 and sections[1].startswith("Try it on fixture data\n"), \
        f"bundles/{bundle}/docs/README.md does not open with '## Try it on fixture data'"
    block = re.search(r"^```bash\n(.*?)^```", sections[1], re.S | re.M)
    assert block, f"bundles/{bundle}/docs/README.md: no ```bash block under 'Try it on fixture data'"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def repository_like(root: Path, bundle: str) -> Path:
    """``root`` laid out as the repository root for ``bundle``'s commands, without writing into
    the repository: ``bundles/<bundle>/configs`` and ``data_prep`` link to the repository's, and
    ``bundles/<bundle>/data`` and ``runs`` are written in ``root``."""
    (root / "bundles" / bundle).mkdir(parents=True)
    (root / "bundles" / bundle / "configs").symlink_to(REPO / "bundles" / bundle / "configs")
    (root / "data_prep").symlink_to(REPO / "data_prep")
    return root


def run_as_written(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One README line through the shell, in ``cwd``, with this interpreter as ``python``;
    fails the test with the end of its output when it fails."""
    env = {**os.environ, "MEDFL_NO_PROGRESS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def default_split_fits(root: Path, bundle: str) -> None:
    """The bundle's shipped defaults (``train.json`` alone: every client, fold and seed of
    them) split the fixture its README prepared in ``root`` with every client trainable:
    no partitioner refuses it and :func:`medfl.experiment.check_split_sizes` passes."""
    from medfl.bundle import load_bundle_config
    from medfl.config import resolve_config
    from medfl.engine.data import split_data
    from medfl.engine.runner import build_source
    from medfl.experiment import check_split_sizes
    from medfl.plugins import pinned_names

    fl = load_bundle_config(REPO / "bundles" / bundle / "configs" / "train.json",
                            {"bundle_root": str(root / "bundles" / bundle),
                             "dataset_dir": str(root / "bundles" / bundle / "data" / "try")})
    cfg = resolve_config(fl)
    with pinned_names(cfg.get("plugin_names")):
        plain = not (int((cfg.get("cv") or {}).get("folds") or 0) > 1 or cfg.get("seeds"))
        check_split_sizes(cfg, split_data(build_source(cfg["dataset"]), cfg) if plain else None)


def run_readme(bundle: str, root: Path) -> tuple[list[subprocess.CompletedProcess[str]], Path]:
    """Every command of ``bundle``'s README block, in ``root`` laid out as the repository root;
    returns the processes and the results folder the run printed (``results: PATH``, a path
    from ``root``), checked to be under ``bundles/<bundle>/runs``. Before the run, the
    prepared fixture is checked against the bundle's defaults (:func:`default_split_fits`)."""
    repository_like(root, bundle)
    commands = readme_commands(bundle)
    procs = [run_as_written(line, root) for line in commands[:-1]]
    if procs:   # a fixture was written and prepared (the demo makes its own data)
        default_split_fits(root, bundle)
    procs.append(run_as_written(commands[-1], root))
    printed = re.findall(r"^results: (.+)$", procs[-1].stdout, re.M)
    assert printed, procs[-1].stdout[-2000:]
    results = root / printed[-1]
    assert results.is_dir(), f"results: {printed[-1]} is not a folder under {root}"
    assert results.resolve().is_relative_to((root / "bundles" / bundle / "runs").resolve())
    return procs, results
