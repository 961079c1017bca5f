"""The bundles medfl ships beside its code: where they are, what each is, a copy to edit.

An installed medfl (its wheel) holds the repository's ``bundles/<name>/`` folders as
``medfl/bundles/<name>/`` and its ``data_prep/<dataset>.py`` scripts as ``medfl/data_prep/``:
pyproject.toml maps the two folders into the package as package data, so the installed files
are the repository's own. In a checkout (an editable install) they are the repository's
folders beside ``medfl/``. ``medfl bundles`` lists the bundles (:func:`list_bundles`) and
``medfl bundles init NAME DIR`` copies one to edit (:func:`init_bundle`).

A bundle's configs name every path from the top-level keys ``bundle_root`` (default ``.``,
the folder the command runs in), ``dataset_dir`` and ``output_dir``, so a copy runs where it
lies: ``medfl run DIR/configs/train.json --bundle_root DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["BundleError", "BundleInfo", "bundles_dir", "list_bundles", "find_bundle", "init_bundle",
           "format_bundles", "COPY_LEFT_OUT"]

#: What a bundle folder may hold that is not the bundle and is never copied: the data and
#: runs its commands write into it (top level only; git ignores them too) and Python's caches.
COPY_LEFT_OUT = ("data", "runs")


class BundleError(ValueError):
    """A bundle name that is not shipped, a destination that is not a new or empty folder,
    or a shipped bundle whose metadata cannot be read; the message names it and what was
    expected."""


@dataclass(frozen=True)
class BundleInfo:
    """One shipped bundle.

    Attributes:
        name: its folder's name (``demo``, ``ham10000_fedsdc``...).
        title: one line saying what it runs: its ``configs/metadata.json`` ``name`` (less a
            leading ``medfl``), else its ``docs/README.md`` title, else empty.
        path: its folder.
    """

    name: str
    title: str
    path: Path


def bundles_dir() -> Path:
    """The folder holding the shipped bundles: ``medfl/bundles`` in an installed medfl, the
    repository's ``bundles/`` in a checkout.

    Raises:
        BundleError: neither exists (an installation built without its package data).
    """
    package = Path(__file__).resolve().parent
    candidates = (package / "bundles", package.parent / "bundles")
    for folder in candidates:
        if any(folder.glob("*/configs/train.json")):
            return folder
    raise BundleError(f"no bundles found in {candidates[0]} (an installed medfl) nor in {candidates[1]} (a "
                      "checkout); expected bundle folders holding configs/train.json: reinstall medfl from its "
                      "wheel or a checkout")


def _title(bundle: Path) -> str:
    """The one-line description of :class:`BundleInfo`."""
    meta = bundle / "configs" / "metadata.json"
    if meta.is_file():
        try:
            doc = json.loads(meta.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BundleError(f"{meta}: not readable JSON ({exc}); expected the bundle's MONAI metadata") from exc
        name = doc.get("name") if isinstance(doc, dict) else None
        if isinstance(name, str) and name.strip():
            return name.strip().removeprefix("medfl ").strip()
    readme = bundle / "docs" / "README.md"
    if readme.is_file():
        for line in readme.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                return line[2:].strip().removeprefix("medfl ").strip()
    return ""


def list_bundles(folder: Path | None = None) -> list[BundleInfo]:
    """Every bundle under ``folder`` (default :func:`bundles_dir`): each subfolder holding
    ``configs/train.json``, sorted by name.

    Raises:
        BundleError: as :func:`bundles_dir`, or a bundle's ``metadata.json`` is not JSON.
    """
    root = bundles_dir() if folder is None else folder
    return [BundleInfo(p.parent.parent.name, _title(p.parent.parent), p.parent.parent)
            for p in sorted(root.glob("*/configs/train.json"))]


def find_bundle(name: str, folder: Path | None = None) -> BundleInfo:
    """The shipped bundle called ``name``.

    Raises:
        BundleError: no such bundle (the message lists the shipped ones).
    """
    found = list_bundles(folder)
    for info in found:
        if info.name == name:
            return info
    raise BundleError(f"unknown bundle {name!r}; expected one of: {', '.join(b.name for b in found)} "
                      "(medfl bundles lists them)")


def _left_out(root: Path) -> Callable[[str, list[str]], set[str]]:
    """A :func:`shutil.copytree` ``ignore`` leaving out :data:`COPY_LEFT_OUT` at the top of
    ``root`` and Python caches anywhere."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
        if Path(directory) == root:
            skip |= {n for n in names if n in COPY_LEFT_OUT}
        return skip
    return ignore


def init_bundle(name: str, dest: str | Path, folder: Path | None = None) -> Path:
    """Copy the shipped bundle ``name`` into ``dest`` to edit: every file of the bundle
    (configs, docs, LICENSE, models/README.md), none of the data or runs a checkout's copy
    may hold (:data:`COPY_LEFT_OUT`); every copied file and folder writable by its owner,
    whatever the installed files' modes.

    Args:
        name: a shipped bundle (:func:`list_bundles`).
        dest: a folder that does not exist yet, or an empty one; its parents are made.
        folder: where the bundles are (default :func:`bundles_dir`).

    Returns:
        ``dest``.

    Raises:
        BundleError: an unknown ``name`` (naming the shipped ones), or ``dest`` is a file or
            a folder that is not empty (nothing is copied: a copy never overwrites).
    """
    info = find_bundle(name, folder)
    out = Path(dest)
    if out.exists() and not out.is_dir():
        raise BundleError(f"{out}: exists and is not a folder; expected a new or empty folder to copy bundle "
                          f"{name!r} into")
    if out.is_dir() and any(out.iterdir()):
        raise BundleError(f"{out}: not empty; expected a new or empty folder to copy bundle {name!r} into "
                          "(a copy never overwrites files): name another folder or empty this one")
    shutil.copytree(info.path, out, ignore=_left_out(info.path), copy_function=shutil.copyfile,
                    dirs_exist_ok=True)
    for here, dirs, files in os.walk(out):
        for entry in [here, *(os.path.join(here, f) for f in files)]:
            mode = os.stat(entry).st_mode
            os.chmod(entry, mode | stat.S_IWUSR | (stat.S_IXUSR if entry == here else 0))
    return out


def format_bundles(bundles: list[BundleInfo], folder: Path) -> str:
    """The table ``medfl bundles`` prints: a line naming ``folder``, then one line per
    bundle (name, title), then how to copy one."""
    width = max((len(b.name) for b in bundles), default=0)
    lines = [f"{len(bundles)} bundle(s) in {folder}:"]
    lines += [f"  {b.name:<{width}}  {b.title}".rstrip() for b in bundles]
    lines.append("medfl bundles init NAME DIR copies one to edit and run; its docs/README.md says what it "
                 "trains on and how to try it")
    return "\n".join(lines)
