"""The data_prep packages medfl.prep.abide and medfl.prep.mias: their modules import each
other one way and stay short, every public name is importable from the package; and for
every dataset ``python -m medfl.prep.<name>`` is the command line of ``data_prep/<name>.py``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Per package, each module and the modules of the same package it may import (``__init__``
#: and ``__main__`` are above them all).
MAY_IMPORT = {
    "abide": {
        "volumes": set(),
        "phenotypic": set(),
        "layout": {"phenotypic"},
        "atlas": {"volumes"},
        "cli": {"volumes", "phenotypic", "layout", "atlas"},
    },
    "mias": {
        "info": set(),
        "pgm": set(),
        "cli": {"info", "pgm"},
    },
}
#: The first line of each script's description (its --help), for every data_prep/<name>.py.
SUMMARY = {
    "abide": "ABIDE-I Preprocessed (PCP) as downloaded -> a medfl manifest",
    "mias": "mini-MIAS as downloaded -> a medfl manifest of mammograms",
    "ham10000": "HAM10000 as downloaded -> a medfl manifest of seven-class dermoscopy images",
    "cbis_ddsm": "CBIS-DDSM as downloaded -> an image-level benign/malignant manifest",
    "derm7pt": "Derm7pt (release_v0) as downloaded -> a medfl manifest of five-class dermoscopy images",
    "medmnist": "MedMNIST v2 (and MedMNIST+) ``.npz`` files as downloaded -> a medfl manifest",
}


def _package_imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            found.add(node.module.removeprefix(package).lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix(package + ".") for a in node.names
                      if a.name.startswith(package + ".")}
    return found


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_modules_import_one_way(name: str) -> None:
    folder = REPO / "medfl" / "prep" / name
    rules = MAY_IMPORT[name]
    assert {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"} == set(rules)
    for module, allowed in rules.items():
        imported = _package_imports(folder / f"{module}.py", f"medfl.prep.{name}")
        assert imported <= allowed, f"{name}/{module}.py imports {sorted(imported - allowed)}"
        assert len((folder / f"{module}.py").read_text().splitlines()) <= 500, module


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_public_names_come_from_the_package(name: str) -> None:
    package = importlib.import_module(f"medfl.prep.{name}")
    for attr in package.__all__:
        obj = getattr(package, attr)
        module = getattr(obj, "__module__", None)
        if module is not None and callable(obj):
            assert module.startswith(f"medfl.prep.{name}."), (attr, module)


def test_every_data_prep_script_has_its_summary() -> None:
    assert {p.stem for p in (REPO / "data_prep").glob("*.py")} == set(SUMMARY)


@pytest.mark.parametrize("name", sorted(SUMMARY))
def test_python_m_is_the_data_prep_script(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m medfl.prep.<name> --help`` prints the script's usage under the name that
    works in a checkout and in an installed medfl alike (the single-module scripts printed
    nothing and exited 0 before they ran their ``main``)."""
    monkeypatch.setenv("COLUMNS", "100")        # the width argparse wraps the help to, both sides
    proc = subprocess.run([sys.executable, "-m", f"medfl.prep.{name}", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == importlib.import_module(f"medfl.prep.{name}").build_parser().format_help()
    assert proc.stdout.startswith(f"usage: python -m medfl.prep.{name}")
    assert SUMMARY[name] in proc.stdout
