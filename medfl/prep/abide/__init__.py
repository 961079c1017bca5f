"""ABIDE-I Preprocessed (PCP) as downloaded -> a medfl manifest of 4-channel 3D derivative maps.

Two download layouts are accepted (``--layout auto`` tells them apart)::

    # PCP's S3 bucket (ABIDE_Initiative/), e.g. with aws s3 sync or the PCP download script
    <raw>/Phenotypic_V1_0b_preprocessed1.csv
    <raw>/Outputs/<cpac|ccs|dparsf|niak>/<filt|nofilt>_<global|noglobal>/<derivative>/<FILE_ID>_<derivative>.nii.gz

    # nilearn.datasets.fetch_abide_pcp(data_dir=<raw>) (flat: no derivative folder)
    <raw>/ABIDE_pcp/Phenotypic_V1_0b_preprocessed1.csv
    <raw>/ABIDE_pcp/<pipeline>/<strategy>/<FILE_ID>_<derivative>.nii.gz

``--raw`` may also point at ``Outputs/``'s parent's ``ABIDE_pcp`` folder itself, or at
``Outputs``; ``--phenotypic`` names the CSV when it lives elsewhere.

What this module does, and why:

* The phenotypic CSV is parsed as it is: its first two header cells are ``""`` and
  ``Unnamed: 0`` (an index column written twice by pandas), some quoted fields hold commas
  (rater notes), ``-9999`` or an empty field means missing. ``DX_GROUP`` 1 = autism
  (label 1), 2 = control (label 0); ``SEX`` 1 = male (``M``), 2 = female (``F``). An unknown
  ``DX_GROUP``/``SEX``/``SITE_ID`` value is an error naming the row.
* Rows with ``FILE_ID == no_filename`` (77 in the real file) have no derivatives and are
  excluded, as nilearn does. Quality control (``--qc nilearn``, the default) keeps the rows
  nilearn's ``fetch_abide_pcp(quality_checked=True)`` keeps: ``qc_rater_1`` OK,
  ``qc_anat_rater_2`` and ``qc_func_rater_2`` OK or maybe, ``qc_anat_rater_3`` and
  ``qc_func_rater_3`` OK. On the real file this leaves 871 subjects (403 autism, 468
  control), exactly the FedSKD cohort (Table I). ``--max-mean-fd`` additionally drops
  subjects whose mean framewise displacement (``func_mean_fd``, mm) is above a threshold
  (or unknown). Exclusions are listed in ``excluded.csv``; they are choices, not errors.
* The four FedSKD derivatives (``reho``, ``degree_weighted``, ``lfcd``, ``vmhc``; DC also
  exists as ``degree_binarize``) are stacked as channels in that order: arrays are float32
  ``(4, 61, 73, 61)`` in NIfTI voxel order (i, j, k), non-finite voxels set to 0.
* Every volume's shape and affine are checked against the PCP grid (61 x 73 x 61, 3 mm,
  :data:`GRID_AFFINE`). A different grid is an error unless ``--resample linear|nearest``
  asks for explicit resampling (``scipy.ndimage``; exact slicing when the grids differ by
  whole voxels); resampled samples are flagged in the manifest.
* ``SITE_ID`` (20 values) -> the 17 sites of FedSKD's Table I (``LEUVEN_1/2``, ``UCLA_1/2``
  and ``UM_1/2`` merged) -> its four regional clients (:data:`REGIONS`), written as the
  ``region`` column for the ``natural`` partitioner; ``site`` is the Table I site and
  ``site_id`` the original value.
* ABIDE has no official split. Subjects get a ``fold`` (``--folds``, default 5, as the
  paper's 5-fold cross-validation), stratified by site and label and seeded; the fold
  ``--test-fold`` (default 0) is the ``test`` split, the rest ``train``. Each subject is one
  sample, so no subject is in two splits.
* ``--size 48`` resizes to 48^3 as in the paper (``--aspect stretch`` by default, as the
  paper's "downscaled to 48 x 48 x 48"; ``pad``/``crop`` keep the aspect ratio).
* Atlas preparation (``--atlas``) writes ``atlas/atlas.nii.gz`` (labels on the 61 x 73 x 61
  grid), ``atlas/atlas_labels.csv`` and, with ``--size``, the atlas resized like the data
  (nearest neighbour). ``cc200``/``cc400``: PCP's ``CC200.nii.gz``/``CC400.nii.gz`` are on a
  63 x 75 x 61 grid and are cropped ``[1:62, 1:74, :]`` (all labels kept); ``rois_3mm``:
  the Dosenbach-160 volume, already on the grid, minus its stray label 223; ``power264``:
  5 mm spheres around the Power-264 coordinates (nilearn's bundled ``power_2011.csv`` or
  ``--atlas-coords``); ``file``: any label NIfTI, resampled onto the grid by nearest
  neighbour. ``auto`` takes ``--atlas-file`` if given, else a ``CC200.nii.gz`` found under
  ``--raw``, else the Power-264 spheres when the coordinates are available, else none.
  :func:`load_atlas` / :func:`atlas_for_manifest` read it back as a label array.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from medfl.prep.common import (
    PrepError, PrepReport, base_parser, check_dirs, progress, require_columns, save_array,
    write_manifest, staged_main, NotDownloaded, keep_present,
)

__all__ = [
    "GRID_SHAPE", "GRID_AFFINE", "PHENOTYPIC_FILE", "PIPELINES", "STRATEGIES", "DERIVATIVES",
    "FEDSKD_DERIVATIVES", "CLASS_NAMES", "SITES", "REGIONS", "REGION_ORDER", "NILEARN_QC",
    "ATLASES", "RESIZE_ASPECTS", "RESAMPLE_MODES", "Subject", "DerivativeLayout", "is_missing",
    "read_phenotypic", "select_rows", "parse_subject", "assign_folds", "find_phenotypic",
    "find_layout", "load_volume", "load_derivative", "same_grid", "resample_to_grid",
    "resize_volume", "crop_cc_atlas", "rois_3mm_atlas", "read_coordinates", "sphere_atlas",
    "label_atlas", "check_label_volume", "atlas_table", "prepare_atlas", "write_atlas", "load_atlas",
    "atlas_for_manifest", "build_parser", "main",
]

#: The PCP derivative grid: shape and affine (3 mm MNI, LAS-oriented voxels).
GRID_SHAPE: tuple[int, int, int] = (61, 73, 61)
GRID_AFFINE: np.ndarray = np.array([[-3.0, 0.0, 0.0, 90.0],
                                    [0.0, 3.0, 0.0, -126.0],
                                    [0.0, 0.0, 3.0, -72.0],
                                    [0.0, 0.0, 0.0, 1.0]])
#: The phenotypic file's name in both layouts.
PHENOTYPIC_FILE = "Phenotypic_V1_0b_preprocessed1.csv"
PIPELINES = ("cpac", "ccs", "dparsf", "niak")
STRATEGIES = ("filt_global", "filt_noglobal", "nofilt_global", "nofilt_noglobal")
#: 3D derivative maps PCP publishes per subject (``func_preproc`` is 4D and not accepted).
DERIVATIVES = ("alff", "degree_binarize", "degree_weighted", "eigenvector_binarize",
               "eigenvector_weighted", "falff", "func_mask", "func_mean", "lfcd", "reho", "vmhc")
#: FedSKD's four channels (ReHo, DC, LFCD, VMHC), in channel order.
FEDSKD_DERIVATIVES = ("reho", "degree_weighted", "lfcd", "vmhc")
#: Label order: label = position (1 = autism is the positive class).
CLASS_NAMES = ("control", "autism")
_DX = {1: 1, 2: 0}          # DX_GROUP -> label
_SEX = {1: "M", 2: "F"}     # SEX -> manifest code
_MISSING = {"", "-9999", "-9999.0", "-9999.00"}

#: ``SITE_ID`` (the 20 values of the phenotypic file) -> site of FedSKD's Table I (17).
SITES: dict[str, str] = {
    "CALTECH": "CALTECH", "CMU": "CMU", "KKI": "KKI", "LEUVEN_1": "LEUVEN", "LEUVEN_2": "LEUVEN",
    "MAX_MUN": "MAX_MUN", "NYU": "NYU", "OHSU": "OHSU", "OLIN": "OLIN", "PITT": "PITT",
    "SBL": "SBL", "SDSU": "SDSU", "STANFORD": "STANFORD", "TRINITY": "TRINITY",
    "UCLA_1": "UCLA", "UCLA_2": "UCLA", "UM_1": "UM", "UM_2": "UM", "USM": "USM", "YALE": "YALE",
}
#: Table I site -> regional client (FedSKD: client 1 Europe, 2 West USA, 3 Middle USA, 4 East USA).
REGIONS: dict[str, str] = {
    "LEUVEN": "EUROPE", "MAX_MUN": "EUROPE", "TRINITY": "EUROPE", "SBL": "EUROPE",
    "UCLA": "WEST_USA", "USM": "WEST_USA", "SDSU": "WEST_USA", "STANFORD": "WEST_USA",
    "OHSU": "WEST_USA", "CALTECH": "WEST_USA",
    "UM": "MIDDLE_USA", "PITT": "MIDDLE_USA", "CMU": "MIDDLE_USA",
    "NYU": "EAST_USA", "YALE": "EAST_USA", "KKI": "EAST_USA", "OLIN": "EAST_USA",
}
#: Regions in the order of Table I (``region_client`` = position + 1).
REGION_ORDER = ("EUROPE", "WEST_USA", "MIDDLE_USA", "EAST_USA")
#: Rater columns and accepted values of nilearn's ``fetch_abide_pcp(quality_checked=True)``.
NILEARN_QC: dict[str, tuple[str, ...]] = {
    "qc_rater_1": ("OK",), "qc_anat_rater_2": ("OK", "maybe"), "qc_func_rater_2": ("OK", "maybe"),
    "qc_anat_rater_3": ("OK",), "qc_func_rater_3": ("OK",),
}
ATLASES = ("auto", "cc200", "cc400", "rois_3mm", "power264", "file", "none")
RESIZE_ASPECTS = ("stretch", "pad", "crop")
RESAMPLE_MODES = ("error", "linear", "nearest")
_REQUIRED = ("SUB_ID", "SITE_ID", "FILE_ID", "DX_GROUP")
#: Atlas files as PCP names them (abide/preprocessing/resources/abide_rois/).
_ATLAS_FILES = {"cc200": "CC200.nii.gz", "cc400": "CC400.nii.gz", "rois_3mm": "rois_3mm.nii.gz"}
#: PCP's CC200/CC400 grid and the crop that lands it on :data:`GRID_SHAPE`.
_CC_SHAPE = (63, 75, 61)
_CC_CROP = (slice(1, 62), slice(1, 74), slice(0, 61))
_ROIS_3MM_LABELS = 160
#: A FILE_ID is used in file names: letters, digits, ``_``, ``-`` (never a path).
_FILE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _fmt_affine(a: np.ndarray) -> str:
    rows = np.asarray(a, dtype=float)[:3]
    return "[" + ", ".join("[" + ", ".join(f"{v:g}" for v in r) + "]" for r in rows) + "]"


_GRID_TEXT = f"{GRID_SHAPE[0]}x{GRID_SHAPE[1]}x{GRID_SHAPE[2]} with affine {_fmt_affine(GRID_AFFINE)}"


# --------------------------------------------------------------------------- phenotypic file

def is_missing(value: Any) -> bool:
    """Whether a phenotypic field is missing (empty, ``-9999`` or NaN)."""
    if value is None:
        return True
    if isinstance(value, float) and np.isnan(value):
        return True
    return str(value).strip() in _MISSING


def read_phenotypic(path: str | Path) -> pd.DataFrame:
    """Read the phenotypic CSV as strings, quirks included.

    Every field stays a (whitespace-stripped) string, so ``-9999`` and empty fields can be
    told apart from values; a ``_line`` column gives each row's line in the file (header = 1).

    Raises:
        PrepError: the file is missing, unreadable, has no rows, or lacks one of
            ``SUB_ID``, ``SITE_ID``, ``FILE_ID``, ``DX_GROUP``.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: phenotypic CSV not found; expected {PHENOTYPIC_FILE} as "
                        "downloaded with the derivatives", path)
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise PrepError(f"{path}: cannot parse the phenotypic CSV ({type(exc).__name__}: "
                        f"{str(exc).strip()}); expected the comma-separated {PHENOTYPIC_FILE}",
                        path) from exc
    table.columns = [str(c).strip() for c in table.columns]
    require_columns(table, _REQUIRED, path)
    if table.empty:
        raise PrepError(f"{path}: the phenotypic CSV has a header but no rows", path)
    table = table.apply(lambda col: col.str.strip())
    table["_line"] = np.arange(len(table)) + 2
    return table


