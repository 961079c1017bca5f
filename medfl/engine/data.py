"""Split a dataset across clients: partition, local train/val/test, global test."""

from __future__ import annotations

import inspect
import json
import logging
import uuid

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from torch.utils.data import Dataset

from medfl.data.partition import DEFAULT_GROUP_COLUMN, PartitionError, grouped_stratified_split, per_class_holdout
from medfl.data.source import DataError, FederatedSource
from medfl.integrity import sha256_file, write_text, writing
from medfl.method import derive_seed
from medfl.plugins import lookup

__all__ = ["FederatedData", "split_data", "read_partition", "PARTITION_COLUMNS", "cv_folds", "sample_attributes", "client_order", "SUBGROUP_CODES",
           "POOLED", "REPORT_NAME", "group_keys", "partition_report", "report_line", "warn_straddling"]

logger = logging.getLogger(__name__)

#: The client id of the pooled (centralized) client.
POOLED = "pooled"


def client_order(ids: Any) -> list[str]:
    """Client ids (as strings) in the engine's order: by length, then text, so "2" comes
    before "10". Clients are trained, evaluated and replied for in this order everywhere."""
    return sorted(map(str, ids), key=lambda s: (len(s), s))


@dataclass
class FederatedData:
    """A dataset assigned to clients.

    Attributes:
        source: the dataset.
        assignments: one row per used sample: ``row`` (position in ``source.table``),
            ``client_id`` (``""`` for the global test), ``client_name``, ``role``
            (``train``/``val``/``test``/``global_test``), ``label``, ``sample_id``.
        report: what the partition did with subjects (:func:`partition_report`), written
            beside the assignment table by :meth:`save`; ``None``: nothing is written.
    """

    source: FederatedSource
    assignments: pd.DataFrame
    report: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._positions: dict[tuple[str, str], np.ndarray] | None = None
        # names this object's datasets for caches that outlive a round (the payload guard's
        # reference): unique per object, never reused as id() would be
        self.token = uuid.uuid4().hex

    def _index(self) -> dict[tuple[str, str], np.ndarray]:
        """(client id, role) -> row positions, built once (the table is filtered per call
        otherwise, every round for every client)."""
        if self._positions is None:
            a = self.assignments
            cids = a["client_id"].astype(str).to_numpy()
            roles = a["role"].astype(str).to_numpy()
            rows = a["row"].to_numpy(dtype=np.int64)
            index: dict[tuple[str, str], list[int]] = {}
            for i, (cid, role) in enumerate(zip(cids, roles)):
                index.setdefault((cid if role != "global_test" else "", role), []).append(i)
            self._positions = {k: rows[np.asarray(v, dtype=np.int64)] for k, v in index.items()}
            for role in sorted({r for _, r in self._positions} - {"global_test"}):
                self._positions[(POOLED, role)] = rows[np.flatnonzero(roles == role)]
        return self._positions

    @property
    def client_ids(self) -> list[str]:
        """Client ids in numeric order."""
        return client_order(self.assignments.loc[self.assignments["client_id"] != "", "client_id"].unique())

    def client_names(self) -> dict[str, str]:
        """Client id -> readable name (e.g. a site or region)."""
        a = self.assignments[self.assignments["client_id"] != ""]
        return dict(zip(a["client_id"].astype(str), a["client_name"].astype(str)))

    def positions(self, client_id: str, role: str) -> np.ndarray:
        """Positions in ``source.table`` of ``client_id``'s ``role`` rows, in assignment order
        (``global_test`` ignores the client; :data:`POOLED` pools every client's rows)."""
        key = ("", role) if role == "global_test" else (client_id, role)
        return self._index().get(key, np.zeros(0, dtype=np.int64))

    def rows(self, client_id: str, role: str) -> pd.DataFrame:
        """The source rows of ``client_id``'s ``role`` (``global_test`` ignores the client)."""
        return self.source.table.iloc[self.positions(client_id, role)]

    def dataset_factories(self, client_id: str, roles: list[str]) -> dict[str, Callable[..., Dataset]]:
        """Lazily built datasets of each role for one client.

        Each factory takes an optional ``augment`` (default: augment the ``train`` role
        only), so a client can read its training split without random transforms."""
        out: dict[str, Callable[..., Dataset]] = {}
        for role in roles:
            build = (lambda augment=None, r=role: self._build(client_id, r, augment))
            # the same samples every round: the guard can reuse its reference without building
            build.guard_key = f"{self.token}:{client_id}:{role}"  # type: ignore[attr-defined]
            out[role] = build
        return out

    def _build(self, client_id: str, role: str, augment: bool | None = None) -> Dataset:
        """One dataset, with its rows' subgroup attributes attached (:func:`sample_attributes`);
        ``augment`` defaults to ``role == "train"``."""
        rows = self.rows(client_id, role)
        ds = self.source.make_dataset(rows, role == "train" if augment is None else bool(augment))
        attrs = sample_attributes(rows)
        if attrs:
            try:
                ds.sample_attributes = attrs
            except AttributeError:  # a dataset class with __slots__: no subgroup metrics
                pass
        return ds

    def sizes(self, client_id: str, roles: list[str]) -> dict[str, int]:
        """Number of samples of each role for one client."""
        return {r: len(self.positions(client_id, r)) for r in roles}

    def num_examples(self) -> dict[str, int]:
        """Training-set size of every client."""
        return {cid: len(self.positions(cid, "train")) for cid in self.client_ids}

    def save(self, path: str | Path) -> None:
        """Write the assignment table as CSV, atomically (a temporary file renamed into place),
        with a sidecar ``<name>.sha256`` holding the file's SHA-256 and row count, which
        :func:`read_partition` checks: a kill mid-write never leaves a short partition that a
        resume would take for the whole one. The :attr:`report` goes first to
        :data:`REPORT_NAME` in the same folder (the table, written last, marks a whole split)."""
        path = Path(path)
        if self.report is not None:
            write_text(path.with_name(REPORT_NAME), json.dumps(self.report, indent=2) + "\n")
        tmp = path.with_name(path.name + ".tmp")
        with writing(path, tmp):
            self.assignments.to_csv(tmp, index=False)
        write_text(path.with_name(path.name + ".sha256"), f"{sha256_file(tmp)} {len(self.assignments)}\n")
        tmp.replace(path)


