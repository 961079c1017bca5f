"""Where a download keeps the derivative maps and the phenotypic CSV: PCP's ``Outputs/`` layout
(one folder per derivative) and nilearn's flat ``ABIDE_pcp/`` layout, told apart by
:func:`find_layout`.

Imports :mod:`medfl.prep.abide.phenotypic` (the CSV's name) only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from medfl.prep.abide.phenotypic import PHENOTYPIC_FILE
from medfl.prep.errors import PrepError

__all__ = ["PIPELINES", "STRATEGIES", "DERIVATIVES", "FEDSKD_DERIVATIVES", "MAP_SUFFIXES", "DerivativeLayout",
           "find_phenotypic", "find_layout"]

PIPELINES = ("cpac", "ccs", "dparsf", "niak")
STRATEGIES = ("filt_global", "filt_noglobal", "nofilt_global", "nofilt_noglobal")
#: 3D derivative maps PCP publishes per subject (``func_preproc`` is 4D and not accepted).
DERIVATIVES = ("alff", "degree_binarize", "degree_weighted", "eigenvector_binarize",
               "eigenvector_weighted", "falff", "func_mask", "func_mean", "lfcd", "reho", "vmhc")
#: FedSKD's four channels (ReHo, DC, LFCD, VMHC), in channel order.
FEDSKD_DERIVATIVES = ("reho", "degree_weighted", "lfcd", "vmhc")


def find_phenotypic(raw: Path, given: str | Path | None = None,
                    layout: DerivativeLayout | None = None) -> Path:
    """The phenotypic CSV: ``given``, else next to the derivatives in either layout.

    Raises:
        PrepError: ``given`` does not exist, or none was found (names where it looked).
    """
    if given is not None:
        p = Path(given)
        if not p.is_file():
            raise PrepError(f"--phenotypic {p}: file not found", p)
        return p
    looked = [raw / PHENOTYPIC_FILE, raw / "ABIDE_pcp" / PHENOTYPIC_FILE, raw.parent / PHENOTYPIC_FILE]
    if layout is not None:
        # <root>/Outputs/<pipeline>/<strategy> or <root>/<pipeline>/<strategy>
        looked += [parent / PHENOTYPIC_FILE for parent in list(layout.root.parents)[1:3]]
    for p in dict.fromkeys(looked):
        if p.is_file():
            return p
    raise PrepError(f"{raw}: no {PHENOTYPIC_FILE} found; looked at "
                    + ", ".join(str(p) for p in dict.fromkeys(looked))
                    + "; pass --phenotypic PATH", raw)


@dataclass
class DerivativeLayout:
    """Where one pipeline/strategy's derivative maps are.

    ``kind`` is ``pcp`` (``root/<derivative>/<FILE_ID>_<derivative>.nii.gz``) or
    ``nilearn`` (``root/<FILE_ID>_<derivative>.nii.gz``); ``root`` is the
    ``<pipeline>/<strategy>`` folder.
    """

    kind: str
    root: Path

    def path(self, file_id: str, derivative: str) -> Path:
        """The file of ``derivative`` for ``file_id``: ``<FILE_ID>_<derivative>.nii.gz``, or
        the same name ending ``.nii`` where only that exists (a copy gunzipped after download,
        :data:`MAP_SUFFIXES`); else the name something else bears (a folder, a link), else the
        ``.nii.gz`` name."""
        folder = self.root / derivative if self.kind == "pcp" else self.root
        names = [folder / f"{file_id}_{derivative}{suffix}" for suffix in MAP_SUFFIXES]
        return next((p for p in names if p.is_file()), None) or next(
            (p for p in names if os.path.lexists(p)), names[0])


#: The endings of a derivative map: PCP publishes ``.nii.gz``; a download tool, a browser or
#: ``gunzip -r`` leaves ``.nii``. Both are read (``.nii.gz`` first where both exist).
MAP_SUFFIXES = (".nii.gz", ".nii")


def _has_pcp(root: Path, derivatives: Sequence[str]) -> bool:
    return root.is_dir() and any((root / d).is_dir() for d in derivatives)


def _has_flat(root: Path, derivatives: Sequence[str]) -> bool:
    return root.is_dir() and any(next(root.glob(f"*_{d}{suffix}"), None) is not None
                                 for d in derivatives for suffix in MAP_SUFFIXES)


def find_layout(raw: Path, pipeline: str, strategy: str, derivatives: Sequence[str],
                layout: str = "auto") -> DerivativeLayout:
    """Find the ``<pipeline>/<strategy>`` derivative folder under ``raw`` in either layout.

    Raises:
        PrepError: nothing found (the message lists the pipelines/strategies that exist), or
            both layouts found with ``layout="auto"``.
    """
    if layout not in ("auto", "pcp", "nilearn"):
        raise PrepError(f"--layout: unknown {layout!r}; valid: auto, pcp, nilearn")
    found: list[DerivativeLayout] = []
    if layout in ("auto", "pcp"):
        for base in (raw / "Outputs", raw, raw / "ABIDE_Initiative" / "Outputs"):
            root = base / pipeline / strategy
            if _has_pcp(root, derivatives):
                found.append(DerivativeLayout("pcp", root))
                break
    if layout in ("auto", "nilearn"):
        for base in (raw / "ABIDE_pcp", raw):
            root = base / pipeline / strategy
            if _has_flat(root, derivatives):
                found.append(DerivativeLayout("nilearn", root))
                break
    if len(found) > 1:
        raise PrepError(f"{raw}: both layouts are present ({found[0].root} with one folder per "
                        f"derivative, {found[1].root} flat); pass --layout pcp or --layout nilearn", raw)
    if found:
        return found[0]
    existing = []
    for base in (raw / "Outputs", raw / "ABIDE_pcp", raw):
        for p in sorted(base.glob("*/*")) if base.is_dir() else []:
            if p.is_dir() and p.parent.name in PIPELINES:
                existing.append(str(p.relative_to(raw)))
    expected = (f"Outputs/{pipeline}/{strategy}/<derivative>/<FILE_ID>_<derivative>.nii.gz or .nii (PCP) "
                f"or [ABIDE_pcp/]{pipeline}/{strategy}/<FILE_ID>_<derivative>.nii.gz or .nii (nilearn)")
    raise PrepError(f"{raw}: no derivative maps ({', '.join(derivatives)}) for pipeline {pipeline!r} "
                    f"and strategy {strategy!r}; expected {expected}; found "
                    + (", ".join(sorted(set(existing))) or "no <pipeline>/<strategy> folder")
                    + ". Choose with --pipeline/--strategy/--derivatives", raw)
