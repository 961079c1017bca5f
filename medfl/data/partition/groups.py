"""Group-aware dealing: the rows sharing ``group_column`` (one patient's or lesion's images) are
one unit, so a partitioner gives them to one client.

:class:`_Groups` numbers the groups of a table, labels each by its most frequent label
(:func:`_group_labels`) and cuts a sequence of groups where a sequence of rows would be cut;
with one row per group it is the identity, so a partitioner written over groups draws exactly
what it drew over rows. The helpers are private to :mod:`medfl.data.partition`, shared by
its families; :data:`DEFAULT_GROUP_COLUMN` is public.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from medfl.data.partition.base import Partition, _check_clients, _check_int, _check_table, _fail, _finish

__all__ = ["DEFAULT_GROUP_COLUMN"]


#: The group column a partitioner uses unless told otherwise (``fl.group_column``'s default).
DEFAULT_GROUP_COLUMN = "subject_id"


def _groups_of(func: str, table: pd.DataFrame, group_column: str | None) -> np.ndarray:
    """Group index per row: rows sharing ``group_column`` (one patient or lesion) share one;
    a blank cell (NaN or ``""``), a missing default column or ``None`` makes each row its own
    group. Indices follow the sorted keys (:func:`class_sample` depends on that order)."""
    n = len(table)
    if group_column is not None and not isinstance(group_column, str):
        raise _fail(func, f"group_column must be a column name (str) or null (every row its own group), "
                    f"got {group_column!r}")
    if group_column is None or (group_column == DEFAULT_GROUP_COLUMN and group_column not in table.columns):
        return np.arange(n)
    if group_column not in table.columns:
        raise _fail(func, f"group_column {group_column!r} is not a column of the table; it has "
                    f"{list(map(str, table.columns))} (use null: every row its own group)")
    keys = table[group_column].astype(str).to_numpy()
    blank = pd.isna(table[group_column]).to_numpy() | (keys == "")
    keys = np.where(blank, np.char.add("\0row:", np.arange(n).astype(str)), keys)
    return np.unique(keys, return_inverse=True)[1].astype(np.int64)


def _group_labels(labels: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each group's label: its most frequent one (ties: the largest, e.g. malignant over
    benign), for group indices ``0 .. groups.max()``."""
    labels = np.asarray(labels)
    size = int(groups.max()) + 1 if len(groups) else 0
    values, codes = np.unique(labels, return_inverse=True)
    counts = np.zeros((size, len(values)), dtype=np.int64)
    np.add.at(counts, (groups, codes.ravel()), 1)
    # the last of the maxima in label order is the largest most frequent label
    pick = len(values) - 1 - np.argmax(counts[:, ::-1], axis=1) if len(values) else np.zeros(0, np.int64)
    return values[pick].astype(labels.dtype, copy=False)