def _row_item(path: Path, row: pd.Series) -> str:
    return f"{path.name} line {row['_line']} (SUB_ID {row['SUB_ID'] or '?'})"


def _int_field(row: pd.Series, column: str, path: Path) -> int | None:
    value = row[column]
    if is_missing(value):
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not np.isfinite(number) or number != int(number):
        raise PrepError(f"{_row_item(path, row)}: field {column} = {value!r} is not an integer",
                        _row_item(path, row))
    return int(number)


def _float_field(row: pd.Series, column: str, path: Path) -> float | None:
    if column not in row.index or is_missing(row[column]):
        return None
    try:
        number = float(row[column])
    except ValueError:
        number = float("nan")
    if not np.isfinite(number):
        raise PrepError(f"{_row_item(path, row)}: field {column} = {row[column]!r} is not a number",
                        _row_item(path, row))
    return number


@dataclass
class Subject:
    """One phenotypic row, parsed: who, where, which class."""

    sub_id: int
    file_id: str
    site_id: str
    site: str
    region: str
    label: int
    dx_group: int
    sex: str
    age: float | None
    mean_fd: float | None
    line: int

    @property
    def class_name(self) -> str:
        """``control`` or ``autism``."""
        return CLASS_NAMES[self.label]


def parse_subject(row: pd.Series, path: str | Path) -> Subject:
    """Parse one phenotypic row into a :class:`Subject`.

    Raises:
        PrepError: naming the row and field: a missing or non-integer ``SUB_ID``, an
            unknown ``SITE_ID``, a ``DX_GROUP`` other than 1/2, a ``SEX`` other than 1/2
            (missing is allowed), a non-numeric ``AGE_AT_SCAN`` or ``func_mean_fd``.
    """
    path = Path(path)
    item = _row_item(path, row)
    sub_id = _int_field(row, "SUB_ID", path)
    if sub_id is None:
        raise PrepError(f"{item}: field SUB_ID is empty; expected the subject number", item)
    site_id = row["SITE_ID"].upper()
    if site_id not in SITES:
        raise PrepError(f"{item}: field SITE_ID = {row['SITE_ID']!r} is not an ABIDE-I site; "
                        f"expected one of {', '.join(sorted(SITES))}", item)
    try:
        dx = _int_field(row, "DX_GROUP", path)
    except PrepError:
        dx = -1
    if dx not in _DX:
        raise PrepError(f"{item}: field DX_GROUP = {row['DX_GROUP']!r} is not a known diagnosis; "
                        "expected 1 (autism) or 2 (control)", item)
    sex = ""
    if "SEX" in row.index:
        try:
            code = _int_field(row, "SEX", path)
        except PrepError:
            code = -1
        if code is not None and code not in _SEX:
            raise PrepError(f"{item}: field SEX = {row['SEX']!r} is not a known sex code; "
                            "expected 1 (male), 2 (female), -9999 or empty", item)
        sex = _SEX.get(code, "") if code is not None else ""
    file_id = row["FILE_ID"]
    if not _FILE_ID.fullmatch(file_id):
        raise PrepError(f"{item}: field FILE_ID = {file_id!r} is not a PCP file id; expected letters, "
                        "digits and underscores such as Pitt_0050003", item)
    site = SITES[site_id]
    return Subject(sub_id=sub_id, file_id=file_id, site_id=site_id, site=site,
                   region=REGIONS[site], label=_DX[dx], dx_group=int(dx), sex=sex,
                   age=_float_field(row, "AGE_AT_SCAN", path),
                   mean_fd=_float_field(row, "func_mean_fd", path), line=int(row["_line"]))


