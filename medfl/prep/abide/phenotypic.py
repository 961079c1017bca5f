"""The phenotypic CSV (``Phenotypic_V1_0b_preprocessed1.csv``): read as it is, rows selected
(``no_filename``, quality control, mean framewise displacement), each row parsed into a
:class:`Subject` (label, sex, FedSKD site and region), and cross-validation folds assigned.

Imports no other module of :mod:`medfl.prep.abide`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from medfl.prep.common import check_text_encoding, require_columns
from medfl.prep.errors import PrepError

__all__ = ["PHENOTYPIC_FILE", "CLASS_NAMES", "SITES", "REGIONS", "REGION_ORDER", "NILEARN_QC", "Subject",
           "is_missing", "read_phenotypic", "select_rows", "parse_subject", "assign_folds"]

#: The phenotypic file's name in both layouts.
PHENOTYPIC_FILE = "Phenotypic_V1_0b_preprocessed1.csv"

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

_REQUIRED = ("SUB_ID", "SITE_ID", "FILE_ID", "DX_GROUP")

#: A FILE_ID is used in file names: letters, digits, ``_``, ``-`` (never a path).
_FILE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


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
    check_text_encoding(path, PHENOTYPIC_FILE)
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
    """How messages and skipped.csv name a phenotypic row: file, line and SUB_ID."""
    return f"{path.name} line {row['_line']} (SUB_ID {row['SUB_ID'] or '?'})"


def _number_field(row: pd.Series, column: str, path: Path, integer: bool = False) -> Any:
    """Field ``column`` of ``row`` as a float (an int with ``integer``), ``None`` when missing."""
    if column not in row.index or is_missing(row[column]):
        return None
    try:
        number = float(row[column])
    except ValueError:
        number = float("nan")
    if not np.isfinite(number) or (integer and number != int(number)):
        raise PrepError(f"{_row_item(path, row)}: field {column} = {row[column]!r} is not "
                        + ("an integer" if integer else "a number"), _row_item(path, row))
    return int(number) if integer else number


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
    sub_id = _number_field(row, "SUB_ID", path, integer=True)
    if sub_id is None:
        raise PrepError(f"{item}: field SUB_ID is empty; expected the subject number", item)
    site_id = row["SITE_ID"].upper()
    if site_id not in SITES:
        raise PrepError(f"{item}: field SITE_ID = {row['SITE_ID']!r} is not an ABIDE-I site; "
                        f"expected one of {', '.join(sorted(SITES))}", item)
    try:
        dx = _number_field(row, "DX_GROUP", path, integer=True)
    except PrepError:
        dx = -1
    if dx not in _DX:
        raise PrepError(f"{item}: field DX_GROUP = {row['DX_GROUP']!r} is not a known diagnosis; "
                        "expected 1 (autism) or 2 (control)", item)
    sex = ""
    if "SEX" in row.index:
        try:
            code = _number_field(row, "SEX", path, integer=True)
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
                   age=_number_field(row, "AGE_AT_SCAN", path),
                   mean_fd=_number_field(row, "func_mean_fd", path), line=int(row["_line"]))


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