def _even_cuts(n: int, pieces: int) -> np.ndarray:
    """Where :func:`numpy.array_split` cuts ``n`` items into ``pieces`` (the first ``n %
    pieces`` pieces one longer)."""
    sizes = np.full(pieces, n // pieces, dtype=np.int64)
    sizes[: n % pieces] += 1
    return np.cumsum(sizes)[:-1]


class _Groups:
    """The units a partitioner deals: whole groups of rows (one subject's images).

    Groups are numbered in order of first appearance (``by_key``: of their sorted keys), so
    that when every row is its own group (no group column, ``group_column=None``, or one row
    per subject) ``ids`` is ``arange(n)`` and a partitioner written over groups draws exactly
    what it drew over rows.

    Args:
        func: the partitioner's name, for error messages.
        table: the manifest.
        group_column: the grouping column, or ``None`` (see :func:`_groups_of`).
        by_key: number the groups in the order of their sorted keys (:func:`class_sample`'s
            draw depends on it). Default: ``False``.

    Attributes:
        ids: ``int64`` group index of each row.
        size: ``int64`` rows of each group.
        count: number of groups.
        grouped: whether some group has more than one row.
        unit: ``"rows"``, or e.g. ``"subject_id groups"`` when ``grouped``, for messages.
        dealt: ``""``, or a clause saying that whole groups were dealt, for messages.
    """

    def __init__(self, func: str, table: pd.DataFrame, group_column: str | None, by_key: bool = False) -> None:
        raw = _groups_of(func, table, group_column)
        _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        self.ids = raw if by_key and len(first) < len(table) else rank[inverse.ravel()]
        self.size = np.bincount(self.ids, minlength=len(first)).astype(np.int64)
        self.count = len(first)
        self.grouped = self.count < len(table)
        self.unit = f"{group_column} groups" if self.grouped else "rows"
        self.dealt = f", dealing whole {self.unit}; group_column null deals rows" if self.grouped else ""

    def labels(self, labels: np.ndarray) -> np.ndarray:
        """Each group's label (:func:`_group_labels`); the row labels when ungrouped."""
        return _group_labels(labels, self.ids) if self.grouped else labels

    def check_clients(self, func: str, num_clients: Any) -> int:
        """``num_clients`` as an integer in ``[1, count]``: each client needs one group."""
        if not self.grouped:
            return _check_clients(func, num_clients, self.count)
        num_clients = _check_int(func, "num_clients", num_clients, 1)
        if num_clients > self.count:
            raise _fail(func, f"num_clients={num_clients} is more than the number of {self.unit} "
                        f"({self.count}, in {len(self.ids)} rows); expected num_clients <= {self.count}, "
                        "or group_column null to deal rows one by one")
        return num_clients

    def cut(self, gids: np.ndarray, row_cuts: np.ndarray | list[int],
            nonempty: bool = False) -> list[np.ndarray]:
        """Split a sequence of groups where a sequence of rows would be split.

        Each cut (a count of rows from the start, non-decreasing) moves to the nearest group
        boundary (a tie: after the group that crosses it), so a piece's size is off by at
        most half a group per cut; with one row per group the cuts are exact.

        Args:
            gids: group indices in dealing order.
            row_cuts: cut positions in rows, as for :func:`numpy.split` of the rows.
            nonempty: give every piece at least one group when there are enough groups
                (a no-op on cuts that leave no piece empty, e.g. an ``array_split``'s).

        Returns:
            ``len(row_cuts) + 1`` arrays of group indices.
        """
        gids = np.asarray(gids, dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(self.size[gids])])
        cuts = np.asarray(row_cuts, dtype=np.int64)
        at = np.clip(np.searchsorted(bounds, cuts, side="left"), 0, len(gids))
        below = np.maximum(at - 1, 0)
        at = np.where((at > 0) & (cuts - bounds[below] < bounds[at] - cuts), below, at)
        pieces = len(at) + 1
        if nonempty and len(at) and len(gids) >= pieces:
            for i in range(len(at)):   # at least one group before each cut...
                at[i] = max(at[i], i + 1, at[i - 1] + 1 if i else 0)
            for i in reversed(range(len(at))):   # ...and after it
                at[i] = min(at[i], len(gids) - (pieces - 1 - i), at[i + 1] - 1 if i + 1 < len(at) else len(gids))
        return np.split(gids, at)

    def even(self, gids: np.ndarray, pieces: int, nonempty: bool = False) -> list[np.ndarray]:
        """``gids`` cut into ``pieces`` of about equal rows (:meth:`cut` at an even split of
        their rows, as :func:`numpy.array_split` cuts rows)."""
        return self.cut(gids, _even_cuts(self.rows(gids), pieces), nonempty=nonempty)

    def rows(self, gids: np.ndarray | list[np.ndarray]) -> int:
        """Number of rows of the groups ``gids`` (an array, or a bucket: a list of arrays)."""
        if isinstance(gids, list):
            return sum(self.rows(piece) for piece in gids)
        return int(self.size[np.asarray(gids, dtype=np.int64)].sum())

    def finish(self, buckets: list[list[np.ndarray]] | list[np.ndarray],
               names: list[str] | None = None, rest: str | None = None) -> Partition:
        """The :class:`Partition` giving client ``i`` every row of its groups ``buckets[i]``
        (``rest``: what becomes of the rows of no bucket, :attr:`Partition.rest`)."""
        owner = np.full(self.count, -1, dtype=np.int64)
        for i, bucket in enumerate(buckets):
            for piece in bucket if isinstance(bucket, list) else [bucket]:
                owner[np.asarray(piece, dtype=np.int64)] = i
        row_owner = owner[self.ids]
        return _finish([np.flatnonzero(row_owner == i) for i in range(len(buckets))], names=names, rest=rest)


def _dealt_groups(func: str, table: Any, num_clients: Any, group_column: str | None) -> tuple[_Groups, int]:
    """The checks a partitioner that deals groups starts with, in this order: ``table`` (a
    DataFrame with a ``label`` column), ``group_column``, ``num_clients`` (at most one client
    per group). Returns the table's :class:`_Groups` and ``num_clients``."""
    _check_table(func, table)
    groups = _Groups(func, table, group_column)
    return groups, groups.check_clients(func, num_clients)