def select_rows(table: pd.DataFrame, qc: str = "nilearn", max_mean_fd: float | None = None,
                path: str | Path = PHENOTYPIC_FILE) -> tuple[pd.DataFrame, list[dict[str, str]]]:
    """Drop the rows without derivatives and, optionally, those failing quality control.

    Args:
        table: from :func:`read_phenotypic`.
        qc: ``nilearn`` (the rater checks of :data:`NILEARN_QC`) or ``none``.
        max_mean_fd: drop subjects whose ``func_mean_fd`` is above this (mm) or unknown.
        path: the CSV, for messages.

    Returns:
        The kept rows, and one ``{sub_id, file_id, site_id, line, rule, reason}`` per
        excluded row (``rule``: ``no_filename``, ``qc`` or ``mean_fd``).

    Raises:
        PrepError: a column the chosen filters need is missing, or ``qc`` is unknown.
    """
    if qc not in ("nilearn", "none"):
        raise PrepError(f"--qc: unknown {qc!r}; valid: nilearn, none")
    excluded: list[dict[str, str]] = []
    keep = np.ones(len(table), dtype=bool)

    def drop(mask: np.ndarray, rule: str, reasons: Sequence[str]) -> None:
        for i in np.flatnonzero(mask & keep):
            r = table.iloc[i]
            excluded.append({"sub_id": r["SUB_ID"], "file_id": r["FILE_ID"], "site_id": r["SITE_ID"],
                             "line": str(r["_line"]), "rule": rule, "reason": reasons[i]})
        keep[mask] = False

    no_file = (table["FILE_ID"] == "no_filename") | table["FILE_ID"].map(is_missing)
    drop(no_file.to_numpy(), "no_filename", ["no derivatives (FILE_ID no_filename)"] * len(table))
    if qc == "nilearn":
        require_columns(table, list(NILEARN_QC), path)
        reasons = [""] * len(table)
        failed = np.zeros(len(table), dtype=bool)
        for column, ok in NILEARN_QC.items():
            bad = ~table[column].isin(ok).to_numpy()
            for i in np.flatnonzero(bad):
                value = table[column].iloc[i] or "empty"
                reasons[i] += ("; " if reasons[i] else "quality control: ") + f"{column} = {value}"
            failed |= bad
        drop(failed, "qc", reasons)
    if max_mean_fd is not None:
        require_columns(table, ["func_mean_fd"], path)
        fd = pd.to_numeric(table["func_mean_fd"].where(~table["func_mean_fd"].map(is_missing)),
                           errors="coerce").to_numpy(dtype=float)
        over = ~(fd <= max_mean_fd)
        drop(over, "mean_fd", [f"func_mean_fd = {table['func_mean_fd'].iloc[i] or 'empty'} "
                    f"{'unknown' if np.isnan(fd[i]) else '>'} threshold {max_mean_fd} mm"
                    for i in range(len(table))])
    return table[keep], excluded


def assign_folds(subjects: Sequence[Subject], n_folds: int, seed: int) -> list[int]:
    """Cross-validation folds stratified by site and label, seeded.

    Subjects are grouped by ``(site, label)``, shuffled within each group, the groups
    concatenated in sorted order, and folds dealt round-robin over the result: fold sizes
    differ by at most one and each site/label group is spread over the folds.
    """
    if n_folds < 1:
        raise PrepError(f"--folds: expected at least 1, got {n_folds}")
    rng = np.random.default_rng(seed)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(subjects):
        groups.setdefault((s.site, s.label), []).append(i)
    order: list[int] = []
    for key in sorted(groups):
        members = list(groups[key])
        rng.shuffle(members)
        order.extend(members)
    folds = [0] * len(subjects)
    for pos, i in enumerate(order):
        folds[i] = pos % n_folds
    return folds


# --------------------------------------------------------------------------- raw layout

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
        """The file of ``derivative`` for ``file_id``."""
        name = f"{file_id}_{derivative}.nii.gz"
        return self.root / derivative / name if self.kind == "pcp" else self.root / name


def _has_pcp(root: Path, derivatives: Sequence[str]) -> bool:
    return root.is_dir() and any((root / d).is_dir() for d in derivatives)


def _has_flat(root: Path, derivatives: Sequence[str]) -> bool:
    return root.is_dir() and any(next(root.glob(f"*_{d}.nii.gz"), None) is not None for d in derivatives)


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
    expected = (f"Outputs/{pipeline}/{strategy}/<derivative>/<FILE_ID>_<derivative>.nii.gz (PCP) "
                f"or [ABIDE_pcp/]{pipeline}/{strategy}/<FILE_ID>_<derivative>.nii.gz (nilearn)")
    raise PrepError(f"{raw}: no derivative maps ({', '.join(derivatives)}) for pipeline {pipeline!r} "
                    f"and strategy {strategy!r}; expected {expected}; found "
                    + (", ".join(sorted(set(existing))) or "no <pipeline>/<strategy> folder")
                    + ". Choose with --pipeline/--strategy/--derivatives", raw)


# --------------------------------------------------------------------------- volumes

def load_volume(path: str | Path, what: str = "NIfTI volume") -> tuple[np.ndarray, np.ndarray]:
    """Read a 3D NIfTI volume: ``(data, affine)``; a trailing axis of length 1 is dropped.

    Raises:
        PrepError: the file is missing, unreadable (corrupt or truncated), or not 3D.
    """
    import nibabel as nib

    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: file not found; expected the {what}", path)
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
        affine = np.asarray(img.affine, dtype=float)
    except Exception as exc:  # noqa: BLE001 - nibabel, gzip and zlib raise many types
        raise PrepError(f"{path}: cannot read the {what} ({type(exc).__name__}: {exc}); expected a "
                        "complete (gzipped) NIfTI-1 file - corrupt or truncated download?", path) from exc
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise PrepError(f"{path}: shape {tuple(data.shape)} is not a 3D volume; expected the "
                        f"{what} ({GRID_SHAPE[0]}x{GRID_SHAPE[1]}x{GRID_SHAPE[2]})", path)
    return data, affine


