"""Every package of the source tree is in pyproject.toml's package list: setuptools builds a
wheel from that list alone, so a folder left out (a module split into a package, as
``medfl.guard`` and ``medfl.data.partition`` were) would be missing from an installed medfl
while every test of an editable install still passes."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_wheel() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for name, folder in setup["package-dir"].items():
        if not (ROOT / folder / "__init__.py").is_file():   # a folder installed as data (test below)
            found.add(name)
            continue
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *rel]))
    assert not found - listed, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert not listed - found, f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"


def test_data_folders_are_package_data() -> None:
    """bundles/ and data_prep/ are installed as medfl/bundles/ and medfl/data_prep/ (a folder
    mapped in package-dir without an ``__init__.py``): each is listed, and bundles/ ships its
    files by name patterns (tests/test_wheel.py checks the wheel holds every one of them)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = {name: folder for name, folder in setup["package-dir"].items()
            if not (ROOT / folder / "__init__.py").is_file()}
    assert data == {"medfl.bundles": "bundles", "medfl.data_prep": "data_prep"}
    assert set(data) <= set(setup["packages"])
    assert setup["package-data"]["medfl.bundles"] and setup["include-package-data"] is False
