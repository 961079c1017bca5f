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
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *rel]))
    assert not found - listed, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert not listed - found, f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