def same_grid(shape: Sequence[int], affine: np.ndarray, atol: float = 1e-3) -> bool:
    """Whether ``shape``/``affine`` is the PCP grid (:data:`GRID_SHAPE`, :data:`GRID_AFFINE`)."""
    return tuple(int(s) for s in shape) == GRID_SHAPE and np.allclose(affine, GRID_AFFINE, atol=atol)


def resample_to_grid(data: np.ndarray, affine: np.ndarray, order: int = 1,
                     shape: Sequence[int] = GRID_SHAPE, target: np.ndarray = GRID_AFFINE) -> np.ndarray:
    """Resample a volume given on ``affine`` onto ``shape``/``target`` (default: the PCP grid).

    ``order`` 0 is nearest neighbour (labels), 1 trilinear. Voxels outside the source are 0.
    When the two grids differ by a whole-voxel shift only, the result is exact slicing.

    Raises:
        PrepError: ``affine`` is singular.
    """
    try:
        vox = np.linalg.inv(np.asarray(affine, dtype=float)) @ np.asarray(target, dtype=float)
    except np.linalg.LinAlgError as exc:
        raise PrepError(f"the affine {_fmt_affine(affine)} is singular; cannot resample") from exc
    lin, off = vox[:3, :3], vox[:3, 3]
    shape = tuple(int(s) for s in shape)
    if np.allclose(lin, np.eye(3), atol=1e-6) and np.allclose(off, np.round(off), atol=1e-4):
        out = np.zeros(shape, dtype=data.dtype)
        o = np.round(off).astype(int)
        src = tuple(slice(max(0, o[a]), min(data.shape[a], o[a] + shape[a])) for a in range(3))
        dst = tuple(slice(s.start - o[a], s.stop - o[a]) for a, s in enumerate(src))
        if all(s.stop > s.start for s in src):
            out[dst] = data[src]
        return out
    from scipy.ndimage import affine_transform

    src_data = data.astype(np.float64 if order else data.dtype, copy=False)
    out = affine_transform(src_data, lin, offset=off, output_shape=shape, order=order,
                           mode="constant", cval=0.0, prefilter=False)
    return out.astype(data.dtype if order == 0 else np.float32)


def load_derivative(path: str | Path, resample: str = "error", what: str = "derivative map"
                    ) -> tuple[np.ndarray, bool, int]:
    """Read one derivative map on the PCP grid: ``(float32 volume, resampled, non-finite count)``.

    A volume on another grid is resampled (``resample`` ``linear`` or ``nearest``) or
    refused (``error``); non-finite voxels become 0.

    Raises:
        PrepError: missing/unreadable/not 3D (see :func:`load_volume`), another grid with
            ``resample="error"``, or a volume without any non-zero finite voxel.
    """
    if resample not in RESAMPLE_MODES:
        raise PrepError(f"--resample: unknown {resample!r}; valid: {', '.join(RESAMPLE_MODES)}")
    path = Path(path)
    data, affine = load_volume(path, what)
    resampled = False
    if not same_grid(data.shape, affine):
        if resample == "error":
            raise PrepError(f"{path}: grid {'x'.join(map(str, data.shape))} with affine "
                            f"{_fmt_affine(affine)} is not the ABIDE PCP grid; expected {_GRID_TEXT}. "
                            "Pass --resample linear to resample such files explicitly, or --skip-bad "
                            "to skip them", path)
        data = resample_to_grid(data.astype(np.float32), affine, order=1 if resample == "linear" else 0)
        resampled = True
    vol = np.asarray(data, dtype=np.float32)
    bad = ~np.isfinite(vol)
    n_bad = int(bad.sum())
    if n_bad:
        vol = np.where(bad, np.float32(0), vol)
    if not np.any(vol):
        raise PrepError(f"{path}: no non-zero finite voxel; expected a {what}", path)
    return vol, resampled, n_bad