PARTITION_COLUMNS = ("row", "client_id", "role")

#: The partition report's file name, beside ``partition.csv`` (:func:`partition_report`).
REPORT_NAME = "partition_report.json"


def read_partition(path: str | Path) -> pd.DataFrame:
    """Read a saved ``partition.csv`` and check it is whole: its sidecar checksum and row
    count when the sidecar exists (runs written before it had none), the columns
    :data:`PARTITION_COLUMNS` with no blank cell, unique non-negative row positions.

    Raises:
        DataError: naming the file and what is wrong; nothing is guessed (a partition that
            lost rows would silently drop clients or samples from a resumed run).
    """
    path = Path(path)
    damaged = f"{path}: the saved partition is damaged"
    advice = "; restore it from a backup or start a new run (a resumed run must train on the same split)"
    side = path.with_name(path.name + ".sha256")
    parts = side.read_text().split() if side.is_file() else None
    if parts is not None and (len(parts) != 2 or sha256_file(path) != parts[0]):
        raise DataError(f"{damaged}: its SHA-256 differs from the one written with it ({side.name}){advice}")
    if path.stat().st_size == 0:
        raise DataError(f"{damaged}: the file is empty{advice}")
    try:
        df = pd.read_csv(path, dtype={"client_id": str, "client_name": str}, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DataError(f"{damaged}: not a readable CSV ({exc}){advice}") from None
    missing = [c for c in PARTITION_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{damaged}: no column(s) {missing}; has {list(df.columns)}{advice}")
    if parts is not None and len(df) != int(parts[1]):
        raise DataError(f"{damaged}: {len(df)} rows, {parts[1]} were written{advice}")
    rows = pd.to_numeric(df["row"], errors="coerce")
    if rows.isna().any() or (df["role"] == "").any() or ((df["client_id"] == "") & (df["role"] != "global_test")).any():
        raise DataError(f"{damaged}: blank or non-numeric cells in {list(PARTITION_COLUMNS)}{advice}")
    if (rows < 0).any() or rows.duplicated().any():
        raise DataError(f"{damaged}: negative or repeated row positions{advice}")
    df["row"] = rows.astype(int)
    return df


#: Manifest columns kept beside a dataset for subgroup metrics, and their accepted codes.
SUBGROUP_CODES: dict[str, dict[str, str]] = {
    "sex": {"M": "M", "F": "F", "MALE": "M", "FEMALE": "F", "1": "M", "2": "F"},
}


def sample_attributes(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-sample subgroup attributes of ``rows`` (``sex`` as ``M``/``F``/``""`` unknown).

    They stay with the client's dataset (``dataset.sample_attributes``) so evaluation can
    score each subgroup at the client; only the per-group scalars leave it."""
    out = {}
    for col, codes in SUBGROUP_CODES.items():
        if col in rows.columns:
            vals = rows[col].astype(str).str.strip().str.upper()
            out[col] = vals.map(codes).fillna("").to_numpy(dtype=object)
    return out


def cv_folds(labels: np.ndarray, groups: np.ndarray, folds: int, seed: int,
             column: np.ndarray | None = None, where: str = "cv") -> np.ndarray:
    """The cross-validation fold (0..folds-1) of each row of one client's data.

    With ``column`` (a dataset's own fold assignment, e.g. the ABIDE manifest's ``fold``)
    its sorted distinct values are taken in turn as folds 0, 1, ...; when it has more
    values than ``folds`` they are dealt round-robin (value rank modulo ``folds``), so a
    5-fold column serves a 2-fold run. Otherwise folds are drawn grouped (rows of one
    ``groups`` key share a fold) and stratified by label from ``seed``.

    Raises:
        DataError: ``column`` has fewer distinct values than ``folds``, or blank cells.
    """
    if column is not None:
        col = pd.Series(column)
        if col.isna().any() or (col.astype(str).str.strip() == "").any():
            raise DataError(f"{where}: fold column has blank cells; expected a fold for every row")
        values = sorted(col.unique(), key=lambda v: (str(type(v)), v))
        if len(values) < folds:
            raise DataError(f"{where}: fold column has {len(values)} distinct value(s) {values}; "
                            f"cv.folds = {folds} needs at least {folds} (set cv.column null to draw folds)")
        rank = {v: i % folds for i, v in enumerate(values)}
        return col.map(rank).to_numpy(dtype=np.int64)
    parts = grouped_stratified_split(labels, groups, {str(k): 1.0 / folds for k in range(folds)}, seed)
    out = np.empty(len(labels), dtype=np.int64)
    for k, idx in parts.items():
        out[idx] = int(k)
    return out


def split_data(source: FederatedSource, cfg: dict[str, Any], saved: str | Path | None = None,
               fold: int | None = None) -> FederatedData:
    """Assign ``source``'s rows to clients as ``cfg`` says, or reload a saved assignment.

    The rows with ``split == "test"`` (when the table has an official split and
    ``use_official_split`` is true) form the global test set; otherwise ``global_test_per_class``
    rows of every class (:func:`~medfl.data.partition.per_class_holdout`) or else a stratified
    ``global_test_fraction`` is held out. A partitioner whose result has ``rest ==
    "global_test"`` (:func:`~medfl.data.partition.class_sample`) adds the rows no client took
    to the global test set. Rows sharing a ``group_column`` value (default ``subject_id``: one
    patient's images; a row without one is its own group) stay in one part of the global
    hold-out and of each client's local split. The rest is partitioned across ``num_clients`` clients by the configured partitioner, and each
    client's share is split into local ``client_split`` parts, stratified by label. A
    partitioner with a ``group_column`` parameter (every built-in one) gets ``group_column``
    too, unless the partition spec sets its own, and keeps a subject at one client; the
    result's :attr:`FederatedData.report` (:func:`partition_report`) counts the subjects
    that straddle anyway (with ``group_column`` null, by ``subject_id``).

    With ``fold`` (cross-validation, ``cfg["cv"]["folds"]`` folds) the global hold-out and
    the partition are those of every other fold; each client's rows are cut into folds
    (:func:`cv_folds`, seeded per client, or the dataset's ``cv.column``), fold ``fold`` is
    its ``test`` split and the rest is split ``train``:``val`` in ``client_split``'s ratio.

    Raises:
        DataError: a saved partition does not match the dataset, a client ends up with an
            empty training set, or ``fold`` is out of range.
    """
    table = source.table
    if saved is not None and Path(saved).is_file():
        assignments = read_partition(saved)
        if assignments["row"].max() >= len(table):
            raise DataError(f"{saved}: saved partition refers to rows beyond the dataset ({len(table)} rows)")
        return FederatedData(source, assignments, _saved_report(Path(saved)))
    gcol = cfg.get("group_column", DEFAULT_GROUP_COLUMN)
    if gcol and gcol not in table.columns and gcol != DEFAULT_GROUP_COLUMN:
        raise DataError(f"group_column {gcol!r} is not a column of the dataset; columns: {', '.join(table.columns)}")
    spec = dict(cfg["partition"])
    pname = spec.pop("name")
    partitioner = lookup("partitioner", pname)
    if "group_column" not in spec and _takes_group_column(partitioner):
        spec["group_column"] = gcol or None
    dealt = spec.get("group_column") if _takes_group_column(partitioner) else None
    dealt = dealt if isinstance(dealt, str) and dealt in table.columns else None
    seed = int(cfg["seed"])
    labels = table["label"].to_numpy()
    groups = group_keys(table, gcol)
    pool_pos, test_pos = _global_holdout(table, cfg, labels, groups, seed)
    pool = table.iloc[pool_pos].reset_index(drop=True)
    parts = partitioner(pool, int(cfg["num_clients"]), derive_seed(seed, "partition"), **spec)
    names = getattr(parts, "names", {})
    if getattr(parts, "rest", None) == "global_test":  # e.g. class_sample: the rows no client took
        taken = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts.values()] or [np.zeros(0, np.int64)])
        test_pos = np.sort(np.concatenate([test_pos, np.setdiff1d(pool_pos, pool_pos[taken])]))
    fold_column = _fold_column(table, cfg, fold)
    records = []
    for cid, pos in parts.items():
        local = pool_pos[np.asarray(pos, dtype=np.int64)]
        if fold is None:
            split = grouped_stratified_split(labels[local], groups[local], dict(cfg["client_split"]),
                                             derive_seed(seed, "split", cid))
        else:
            split = _fold_split(labels[local], groups[local], cfg, fold, derive_seed(seed, "cv", cid),
                                None if fold_column is None else fold_column[local],
                                f"client {cid} ({names.get(cid, f'client_{cid}')})")
        if not len(split.get("train", [])):
            raise DataError(f"partition: client {cid} has no training samples; lower num_clients or min_size")
        for role, idx in split.items():
            for p in local[np.sort(idx)]:
                records.append((int(p), str(cid), names.get(cid, f"client_{cid}"), role))
    for p in test_pos:
        records.append((int(p), "", "", "global_test"))
    a = pd.DataFrame(records, columns=["row", "client_id", "client_name", "role"])
    a["label"] = labels[a["row"].to_numpy()]
    if "sample_id" in table.columns:
        a["sample_id"] = table["sample_id"].to_numpy()[a["row"].to_numpy()]
    return FederatedData(source, a, partition_report(table, a, pname, dealt, gcol))


def _global_holdout(table: pd.DataFrame, cfg: dict[str, Any], labels: np.ndarray, groups: np.ndarray,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the rows left to partition and of the global test rows
    (:func:`split_data`): the official test split, ``global_test_per_class`` rows of each
    class, or a grouped, stratified ``global_test_fraction``."""
    per_class = cfg.get("global_test_per_class")
    official = cfg.get("use_official_split", True) and "split" in table.columns and (table["split"] == "test").any()
    if official and per_class:
        raise DataError(f"global_test_per_class = {per_class} asks for a drawn global test set, but the dataset "
                        "has an official split (a 'split' column with test rows); set use_official_split "
                        "false to draw one, or global_test_per_class null to use the official test rows")
    if official:
        is_test = (table["split"] == "test").to_numpy()
        return np.flatnonzero(~is_test), np.flatnonzero(is_test)
    if per_class:
        try:
            test_pos = per_class_holdout(labels, groups, int(per_class), derive_seed(seed, "global"))
        except PartitionError as exc:
            raise DataError(f"global_test_per_class: {exc}") from exc
        return np.setdiff1d(np.arange(len(table)), test_pos), test_pos
    f = float(cfg["global_test_fraction"])
    if f > 0:
        parts = grouped_stratified_split(labels, groups, {"pool": 1 - f, "test": f}, derive_seed(seed, "global"))
        return np.sort(parts["pool"]), np.sort(parts["test"])
    return np.arange(len(table)), np.zeros(0, dtype=np.int64)


def _fold_column(table: pd.DataFrame, cfg: dict[str, Any], fold: int | None) -> np.ndarray | None:
    """The dataset's own fold of each row (``cv.column``) when :func:`split_data` asks for
    cross-validation fold ``fold``; ``None`` without a fold or when the folds are drawn.

    Raises:
        DataError: ``fold`` is out of range, or ``cv.column`` is not a column of the dataset.
    """
    cv = dict(cfg.get("cv") or {})
    folds = int(cv.get("folds") or 0)
    if fold is not None and not 0 <= fold < max(folds, 0):
        raise DataError(f"cv: fold {fold} asked for, but cv.folds = {folds}; expected 0..{folds - 1}")
    column = cv.get("column")
    if fold is None or not column:
        return None
    if column not in table.columns:
        raise DataError(f"cv.column {column!r} is not a column of the dataset; columns: "
                        f"{', '.join(map(str, table.columns))} (set cv.column null to draw folds)")
    return table[column].to_numpy()


def _saved_report(saved: Path) -> dict[str, Any] | None:
    """The partition report written with a saved partition (:data:`REPORT_NAME` beside it),
    so a resumed run's copy says what the draw did; ``None`` for a partition saved before
    reports existed, or an unreadable report (the partition itself is what a resume needs)."""
    try:
        report = json.loads(saved.with_name(REPORT_NAME).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def _takes_group_column(partitioner: Callable[..., Any]) -> bool:
    """Whether a partitioner has a ``group_column`` parameter (every built-in one does; the
    engine then passes ``fl.group_column`` unless the partition spec sets its own)."""
    try:
        return "group_column" in inspect.signature(partitioner).parameters
    except (TypeError, ValueError):
        return False


def group_keys(table: pd.DataFrame, column: str | None) -> np.ndarray:
    """One string key per row of ``table``: rows with the same key form one group.

    Args:
        table: the manifest.
        column: the group column (e.g. ``subject_id``), or ``None``.

    Returns:
        The ``column`` value of each row as a string; a blank cell (NaN or ``""``) gives
        its row a key of its own (``"row:<position>"``), and without ``column`` (``None``
        or not in ``table``) every row is its own group (keys ``"0"``, ``"1"``, ...).
    """
    if not column or column not in table.columns:
        return np.arange(len(table)).astype(str)
    keys = table[column].astype(str).to_numpy()
    blank = pd.isna(table[column]).to_numpy() | (keys == "")
    return np.where(blank, np.char.add("row:", np.arange(len(table)).astype(str)), keys)


def partition_report(table: pd.DataFrame, assignments: pd.DataFrame, partitioner: str,
                     grouped_by: str | None, group_column: str | None) -> dict[str, Any]:
    """What a split did with subjects: groups per client, and every group that straddles.

    The report is saved as :data:`REPORT_NAME` beside ``partition.csv`` and its ``summary``
    printed by a run (:func:`warn_straddling`). Groups are counted by the ``checked_column``:
    ``group_column`` when the table has it, else ``grouped_by``, else the table's
    ``subject_id``, so a run that opted out of grouping learns how many subjects it split.

    Args:
        table: the dataset's manifest.
        assignments: the split (:attr:`FederatedData.assignments`).
        partitioner: the partitioner's name.
        grouped_by: the column whose groups the partitioner dealt whole, ``None``: rows
            one by one (``group_column`` null, no such column, or a partitioner without a
            ``group_column`` parameter).
        group_column: the run's ``fl.group_column`` (the global test and each client's
            splits are grouped by it), ``None`` when opted out.

    Returns:
        ``{"partitioner", "grouped", "grouped_by", "group_column", "checked_column", "groups", "clients":
        {client id: {"name", "rows", "groups"}}, "global_test": {"rows", "groups"},
        "straddling": {"clients", "client_and_global_test", "client_splits"}, "summary"}``,
        ``straddling`` counting the groups with rows at two or more clients, at a client
        and in the global test set, and in two or more of one client's splits.
    """
    column = next((c for c in (group_column, grouped_by, DEFAULT_GROUP_COLUMN) if c and c in table.columns), None)
    keys = group_keys(table, column)[assignments["row"].to_numpy(dtype=np.int64)]
    frame = pd.DataFrame({"key": keys, "client": assignments["client_id"].astype(str).to_numpy(),
                          "role": assignments["role"].astype(str).to_numpy(),
                          "name": assignments["client_name"].astype(str).to_numpy()})
    held = frame["role"].to_numpy() == "global_test"
    at, test = frame[~held], frame[held]
    per_client = at.groupby("client").agg(rows=("key", "size"), groups=("key", "nunique"), name=("name", "first"))
    clients = {cid: {"name": str(per_client.at[cid, "name"]), "rows": int(per_client.at[cid, "rows"]),
                     "groups": int(per_client.at[cid, "groups"])} for cid in client_order(per_client.index)}
    roles = at.groupby(["client", "key"])["role"].nunique()
    report: dict[str, Any] = {
        "partitioner": partitioner,
        "grouped": grouped_by is not None,
        "grouped_by": grouped_by,
        "group_column": group_column or None,
        "checked_column": column,
        "groups": int(frame["key"].nunique()),
        "clients": clients,
        "global_test": {"rows": int(len(test)), "groups": int(test["key"].nunique())},
        "straddling": {
            "clients": int((at.groupby("key")["client"].nunique() > 1).sum()),
            "client_and_global_test": int(len(set(test["key"]) & set(at["key"]))),
            "client_splits": int(roles[roles > 1].index.get_level_values("key").nunique()),
        },
    }
    report["summary"] = report_line(report)
    return report


def report_line(report: dict[str, Any]) -> str:
    """One line saying how a split was grouped and whether any group straddles, e.g.
    ``dirichlet: grouped by subject_id: 96 groups (21, 30, 25 per client; 20 in the global
    test); no subject_id group straddles two clients, a client and the global test, or two
    of a client's splits``."""
    col, s = report["checked_column"], report["straddling"]
    per = ", ".join(str(c["groups"]) for c in report["clients"].values())
    why = "group_column null" if not report["group_column"] else "the partitioner has no group_column parameter"
    how = f"grouped by {report['grouped_by']}" if report["grouped"] else f"rows dealt one by one ({why})"
    if col is None:
        return f"{report['partitioner']}: rows dealt one by one (no group column: every row its own group)"
    counts = (f"{report['groups']} {col} groups ({per} per client; "
              f"{report['global_test']['groups']} in the global test)")
    if not any(s.values()):
        return (f"{report['partitioner']}: {how}: {counts}; no {col} group straddles two clients, a client "
                "and the global test, or two of a client's splits")
    return (f"{report['partitioner']}: {how}: {counts}; {s['clients']} {col} group(s) straddle two or more "
            f"clients, {s['client_and_global_test']} a client and the global test, {s['client_splits']} two "
            "of a client's splits")


def warn_straddling(report: dict[str, Any] | None, where: str = "") -> None:
    """Print a split's :func:`report_line` on stderr, as a warning when some group straddles
    (a model may then be scored, in ``cross_test`` or the global test, on images of a subject
    it trained on)."""
    if report is None:
        return
    prefix = f"medfl{f' [{where}]' if where else ''} partition: "
    if not any(report["straddling"].values()):
        logger.info(prefix + report["summary"])
        return
    fix = (f"fl.group_column {report['checked_column']!r} keeps a subject's rows together" if not report["grouped"]
           else "the dataset's own split or fold column (use_official_split, cv.column) divides them")
    logger.warning(f"{prefix}warning: {report['summary']}; a model may be scored on images of subjects it trained on "
                   f"({fix})")


def _fold_split(labels: np.ndarray, groups: np.ndarray, cfg: dict[str, Any], fold: int, seed: int,
                column: np.ndarray | None, where: str) -> dict[str, np.ndarray]:
    """One client's cross-validation split: fold ``fold`` is ``test``, the rest train/val."""
    folds = int(cfg["cv"]["folds"])
    which = cv_folds(labels, groups, folds, seed, column, where=f"cv, {where}")
    test = np.flatnonzero(which == fold)
    rest = np.flatnonzero(which != fold)
    t, v = float(cfg["client_split"].get("train", 1.0)), float(cfg["client_split"].get("val", 0.0))
    if v > 0 and len(rest):
        parts = grouped_stratified_split(labels[rest], groups[rest], {"train": t / (t + v), "val": v / (t + v)},
                                         derive_seed(seed, "val", fold))
        return {"train": rest[parts["train"]], "val": rest[parts["val"]], "test": test}
    return {"train": rest, "test": test}