def _index_map(n_old: int, n_new: int, aspect: str, scale: float) -> tuple[int, int, float, float]:
    """Per axis: (scaled size m, offset p, old-per-new a, b) with old = a * new + b."""
    if aspect == "stretch":
        m = n_new
    else:
        m = max(1, int(round(n_old * scale)))
    if aspect == "pad":
        p = (n_new - m) // 2
    elif aspect == "crop":
        p = -((m - n_new) // 2)
    else:
        p = 0
    a = n_old / m
    return m, p, a, (0.5 - p) * a - 0.5


def resize_volume(vol: np.ndarray, size: Sequence[int], aspect: str = "stretch", order: int = 1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Resize a 3D volume ``(X, Y, Z)`` or ``(C, X, Y, Z)`` to ``size``, aspect handled explicitly.

    ``stretch`` scales each axis to fit (FedSKD's 61x73x61 -> 48^3); ``pad`` scales all axes
    by the same factor so the volume fits and pads with zeros; ``crop`` scales so it covers
    and crops the centre. ``order`` 1: linear with anti-aliasing (maps); 0: nearest (labels).

    Returns:
        The resized volume (same dtype for ``order=0``, float32 otherwise) and the 4x4
        matrix that maps new voxel indices to old ones (new affine = old affine @ matrix).
    """
    from skimage.transform import resize

    if aspect not in RESIZE_ASPECTS:
        raise PrepError(f"--aspect: unknown {aspect!r}; valid: {', '.join(RESIZE_ASPECTS)}")
    chan = vol.ndim == 4
    x = vol if chan else vol[None]
    old = x.shape[1:]
    new = tuple(int(s) for s in size)
    if len(new) != 3 or min(new) < 1:
        raise PrepError(f"--size: expected 1 or 3 positive sizes, got {list(size)}")
    scale = (min if aspect == "pad" else max)(n / o for n, o in zip(new, old))
    geo = [_index_map(o, n, aspect, scale) for o, n in zip(old, new)]
    scaled = tuple(g[0] for g in geo)
    out_dtype = vol.dtype if order == 0 else np.float32
    result = np.zeros((x.shape[0],) + new, dtype=out_dtype)
    for c in range(x.shape[0]):
        y = resize(x[c], scaled, order=order, anti_aliasing=order > 0, preserve_range=True, mode="edge")
        y = np.rint(y).astype(out_dtype) if order == 0 else y.astype(np.float32)
        src, dst = [], []
        for (m, p, _, _), n in zip(geo, new):
            lo, hi = max(0, -p), min(m, n - p)
            src.append(slice(lo, hi))
            dst.append(slice(lo + p, hi + p))
        result[(c, *dst)] = y[tuple(src)]
    matrix = np.eye(4)
    for axis, (_, _, a, b) in enumerate(geo):
        matrix[axis, axis], matrix[axis, 3] = a, b
    return (result if chan else result[0]), matrix


# --------------------------------------------------------------------------- atlases

def check_label_volume(data: np.ndarray, path: str | Path) -> np.ndarray:
    """``data`` as int32 labels, after checking it is an atlas: finite, integer-valued, and
    piecewise constant (most voxels of a labelled region share their neighbour's label). A
    grey-matter probability map stored as 0..255 integers passes the first two tests and
    fails the third: its values change between most neighbouring voxels.

    Raises:
        PrepError: naming the file and which test failed.
    """
    values = np.asarray(data)
    if not np.all(np.isfinite(values)) or not np.allclose(values, np.round(values)):
        raise PrepError(f"{path}: not a label volume (non-integer values: a probability or intensity map?); "
                        "expected integer labels with 0 as background", path)
    ints = np.round(values).astype(np.int32)
    a, b = ints[:-1], ints[1:]
    inside = (a != 0) & (b != 0)
    if inside.sum() >= 100:
        same = float((a[inside] == b[inside]).mean())
        if same < 0.5:
            distinct = len(np.unique(ints)) - 1
            raise PrepError(f"{path}: not a label volume: neighbouring voxels share a value only {100 * same:.0f} % "
                            f"of the time ({distinct} distinct values); an atlas's regions are piecewise constant "
                            "(a probability or intensity map stored as integers?)", path)
    return ints


def crop_cc_atlas(data: np.ndarray, affine: np.ndarray, path: str | Path = "CC200.nii.gz"
                  ) -> tuple[np.ndarray, list[str]]:
    """Put PCP's CC200/CC400 label volume on the grid: crop ``[1:62, 1:74, :]``.

    A volume already on the grid is taken as is; any other grid is resampled by nearest
    neighbour (with a note).

    Returns:
        The int32 labels on :data:`GRID_SHAPE`, and notes (labels lost, resampling).
    """
    notes: list[str] = []
    data = check_label_volume(data, path)
    cropped_affine = affine.copy()
    cropped_affine[:3, 3] = affine[:3, :3] @ np.array([1, 1, 0]) + affine[:3, 3]
    if tuple(data.shape) == _CC_SHAPE and same_grid(GRID_SHAPE, cropped_affine):
        labels = np.asarray(data[_CC_CROP]).astype(np.int32)
    elif same_grid(data.shape, affine):
        labels = np.asarray(data).astype(np.int32)
    else:
        labels = resample_to_grid(np.asarray(data).astype(np.int32), affine, order=0)
        notes.append(f"{path}: grid {'x'.join(map(str, data.shape))} is neither PCP's 63x75x61 "
                     "CC atlas grid nor the data grid; resampled by nearest neighbour")
    lost = sorted(set(np.unique(data).tolist()) - set(np.unique(labels).tolist()))
    if lost:
        notes.append(f"{path}: labels {lost} fall outside the grid and were lost")
    return labels, notes


def rois_3mm_atlas(data: np.ndarray, affine: np.ndarray, path: str | Path = "rois_3mm.nii.gz"
                   ) -> tuple[np.ndarray, list[str]]:
    """The Dosenbach-160 ``rois_3mm`` volume on the grid, without labels above 160 (223)."""
    notes: list[str] = []
    labels = check_label_volume(data, path)
    if not same_grid(labels.shape, affine):
        labels = resample_to_grid(labels, affine, order=0)
        notes.append(f"{path}: not on the data grid; resampled by nearest neighbour")
    stray = sorted(int(v) for v in np.unique(labels) if v < 0 or v > _ROIS_3MM_LABELS)
    if stray:
        labels[np.isin(labels, stray)] = 0
        notes.append(f"{path}: dropped stray label(s) {stray} (Dosenbach has 1..{_ROIS_3MM_LABELS})")
    return labels, notes


def read_coordinates(path: str | Path) -> pd.DataFrame:
    """Read ROI centre coordinates (MNI mm): columns ``x, y, z`` (any case), optional
    ``ROI``/``number`` label and ``name``/``network`` (nilearn's ``power_2011.csv`` and
    ``dosenbach_2010.csv`` both work).

    Returns:
        Columns ``label``, ``name``, ``x``, ``y``, ``z`` (+ ``network`` when present).

    Raises:
        PrepError: the file is missing/unreadable or lacks x/y/z, or a coordinate is not a number.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: coordinate file not found; expected a CSV with x, y, z columns "
                        "(e.g. nilearn's power_2011.csv)", path)
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PrepError(f"{path}: cannot parse the coordinates ({exc})", path) from exc
    cols = {c.lower().strip(): c for c in table.columns}
    missing = [c for c in ("x", "y", "z") if c not in cols]
    if missing or table.empty:
        raise PrepError(f"{path}: missing column(s) {missing or 'rows'}; expected x, y, z (MNI mm); "
                        f"found {', '.join(map(str, table.columns))}", path)
    out = pd.DataFrame({k: pd.to_numeric(table[cols[k]], errors="coerce") for k in ("x", "y", "z")})
    if out.isna().any().any():
        row = int(out.isna().any(axis=1).to_numpy().argmax())
        raise PrepError(f"{path}: line {row + 2}: a coordinate is not a number", path)
    label_col = cols.get("roi") or cols.get("number") or cols.get("label")
    out.insert(0, "label", table[label_col].astype(int) if label_col else np.arange(1, len(table) + 1))
    out.insert(1, "name", table[cols["name"]].astype(str) if "name" in cols
               else [f"{path.stem}_{int(v):03d}" for v in out["label"]])
    if "network" in cols:
        out["network"] = table[cols["network"]].astype(str)
    if out["label"].duplicated().any() or (out["label"] < 1).any():
        raise PrepError(f"{path}: ROI labels must be unique positive integers", path)
    return out


def sphere_atlas(coords: pd.DataFrame, radius: float = 5.0, shape: Sequence[int] = GRID_SHAPE,
                 affine: np.ndarray = GRID_AFFINE) -> tuple[np.ndarray, pd.DataFrame]:
    """Label every voxel whose centre lies within ``radius`` mm of an ROI centre.

    A voxel within reach of two centres goes to the nearer one (``overlap_voxels`` counts
    them per ROI). Power-264 at 5 mm on the PCP grid: 16-24 voxels each, no overlap.

    Returns:
        int32 labels of ``shape``, and ``coords`` with ``voxels`` and ``overlap_voxels``.

    Raises:
        PrepError: a centre outside the grid, or a sphere with no voxel.
    """
    shape = tuple(int(s) for s in shape)
    labels = np.zeros(shape, dtype=np.int32)
    best = np.full(shape, np.inf)
    inv = np.linalg.inv(affine)
    reach = int(np.ceil(radius / np.min(np.abs(np.diag(affine)[:3])))) + 1
    overlap = np.zeros(len(coords), dtype=int)
    owner_row = {int(v): i for i, v in enumerate(coords["label"])}
    for i, r in enumerate(coords.itertuples(index=False)):
        centre = np.array([r.x, r.y, r.z], dtype=float)
        ijk = inv[:3, :3] @ centre + inv[:3, 3]
        if np.any(ijk < -0.5) or np.any(ijk > np.array(shape) - 0.5):
            raise PrepError(f"ROI {r.label} ({r.x}, {r.y}, {r.z}) lies outside the "
                            f"{'x'.join(map(str, shape))} grid")
        lo = np.maximum(np.floor(ijk).astype(int) - reach, 0)
        hi = np.minimum(np.ceil(ijk).astype(int) + reach + 1, shape)
        box = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"), -1)
        world = box @ affine[:3, :3].T + affine[:3, 3]
        dist = np.linalg.norm(world - centre, axis=-1)
        inside = dist <= radius + 1e-6
        sub = tuple(slice(a, b) for a, b in zip(lo, hi))
        taken = inside & (labels[sub] > 0)
        for other in np.unique(labels[sub][taken]):
            overlap[owner_row[int(other)]] += int(((labels[sub] == other) & taken).sum())
        overlap[i] += int(taken.sum())
        win = inside & (dist < best[sub])
        labels[sub][win] = int(r.label)
        best[sub][win] = dist[win]
    table = coords.copy()
    table["voxels"] = [int((labels == v).sum()) for v in table["label"]]
    table["overlap_voxels"] = overlap
    empty = table.loc[table["voxels"] == 0, "label"].tolist()
    if empty:
        raise PrepError(f"ROI(s) {empty}: no voxel centre within {radius} mm; use a larger --sphere-radius")
    return labels, table


def label_atlas(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """Any label NIfTI (3D, integer-valued) resampled onto the grid by nearest neighbour.

    Raises:
        PrepError: unreadable, not 3D, not integer-valued, or no label left on the grid.
    """
    data, affine = load_volume(path, "atlas label volume")
    ints = check_label_volume(data, path)
    notes: list[str] = []
    if same_grid(ints.shape, affine):
        labels = ints
    else:
        labels = resample_to_grid(ints, affine, order=0)
        notes.append(f"{path}: grid {'x'.join(map(str, ints.shape))} with affine {_fmt_affine(affine)} "
                     "resampled onto the data grid by nearest neighbour")
    lost = sorted(set(np.unique(ints).tolist()) - set(np.unique(labels).tolist()) - {0})
    if lost:
        notes.append(f"{path}: label(s) {lost} did not survive resampling onto the grid")
    if not np.any(labels > 0):
        raise PrepError(f"{path}: no positive label on the data grid after resampling", path)
    return labels, notes


def atlas_table(labels: np.ndarray, affine: np.ndarray = GRID_AFFINE, names: dict[int, str] | None = None,
                prefix: str = "region") -> pd.DataFrame:
    """One row per positive label: ``label, name, voxels, x, y, z`` (centroid, mm)."""
    values = [int(v) for v in np.unique(labels) if v > 0]
    rows = []
    for v in values:
        ijk = np.argwhere(labels == v).mean(axis=0)
        xyz = affine[:3, :3] @ ijk + affine[:3, 3]
        rows.append({"label": v, "name": (names or {}).get(v, f"{prefix}_{v:03d}"),
                     "voxels": int((labels == v).sum()), "x": round(float(xyz[0]), 2),
                     "y": round(float(xyz[1]), 2), "z": round(float(xyz[2]), 2)})
    return pd.DataFrame(rows, columns=["label", "name", "voxels", "x", "y", "z"])


def _find_named(raw: Path, name: str) -> Path | None:
    for base in (raw / "rois", raw, raw / "abide_rois", raw / "ABIDE_pcp",
                 raw / "resources" / "abide_rois"):
        if (base / name).is_file():
            return base / name
    return next((p for p in sorted(raw.rglob(name)) if p.is_file()), None)


def _bundled_power() -> Path | None:
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "power_2011.csv"
    return p if p.is_file() else None


def prepare_atlas(kind: str, raw: Path, atlas_file: str | Path | None = None,
                  coords: str | Path | None = None, radius: float = 5.0
                  ) -> tuple[str, np.ndarray, pd.DataFrame, str, list[str]] | None:
    """Build the atlas label volume on the grid.

    Args:
        kind: one of :data:`ATLASES`.
        raw: the download, searched for ``CC200.nii.gz``... when no ``atlas_file`` is given.
        atlas_file: the atlas NIfTI (``cc200``, ``cc400``, ``rois_3mm``, ``file``, ``auto``).
        coords: ROI centre CSV for ``power264`` (default: nilearn's bundled ``power_2011.csv``).
        radius: sphere radius in mm for ``power264``.

    Returns:
        ``(name, labels, table, source, notes)`` or ``None`` for ``none`` (or ``auto`` with
        nothing available).

    Raises:
        PrepError: the chosen atlas's file is missing or invalid.
    """
    if kind not in ATLASES:
        raise PrepError(f"--atlas: unknown {kind!r}; valid: {', '.join(ATLASES)}")
    if kind == "none":
        return None
    notes: list[str] = []
    if kind == "auto":
        if atlas_file is not None:
            stem = Path(atlas_file).name.lower()
            kind = next((k for k, f in _ATLAS_FILES.items() if stem == f.lower()), "file")
        elif _find_named(raw, _ATLAS_FILES["cc200"]) is not None:
            kind = "cc200"
        elif coords is not None or _bundled_power() is not None:
            kind = "power264"
            notes.append("atlas auto: no atlas file given and no CC200.nii.gz under --raw; "
                         f"using {radius:g} mm spheres around the Power-264 coordinates")
        else:
            notes.append("atlas auto: no atlas file, no CC200.nii.gz under --raw and no Power-264 "
                         "coordinates (install nilearn or pass --atlas-coords); no atlas written")
            return None
    if kind == "power264":
        src = Path(coords) if coords is not None else _bundled_power()
        if src is None:
            raise PrepError("--atlas power264: no coordinates; pass --atlas-coords power_2011.csv "
                            "(nilearn/datasets/data/power_2011.csv) or install nilearn")
        labels, spheres = sphere_atlas(read_coordinates(src), radius)
        cen = atlas_table(labels, names=dict(zip(spheres["label"].astype(int), spheres["name"])))
        spheres = spheres.rename(columns={"x": "coord_x", "y": "coord_y", "z": "coord_z"})
        table = cen.merge(spheres.drop(columns=["name", "voxels"]), on="label")
        overlaps = int(spheres["overlap_voxels"].sum())
        if overlaps:
            notes.append(f"power264: {overlaps} voxel(s) within reach of two spheres went to the "
                         "nearer centre")
        return "power264", labels, table, str(src), notes
    if kind in _ATLAS_FILES:
        src = Path(atlas_file) if atlas_file is not None else _find_named(raw, _ATLAS_FILES[kind])
        if src is None:
            raise PrepError(f"--atlas {kind}: {_ATLAS_FILES[kind]} not found under {raw}; pass "
                            f"--atlas-file PATH (PCP's abide/preprocessing/resources/abide_rois/"
                            f"{_ATLAS_FILES[kind]})", raw)
        data, affine = load_volume(src, f"{kind} atlas")
        if kind == "rois_3mm":
            labels, more = rois_3mm_atlas(data, affine, src)
        else:
            labels, more = crop_cc_atlas(data, affine, src)
        return kind, labels, atlas_table(labels, prefix=kind), str(src), notes + more
    if atlas_file is None:
        raise PrepError("--atlas file: pass --atlas-file PATH (a label NIfTI)")
    labels, more = label_atlas(atlas_file)
    return "file", labels, atlas_table(labels), str(atlas_file), notes + more


def write_atlas(out: Path, labels: np.ndarray, table: pd.DataFrame, size: Sequence[int] | None = None,
                aspect: str = "stretch") -> dict[str, str]:
    """Write ``atlas/atlas.nii.gz`` (+ the resized copy) and ``atlas/atlas_labels.csv``.

    Returns:
        Relative paths: ``grid``, ``labels_csv`` and, with ``size``, ``resized`` (the one
        matching the cached arrays is ``data``).
    """
    import nibabel as nib

    folder = out / "atlas"
    folder.mkdir(parents=True, exist_ok=True)
    lab = labels.astype(np.int32)
    nib.save(nib.Nifti1Image(lab, GRID_AFFINE), str(folder / "atlas.nii.gz"))
    paths = {"grid": "atlas/atlas.nii.gz", "labels_csv": "atlas/atlas_labels.csv",
             "data": "atlas/atlas.nii.gz"}
    table = table.copy()
    if size is not None:
        small, matrix = resize_volume(lab, size, aspect, order=0)
        name = "atlas_" + "x".join(str(int(s)) for s in size) + ".nii.gz"
        nib.save(nib.Nifti1Image(small.astype(np.int32), GRID_AFFINE @ matrix), str(folder / name))
        paths["resized"] = paths["data"] = f"atlas/{name}"
        table["voxels_resized"] = [int((small == v).sum()) for v in table["label"]]
    table.to_csv(folder / "atlas_labels.csv", index=False)
    return paths


def load_atlas(path: str | Path, with_table: bool = False) -> Any:
    """Read an atlas written by this script as an int32 label array ``(X, Y, Z)`` (0 =
    background; same voxel order as the cached arrays' spatial axes).

    With ``with_table``, returns ``(labels, table)`` where ``table`` is the
    ``atlas_labels.csv`` beside it (``label, name, voxels, x, y, z``...).

    Raises:
        PrepError: missing or unreadable file, or non-integer labels.
    """
    data, _ = load_volume(path, "atlas label volume")
    if not np.allclose(data, np.round(data)):
        raise PrepError(f"{path}: not a label volume (non-integer values)", path)
    labels = np.round(data).astype(np.int32)
    if not with_table:
        return labels
    csv = Path(path).with_name("atlas_labels.csv")
    if not csv.is_file():
        raise PrepError(f"{csv}: labels table not found beside {Path(path).name}", csv)
    return labels, pd.read_csv(csv)


def atlas_for_manifest(manifest: str | Path) -> tuple[np.ndarray, pd.DataFrame]:
    """The atlas matching a prepared manifest's arrays (its ``atlas`` column): ``(labels, table)``.

    Raises:
        PrepError: the manifest has no atlas (prepared with ``--atlas none``) or it is missing.
    """
    manifest = Path(manifest)
    table = pd.read_csv(manifest, dtype={"atlas": str}, keep_default_na=False)
    if "atlas" not in table.columns or not table["atlas"].astype(bool).any():
        raise PrepError(f"{manifest}: no atlas column; prepare with --atlas", manifest)
    return load_atlas(manifest.parent / table["atlas"].iloc[0], with_table=True)


# --------------------------------------------------------------------------- command line

def _test_fold(text: str) -> int | None:
    if text.lower() in ("none", "-1"):
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a fold number or 'none', got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python data_prep/abide.py``."""
    p = base_parser("abide", __doc__.split("\n\n")[0] + """

Reads the phenotypic CSV and the 3D derivative maps of one pipeline/strategy (PCP's
Outputs/ layout or nilearn's flat ABIDE_pcp/ layout), applies quality control, stacks
ReHo, DC, LFCD and VMHC as channels, and writes manifest.csv (label 1 = autism,
0 = control; site, region = FedSKD's four regional clients, sex, age, fold, split),
arrays/<FILE_ID>.npy, the atlas, excluded.csv, report.json and skipped.csv.

examples:
  python data_prep/abide.py --raw ~/data/ABIDE_Initiative --out ~/data/abide_ccs
  python data_prep/abide.py --raw ~/nilearn_data --out ~/data/abide48 --size 48 \\
      --pipeline cpac --strategy filt_noglobal --max-mean-fd 0.2 --atlas-file CC200.nii.gz""")
    p.add_argument("--phenotypic", type=Path, default=None, metavar="CSV",
                   help=f"the phenotypic file (default: {PHENOTYPIC_FILE} next to the derivatives)")
    p.add_argument("--layout", choices=("auto", "pcp", "nilearn"), default="auto",
                   help="PCP's Outputs/<pipeline>/<strategy>/<derivative>/ or nilearn's flat "
                        "ABIDE_pcp/<pipeline>/<strategy>/ (default: auto)")
    p.add_argument("--pipeline", choices=PIPELINES, default="ccs",
                   help="preprocessing pipeline (default: ccs, as FedSKD)")
    p.add_argument("--strategy", choices=STRATEGIES, default="filt_noglobal",
                   help="band-pass filtering / global signal regression (default: filt_noglobal, "
                        "as FedSKD)")
    p.add_argument("--derivatives", default=",".join(FEDSKD_DERIVATIVES), metavar="LIST",
                   help="comma-separated derivative maps stacked as channels, in order (default: "
                        f"{','.join(FEDSKD_DERIVATIVES)}; DC is also published as degree_binarize)")
    p.add_argument("--qc", choices=("nilearn", "none"), default="nilearn",
                   help="rater-based quality control: nilearn's quality_checked=True rules (871 "
                        "subjects) or none (default: nilearn)")
    p.add_argument("--max-mean-fd", type=float, default=None, metavar="MM",
                   help="also drop subjects with func_mean_fd above MM (or unknown), e.g. 0.2")
    p.add_argument("--resample", choices=RESAMPLE_MODES, default="error",
                   help="a volume not on the 61x73x61 3 mm grid: error (default), or resample it "
                        "explicitly (linear / nearest)")
    p.add_argument("--size", type=int, nargs="+", default=None, metavar="N",
                   help="resize arrays to N^3 (or N N N), e.g. 48 as in FedSKD (default: keep 61x73x61)")
    p.add_argument("--aspect", choices=RESIZE_ASPECTS, default="stretch",
                   help="with --size: stretch each axis (default, as FedSKD), pad or crop to keep "
                        "the aspect")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5)")
    p.add_argument("--test-fold", type=_test_fold, default=0, metavar="K",
                   help="fold written as split 'test' (default 0; 'none': every row 'train')")
    p.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default 0)")
    p.add_argument("--atlas", choices=ATLASES, default="auto",
                   help="region atlas written to atlas/ (default auto: --atlas-file, else CC200.nii.gz "
                        "under --raw, else Power-264 spheres, else none)")
    p.add_argument("--atlas-file", type=Path, default=None, metavar="NII",
                   help="atlas label NIfTI (CC200.nii.gz, CC400.nii.gz, rois_3mm.nii.gz or any label "
                        "volume, resampled onto the grid by nearest neighbour)")
    p.add_argument("--atlas-coords", type=Path, default=None, metavar="CSV",
                   help="ROI centres (MNI mm) for --atlas power264 (default: nilearn's power_2011.csv)")
    p.add_argument("--sphere-radius", type=float, default=5.0, metavar="MM",
                   help="sphere radius for --atlas power264 (default 5)")
    return p


def _size(values: Sequence[int] | None) -> tuple[int, int, int] | None:
    if values is None:
        return None
    if len(values) == 1:
        values = list(values) * 3
    if len(values) != 3 or min(values) < 1:
        raise PrepError(f"--size: expected 1 or 3 positive sizes, got {list(values)}")
    return (int(values[0]), int(values[1]), int(values[2]))


@staged_main
def main(argv: list[str] | None = None) -> int:
    """Prepare ABIDE-I PCP derivatives: see ``python data_prep/abide.py --help``."""
    args = build_parser().parse_args(argv)
    derivatives = [d.strip() for d in args.derivatives.split(",") if d.strip()]
    unknown = [d for d in derivatives if d not in DERIVATIVES]
    if not derivatives or unknown or len(set(derivatives)) != len(derivatives):
        raise PrepError(f"--derivatives: {args.derivatives!r}; expected distinct names from "
                        f"{', '.join(DERIVATIVES)}")
    size = _size(args.size)
    if args.test_fold is not None and not 0 <= args.test_fold < args.folds:
        raise PrepError(f"--test-fold {args.test_fold}: expected 0..{args.folds - 1} or none")
    raw, out = check_dirs(args.raw, args.out, args.overwrite)
    report = PrepReport("abide", str(raw), str(out), args.skip_bad,
                        options={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                        present_only=args.present_only)

    layout = find_layout(raw, args.pipeline, args.strategy, derivatives, args.layout)
    pheno = find_phenotypic(raw, args.phenotypic, layout)
    table = read_phenotypic(pheno)
    kept, excluded = select_rows(table, args.qc, args.max_mean_fd, pheno)
    report.note(f"layout {layout.kind}: {layout.root}; phenotypic {pheno}")

    subjects: list[Subject] = []
    seen: dict[tuple[str, Any], int] = {}
    for _, row in kept.iterrows():
        item = _row_item(pheno, row)
        ok, subject = report.attempt(item, lambda r=row: parse_subject(r, pheno), "phenotypic")
        if not ok:
            continue
        keys = (("SUB_ID", subject.sub_id), ("FILE_ID", subject.file_id))
        twice = [key for key in keys if key in seen]
        if twice:
            field, value = twice[0]
            with report.guard(item, "phenotypic"):
                raise PrepError(f"{item}: {field} {value} already appears on line {seen[twice[0]]}; "
                                "expected one row per subject", item)
            continue
        seen[("SUB_ID", subject.sub_id)] = seen[("FILE_ID", subject.file_id)] = subject.line
        subjects.append(subject)
    def locate(s: Subject) -> None:
        for d in derivatives:
            if not layout.path(s.file_id, d).is_file():
                path = layout.path(s.file_id, d)
                raise NotDownloaded(f"{path}: file not found; expected the {d} map of {s.file_id} "
                                    f"(listed by {pheno.name} line {s.line}, SUB_ID {s.sub_id})", path)

    subjects = keep_present(subjects, locate, report, name=lambda s: s.file_id)
    if args.limit is not None:
        subjects = subjects[:max(0, args.limit)]
    folds = assign_folds(subjects, args.folds, args.seed)

    atlas = prepare_atlas(args.atlas, raw, args.atlas_file, args.atlas_coords, args.sphere_radius)

    if args.overwrite:  # nothing of the earlier run may survive next to the new one
        for sub in ("arrays", "atlas"):
            if (out / sub).is_dir():
                shutil.rmtree(out / sub)
        for name in ("manifest.csv", "report.json", "skipped.csv", "excluded.csv"):
            (out / name).unlink(missing_ok=True)
    atlas_paths: dict[str, str] = {}
    if atlas is not None:
        name, labels, labels_table, source, notes = atlas
        atlas_paths = write_atlas(out, labels, labels_table, size, args.aspect)
        for n in notes:
            report.note(n)
        report.counts.update({"atlas": atlas_paths["data"], "atlas_grid": atlas_paths["grid"],
                              "atlas_labels": atlas_paths["labels_csv"], "atlas_name": name,
                              "atlas_source": source, "atlas_regions": int(len(labels_table))})

    rows: list[dict[str, Any]] = []
    nonfinite = 0
    resampled_n = 0
    for subject, fold in progress(list(zip(subjects, folds)), "abide", total=len(subjects)):
        def prepare(s: Subject = subject) -> tuple[np.ndarray, bool, int]:
            channels, flags, bad = [], [], 0
            locate(s)
            for d in derivatives:
                vol, res, n_bad = load_derivative(layout.path(s.file_id, d), args.resample,
                                                  f"{d} map of {s.file_id}")
                channels.append(vol)
                flags.append(res)
                bad += n_bad
            arr = np.stack(channels)
            if size is not None:
                arr, _ = resize_volume(arr, size, args.aspect, order=1)
            return arr, any(flags), bad

        ok, result = report.attempt(subject.file_id, prepare, "derivatives")
        if not ok:
            continue
        arr, resampled, n_bad = result
        nonfinite += n_bad
        resampled_n += int(resampled)
        rel = save_array(out, f"arrays/{subject.file_id}.npy", arr)
        files = {d: layout.path(subject.file_id, d).relative_to(raw).as_posix() for d in derivatives}
        rows.append({
            "sample_id": subject.file_id, "path": rel, "image_path": files[derivatives[0]],
            "label": subject.label, "class_name": subject.class_name, "subject_id": str(subject.sub_id),
            "site": subject.site, "sex": subject.sex,
            "split": "train" if args.test_fold is None or fold != args.test_fold else "test",
            "region": subject.region, "region_client": REGION_ORDER.index(subject.region) + 1,
            "site_id": subject.site_id, "age": "" if subject.age is None else subject.age,
            "mean_fd": "" if subject.mean_fd is None else subject.mean_fd, "fold": fold,
            "dx_group": subject.dx_group, "file_id": subject.file_id,
            "channels": ",".join(derivatives), "resampled": resampled,
            "atlas": atlas_paths.get("data", ""),
            **{f"image_{d}": f for d, f in files.items()},
        })
    if rows:
        splits = {r["split"] for r in rows}
        wanted = {"train"} | ({"test"} if args.test_fold is not None else set())
        for split in sorted(wanted - splits):
            raise PrepError(f"{out}: split {split!r} is empty after quality control and skipping "
                            f"({len(rows)} sample(s), folds {sorted({r['fold'] for r in rows})}, test "
                            f"fold {args.test_fold}); expected at least one sample - use fewer --folds, "
                            "another --test-fold, or --test-fold none", out)
    df = write_manifest(out, rows, extra_order=[
        "region", "region_client", "site_id", "age", "mean_fd", "fold", "dx_group", "file_id",
        "channels", "resampled", "atlas"], classes=CLASS_NAMES, report=report)
    pd.DataFrame(excluded, columns=["sub_id", "file_id", "site_id", "line", "rule", "reason"]).to_csv(
        out / "excluded.csv", index=False)
    missing_regions = [r for r in REGION_ORDER if r not in set(df["region"])]
    if missing_regions:
        report.note(f"no samples from region(s) {', '.join(missing_regions)}: the natural split "
                    "by region will have fewer clients")
    if resampled_n:
        report.note(f"{resampled_n} sample(s) had a volume on another grid, resampled ({args.resample})")
    rules = [e["rule"] for e in excluded]
    report.counts.update({
        "phenotypic_rows": int(len(table)), "excluded": len(excluded),
        "excluded_no_filename": rules.count("no_filename"), "excluded_qc": rules.count("qc"),
        "excluded_mean_fd": rules.count("mean_fd"),
        "selected": len(subjects), "written": int(len(df)), "skipped": len(report.skipped),
        "autism": int((df["label"] == 1).sum()), "control": int((df["label"] == 0).sum()),
        "train": int((df["split"] == "train").sum()), "test": int((df["split"] == "test").sum()),
        "per_region": {r: int((df["region"] == r).sum()) for r in REGION_ORDER},
        "array_shape": [len(derivatives), *(size or GRID_SHAPE)], "channels": derivatives,
        "resampled": resampled_n, "nonfinite_voxels_zeroed": nonfinite,
        "layout": layout.kind, "excluded_csv": "excluded.csv",
    })
    report.write(out)
    print(report.summary())
    return 0
