"""Split a dataset's rows across federated clients, and each client's rows into local splits.

Every partitioner has the signature ``func(table, num_clients, seed, **params)``:

* ``table`` is the manifest (a :class:`pandas.DataFrame` with at least an integer ``label``
  column; :func:`natural` also needs its grouping column, ``site`` by default),
* ``num_clients`` is the number of clients wanted,
* ``seed`` seeds :func:`numpy.random.default_rng`; the result is a pure function of the
  arguments.

It returns a :class:`Partition`: a ``dict`` mapping client ids ``"0"``, ``"1"``, ... (strings,
in order) to sorted ``int64`` arrays of row *positions* (``iloc`` positions, ``0 ..
len(table) - 1``), with the human-readable client names in :attr:`Partition.names`. Every
row goes to exactly one client (disjoint and complete); the exceptions are
:func:`label_skew` with ``allow_unassigned=True``, which drops the rows of labels no client
owns, and :func:`class_sample`, whose leftover rows become the global test set
(:attr:`Partition.rest`). Bad input raises :class:`PartitionError` naming the parameter and what was expected.

Every built-in partitioner also takes ``group_column`` (default ``"subject_id"``, the
engine passes ``fl.group_column``): rows sharing its value (one patient's or lesion's
images) go to one client, so no subject trains at two sites and ``cross_test`` never scores
a model on its own subject's images. A group counts for its most frequent label (ties: the
largest); sizes and ``min_size`` count rows; a blank cell (NaN) makes its row a group of its
own; a table without the default column, or ``group_column=None``, is dealt row by row, and
so is one with one row per group (the draw is then exactly the row-level one). Each
partitioner's docstring says how grouping bends its statistics.

The built-in partitioners are listed in :data:`PARTITIONERS`. :func:`partition_table` turns a
partition into a table that can be saved (and :func:`partition_from_table` reads it back),
:func:`class_counts` tabulates labels per client, :func:`stratified_split` splits one
client's rows into e.g. train/val/test, and :func:`per_class_holdout` holds out a fixed
number of rows per class as a test set (the engine's ``global_test_per_class``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "DEFAULT_GROUP_COLUMN",
    "grouped_stratified_split",
    "PARTITIONERS",
    "Partition",
    "PartitionError",
    "check_partition",
    "class_counts",
    "class_sample",
    "dirichlet",
    "iid",
    "label_skew",
    "natural",
    "partition_from_table",
    "partition_table",
    "per_class_holdout",
    "quantity_skew",
    "stratified_split",
    "subset",
]


class PartitionError(ValueError):
    """A partition was requested with bad parameters, or cannot be produced."""


#: What may become of rows a partition leaves unassigned (:attr:`Partition.rest`).
REST_ROLES = (None, "global_test")


class Partition(dict[str, np.ndarray]):
    """Client id -> sorted ``int64`` row positions, plus human-readable client names.

    A plain ``dict`` in every respect (``parts["0"]``, ``len(parts)``, iteration in client
    order), with one extra attribute.

    Args:
        data: mapping or iterable of ``(client_id, positions)`` pairs. Default: empty.
        names: client id -> display name. Default: ``None``, meaning ``"client_<id>"`` for
            every client; ids missing from a given mapping also get ``"client_<id>"``.

        rest: what becomes of rows no client holds: ``None`` (dropped, as
            :func:`label_skew` with ``allow_unassigned``) or ``"global_test"`` (the engine
            adds them to the held-out global test set, as :func:`class_sample` asks).

    Attributes:
        names: client id -> display name (e.g. ``"EUROPE"`` for :func:`natural`,
            ``"client_0"`` for the other partitioners).
        rest: as the argument.
    """

    names: dict[str, str]
    rest: str | None

    def __init__(
        self,
        data: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]] = (),
        names: Mapping[str, str] | None = None,
        rest: str | None = None,
    ) -> None:
        super().__init__(data)
        given = dict(names or {})
        self.names = {cid: str(given.get(cid, f"client_{cid}")) for cid in self}
        if rest not in REST_ROLES:
            raise PartitionError(f"Partition: rest must be one of {REST_ROLES}, got {rest!r}")
        self.rest = rest

    def sizes(self) -> dict[str, int]:
        """Number of rows held by each client, in client order."""
        return {cid: int(len(pos)) for cid, pos in self.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{cid!r} ({self.names.get(cid, cid)}): {len(pos)} rows"
                          for cid, pos in self.items())
        return f"Partition({{{inner}}})"


# --------------------------------------------------------------------------- validation


def _fail(func: str, message: str) -> PartitionError:
    return PartitionError(f"{func}: {message}")


def _check_table(func: str, table: Any, columns: Iterable[str] = ("label",)) -> None:
    if not isinstance(table, pd.DataFrame):
        raise _fail(func, f"table must be a pandas.DataFrame, got {type(table).__name__}")
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise _fail(
            func,
            f"table is missing column(s) {missing}; it has {list(map(str, table.columns))}",
        )


def _labels(func: str, table: pd.DataFrame) -> np.ndarray:
    col = table["label"]
    if col.isna().any():
        raise _fail(func, f"column 'label' has {int(col.isna().sum())} missing value(s)")
    return col.to_numpy()


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(func: str, name: str, value: Any, low: int, high: int | None = None,
               why: str = "") -> int:
    ok = _is_int(value) and value >= low and (high is None or value <= high)
    if not ok:
        rng_txt = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _fail(func, f"{name} must be an integer {rng_txt}{why}, got {value!r}")
    return int(value)


def _check_positive(func: str, name: str, value: Any) -> float:
    if (not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise _fail(func, f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_clients(func: str, num_clients: Any, n: int) -> int:
    num_clients = _check_int(func, "num_clients", num_clients, 1)
    if num_clients > n:
        raise _fail(
            func, f"num_clients={num_clients} is more than the number of rows ({n}); "
            "expected num_clients <= len(table)",
        )
    return num_clients


def _rng(func: str, seed: Any) -> np.random.Generator:
    if not _is_int(seed) or seed < 0:
        raise _fail(func, f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def _finish(buckets: list[np.ndarray] | list[list[np.ndarray]],
            names: list[str] | None = None) -> Partition:
    data: dict[str, np.ndarray] = {}
    for i, bucket in enumerate(buckets):
        if isinstance(bucket, list):
            arr = np.concatenate(bucket) if bucket else np.empty(0, dtype=np.int64)
        else:
            arr = bucket
        data[str(i)] = np.sort(np.asarray(arr, dtype=np.int64))
    named = None if names is None else {str(i): nm for i, nm in enumerate(names)}
    return Partition(data, names=named)


def check_partition(parts: Mapping[str, Any], num_rows: int | pd.DataFrame, *,
                    complete: bool = True) -> Partition:
    """Validate a partitioner's result and return it as a :class:`Partition`.

    Useful for partitioners from plugins, which may return a plain ``dict``.

    Args:
        parts: client id -> row positions.
        num_rows: number of rows in the table, or the table itself.
        complete: require every row to be assigned. Default: ``True``.

    Returns:
        A :class:`Partition` with sorted ``int64`` arrays (the names of ``parts`` are kept
        when it is a :class:`Partition` already).

    Raises:
        PartitionError: if a position is out of range, not an integer, assigned twice or
            (when ``complete``) a row is assigned to no client.
    """
    n = len(num_rows) if isinstance(num_rows, pd.DataFrame) else int(num_rows)
    data: dict[str, np.ndarray] = {}
    seen = np.zeros(n, dtype=np.int64)
    for cid, pos in parts.items():
        arr = np.asarray(pos)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise PartitionError(f"client {cid!r}: positions must be integers, got {arr.dtype}")
        arr = np.sort(arr.astype(np.int64).ravel())
        if arr.size and (arr[0] < 0 or arr[-1] >= n):
            raise PartitionError(
                f"client {cid!r}: positions must lie in [0, {n - 1}], got "
                f"min {arr[0]} and max {arr[-1]}"
            )
        np.add.at(seen, arr, 1)
        data[str(cid)] = arr
    if (seen > 1).any():
        dup = np.flatnonzero(seen > 1)
        raise PartitionError(
            f"{dup.size} row(s) assigned to more than one client, e.g. positions {dup[:5].tolist()}"
        )
    if complete and (seen == 0).any():
        gap = np.flatnonzero(seen == 0)
        raise PartitionError(
            f"{gap.size} row(s) assigned to no client, e.g. positions {gap[:5].tolist()}"
        )
    names = getattr(parts, "names", None)
    return Partition(data, names=names, rest=getattr(parts, "rest", None))


# --------------------------------------------------------------------------- groups

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

    Groups are numbered in order of first appearance, so that when every row is its own
    group (no group column, ``group_column=None``, or one row per subject) ``ids`` is
    ``arange(n)`` and a partitioner written over groups draws exactly what it drew over rows.

    Args:
        func: the partitioner's name, for error messages.
        table: the manifest.
        group_column: the grouping column, or ``None`` (see :func:`_groups_of`).

    Attributes:
        ids: ``int64`` group index of each row.
        size: ``int64`` rows of each group.
        count: number of groups.
        grouped: whether some group has more than one row.
        unit: ``"rows"``, or e.g. ``"subject_id groups"`` when ``grouped``, for messages.
        dealt: ``""``, or a clause saying that whole groups were dealt, for messages.
    """

    def __init__(self, func: str, table: pd.DataFrame, group_column: str | None) -> None:
        raw = _groups_of(func, table, group_column)
        _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        self.ids = rank[inverse.ravel()]
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

    def rows(self, gids: np.ndarray) -> int:
        """Number of rows of the groups ``gids``."""
        return int(self.size[np.asarray(gids, dtype=np.int64)].sum())

    def finish(self, buckets: list[list[np.ndarray]] | list[np.ndarray],
               names: list[str] | None = None) -> Partition:
        """The :class:`Partition` giving client ``i`` every row of its groups ``buckets[i]``."""
        owner = np.full(self.count, -1, dtype=np.int64)
        for i, bucket in enumerate(buckets):
            for piece in bucket if isinstance(bucket, list) else [bucket]:
                owner[np.asarray(piece, dtype=np.int64)] = i
        row_owner = owner[self.ids]
        return _finish([np.flatnonzero(row_owner == i) for i in range(len(buckets))], names=names)


# --------------------------------------------------------------------------- partitioners


def _check_min_size_possible(func: str, min_size: int, num_clients: int, n: int) -> None:
    """Fail at once when ``min_size`` rows for each client exceed the table."""
    if min_size * num_clients > n:
        raise _fail(
            func, f"impossible: min_size={min_size} for each of num_clients={num_clients} "
            f"clients needs {min_size * num_clients} rows but the table has {n}; "
            "use a smaller min_size or fewer clients",
        )


def dirichlet(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    min_size: int = 10,
    max_retries: int = 100,
    balance: bool = True,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
) -> Partition:
    """Label-distribution skew: per-class client proportions drawn from a Dirichlet.

    The usual split of Hsu et al. (2019) as implemented in NIID-Bench / FedLab: for every
    class, its rows are shuffled, proportions ``p ~ Dir(alpha * 1)`` over the clients are
    drawn and the rows are cut at the cumulative proportions. With ``balance`` (the common
    implementation's trick), clients already holding ``>= len(table) / num_clients`` rows get
    proportion zero for the classes still to come, which keeps client sizes from running
    away. The whole draw is repeated until every client has at least ``min_size`` rows.

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: the
    class's *groups* are shuffled, each counted for its most frequent label (ties: the
    largest), and cut at the group boundary nearest to each cumulative proportion of the
    class's rows. A client's share of a class is then off by at most half a group per cut,
    and a group of mixed labels brings its minority rows along; sizes, the ``balance`` cap
    and ``min_size`` count rows. With one row per group the draw is the row-level one.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        alpha: Dirichlet concentration (> 0); small values give more skew. Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``10``.
        max_retries: maximum number of whole draws (>= 1). Default: ``100``.
        balance: zero the proportion of clients already holding ``>= N / num_clients`` rows.
            Default: ``True``.
        group_column: rows sharing its value are dealt together; ``None`` deals rows one
            by one; the default ``"subject_id"`` may be absent (then rows). A blank cell
            (NaN) makes its row a group of its own. Default: ``"subject_id"``.

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``,
            when there are fewer groups than clients, or when no draw within
            ``max_retries`` gives every client ``min_size`` rows.
    """
    func = "dirichlet"
    _check_table(func, table)
    n = len(table)
    groups = _Groups(func, table, group_column)
    num_clients = groups.check_clients(func, num_clients)
    alpha = _check_positive(func, "alpha", alpha)
    min_size = _check_int(func, "min_size", min_size, 0)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    _check_min_size_possible(func, min_size, num_clients, n)
    glabels = groups.labels(_labels(func, table))
    rng = _rng(func, seed)
    class_groups = [np.flatnonzero(glabels == c) for c in np.unique(glabels)]
    cap = n / num_clients
    conc = np.full(num_clients, alpha)
    best = -1
    for _ in range(max_retries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for gids in class_groups:
            gids = rng.permutation(gids)
            p = rng.dirichlet(conc)
            if balance:
                p = p * (sizes < cap)
            total = p.sum()
            if not np.isfinite(total) or total <= 0:
                # Every eligible proportion underflowed to 0 (tiny alpha): fall back to
                # a uniform split over the eligible clients.
                p = (sizes < cap).astype(float) if balance else np.ones(num_clients)
                total = p.sum()
            p = p / total
            cuts = (np.cumsum(p) * groups.rows(gids)).astype(np.int64)[:-1]
            for i, piece in enumerate(groups.cut(gids, cuts)):
                buckets[i].append(piece)
                sizes[i] += groups.rows(piece)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return groups.finish(buckets)
        best = max(best, smallest)
    raise _fail(
        func, f"impossible to give each of {num_clients} clients min_size={min_size} rows "
        f"with alpha={alpha} in max_retries={max_retries} draws (smallest client size "
        f"reached: {best}{groups.dealt}); use a larger alpha or a smaller min_size",
    )


def label_skew(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    k: int = 2,
    allow_unassigned: bool = False,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
) -> Partition:
    """Quantity-based label skew ``#C=k`` (Li et al. 2022, "Federated Learning on Non-IID
    Data Silos"): every client owns ``k`` distinct labels.

    Client ``i`` first owns label ``i % K`` (labels in sorted order, ``K`` distinct labels).
    Its other ``k - 1`` labels are drawn at random among its not-yet-owned labels, except
    that labels nobody owns yet are handed out first (round-robin over the clients), so
    every label has an owner whenever ``num_clients * k >= K``. Each label's rows are
    shuffled and split as evenly as possible among its owners; a client therefore holds
    exactly ``k`` labels when every label has at least as many rows as owners.

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: a
    group counts for its most frequent label (ties: the largest), the labels are those of
    the groups, and a label's shuffled groups are cut at the group boundaries nearest to an
    even split of its rows. A group of mixed labels brings its minority rows along, so a
    client may hold a few rows of labels it does not own. With one row per group this is
    the row-level split.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        k: labels per client, ``1 <= k <= K``. Default: ``2``.
        allow_unassigned: when some label is owned by no client (only possible if
            ``num_clients * k < K``), drop its rows instead of raising. This is the only
            partitioner option that leaves rows unassigned. Default: ``False``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when labels are left without owner and
            ``allow_unassigned`` is false, or when a client ends up with no rows (its
            labels have fewer rows, or groups, than owners).
    """
    func = "label_skew"
    _check_table(func, table)
    groups = _Groups(func, table, group_column)
    num_clients = groups.check_clients(func, num_clients)
    labels = groups.labels(_labels(func, table))
    classes = np.unique(labels)
    num_classes = len(classes)
    k = _check_int(func, "k", k, 1, num_classes,
                   why=f" (the table has {num_classes} distinct labels)")
    rng = _rng(func, seed)

    owned: list[list[int]] = [[i % num_classes] for i in range(num_clients)]
    unowned = [c for c in range(num_classes) if c >= num_clients]
    unowned = [unowned[j] for j in rng.permutation(len(unowned))]
    for _slot in range(1, k):
        for i in range(num_clients):
            if unowned:
                owned[i].append(unowned.pop())
            else:
                choices = np.setdiff1d(np.arange(num_classes), owned[i])
                owned[i].append(int(rng.choice(choices)))

    owners: list[list[int]] = [[] for _ in range(num_classes)]
    for i, mine in enumerate(owned):
        for c in mine:
            owners[c].append(i)
    orphan = [classes[c].item() for c in range(num_classes) if not owners[c]]
    if orphan and not allow_unassigned:
        raise _fail(
            func, f"labels {orphan} are owned by no client (num_clients={num_clients} * "
            f"k={k} < {num_classes} labels); use more clients, a larger k, or "
            "allow_unassigned=True to drop their rows",
        )

    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, cls in enumerate(classes):
        if not owners[c]:
            continue
        gids = rng.permutation(np.flatnonzero(labels == cls))
        # Shuffle the owners too, so the larger pieces do not always go to low client ids.
        mine = rng.permutation(owners[c])
        for i, piece in zip(mine, groups.cut(gids, _even_cuts(groups.rows(gids), len(mine)))):
            buckets[i].append(piece)
    parts = groups.finish(buckets)
    empty = [cid for cid, pos in parts.items() if len(pos) == 0]
    if empty:
        raise _fail(
            func, f"clients {empty} got no rows: their labels have fewer {groups.unit} than owners; "
            "use fewer clients or a larger k",
        )
    return parts


def quantity_skew(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    beta: float = 0.5,
    min_size: int = 1,
    max_retries: int = 100,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
) -> Partition:
    """Quantity skew: client sizes from ``Dir(beta)`` proportions, labels iid.

    The rows are shuffled once; client sizes are then drawn as ``Dir(beta * 1)``
    proportions of ``len(table)`` (cut at the cumulative proportions), redrawing until every
    client has at least ``min_size`` rows.

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: the
    groups are shuffled and cut at the group boundary nearest to each cumulative proportion
    of the rows, so a client's size is off by at most half a group per cut; ``min_size``
    counts rows. With one row per group this is the row-level split.

    Args:
        table: manifest (a ``label`` column is required for consistency but not used).
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        beta: Dirichlet concentration (> 0); small values give more unequal sizes.
            Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``1``.
        max_retries: maximum number of size draws (>= 1). Default: ``100``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``,
            when there are fewer groups than clients, or when no draw within
            ``max_retries`` satisfies ``min_size``.
    """
    func = "quantity_skew"
    _check_table(func, table)
    n = len(table)
    groups = _Groups(func, table, group_column)
    num_clients = groups.check_clients(func, num_clients)
    beta = _check_positive(func, "beta", beta)
    min_size = _check_int(func, "min_size", min_size, 0)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    _check_min_size_possible(func, min_size, num_clients, n)
    rng = _rng(func, seed)
    perm = rng.permutation(groups.count)
    conc = np.full(num_clients, beta)
    best = -1
    for _ in range(max_retries):
        p = rng.dirichlet(conc)
        total = p.sum()
        if not np.isfinite(total) or total <= 0:
            continue
        cuts = (np.cumsum(p / total) * n).astype(np.int64)[:-1]
        cuts = np.clip(cuts, 0, n)
        pieces = groups.cut(perm, cuts)
        smallest = min(groups.rows(piece) for piece in pieces)
        if smallest >= min_size:
            return groups.finish(pieces)
        best = max(best, smallest)
    raise _fail(
        func, f"impossible to give each of {num_clients} clients min_size={min_size} rows "
        f"with beta={beta} in max_retries={max_retries} draws (smallest client size "
        f"reached: {best}{groups.dealt}); use a larger beta or a smaller min_size",
    )


def iid(table: pd.DataFrame, num_clients: int, seed: int,
        group_column: str | None = DEFAULT_GROUP_COLUMN) -> Partition:
    """Uniform random split into clients of equal size (sizes differ by at most one).

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: the
    groups are shuffled and cut at the group boundaries nearest to an even split of the
    rows (every client getting at least one group), so sizes differ by up to about one
    group instead of one row. With one row per group this is the row-level split.

    Args:
        table: manifest (a ``label`` column is required for consistency but not used).
        num_clients: number of clients (``1 <= num_clients <= len(table)``, or the number
            of groups when grouped).
        seed: seed for :func:`numpy.random.default_rng`.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, or fewer groups than clients.
    """
    func = "iid"
    _check_table(func, table)
    groups = _Groups(func, table, group_column)
    num_clients = groups.check_clients(func, num_clients)
    rng = _rng(func, seed)
    return groups.finish(groups.cut(rng.permutation(groups.count), _even_cuts(len(table), num_clients),
                                    nonempty=True))


def natural(
    table: pd.DataFrame,
    num_clients: int | None = 0,
    seed: int | None = 0,
    column: str = "site",
    mapping: Mapping[Any, str] | None = None,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
) -> Partition:
    """Natural split: one client per distinct value of ``column`` (e.g. hospital site).

    Values are first mapped through ``mapping`` when given (e.g. site -> region, so that
    several sites form one client). Clients are ordered by sorted group name; their ids
    are ``"0"``, ``"1"``, ... and the group names are in :attr:`Partition.names`.

    ``column`` keeps a subject's rows together whenever a subject is seen at one site only.
    A ``group_column`` group whose rows carry several (mapped) values goes whole to the
    client of its most frequent value (ties: the first in sorted order); the clients stay
    those of the values, and one that loses every row this way is an error.

    Args:
        table: manifest with the ``column`` column (and ``label``).
        num_clients: must equal the number of groups; ``0`` or ``None`` means "as many as
            there are groups". Default: ``0``.
        seed: unused (the split is fixed by the data); accepted for the common signature.
            Default: ``0``.
        column: grouping column. Default: ``"site"``.
        mapping: value -> group name; every value present in ``column`` must be a key
            (looked up as is, then as ``str(value)``). Default: ``None`` (groups are the
            values themselves, as strings).
        group_column: rows sharing its value go to one client (``None``: ``column``
            alone decides; the default ``"subject_id"`` may be absent).

    Returns:
        The :class:`Partition`, clients named after their groups.

    Raises:
        PartitionError: when the column is missing or has missing values, values are absent
            from ``mapping``, ``num_clients`` differs from the number of groups, or a client
            loses all its rows to the clients of its subjects' other rows.
    """
    func = "natural"
    if not isinstance(column, str):
        raise _fail(func, f"column must be a column name (str), got {column!r}")
    _check_table(func, table, ("label", column))
    if num_clients is None:
        num_clients = 0
    num_clients = _check_int(func, "num_clients", num_clients, 0,
                             why=" (0 or None: as many clients as groups)")
    values = table[column]
    if values.isna().any():
        raise _fail(func, f"column {column!r} has {int(values.isna().sum())} missing value(s)")
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise _fail(func, f"mapping must be a dict of value -> group, got "
                        f"{type(mapping).__name__}")
        unknown: list[Any] = []
        groups = []
        for value in values.to_numpy():
            if value in mapping:
                groups.append(str(mapping[value]))
            elif str(value) in mapping:
                groups.append(str(mapping[str(value)]))
            else:
                groups.append("")
                if value not in unknown:
                    unknown.append(value)
        if unknown:
            raise _fail(
                func, f"values of column {column!r} missing from mapping: "
                f"{sorted(map(str, unknown))}; mapping has keys {sorted(map(str, mapping))}",
            )
        group_arr = np.asarray(groups, dtype=object)
    else:
        group_arr = values.astype(str).to_numpy(dtype=object)
    names = sorted(set(group_arr.tolist()))
    if num_clients not in (0, len(names)):
        raise _fail(
            func, f"num_clients={num_clients} but column {column!r} has {len(names)} groups "
            f"{names}; use num_clients={len(names)} or 0",
        )
    subjects = _Groups(func, table, group_column)
    if subjects.grouped:
        group_arr = _majority_value(group_arr, subjects.ids)
    buckets = [np.flatnonzero(group_arr == name) for name in names]
    lost = [name for name, rows in zip(names, buckets) if not len(rows)]
    if lost:
        raise _fail(func, f"clients {lost} of column {column!r} lose every row to other clients: each of their "
                    f"{subjects.unit} has most of its rows elsewhere; use group_column null or another mapping")
    return _finish(buckets, names=names)


def _majority_value(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``values`` with every group's rows given the group's most frequent value (ties: the
    first in sorted order), for :func:`natural`."""
    frame = pd.DataFrame({"g": ids, "v": values})
    counts = frame.groupby(["g", "v"], sort=True).size().reset_index(name="n")
    # stable sort by count, descending: the first row of each group is its most frequent value
    best = counts.sort_values(["g", "n"], ascending=[True, False], kind="stable").drop_duplicates("g")
    chosen = pd.Series(best["v"].to_numpy(), index=best["g"].to_numpy())
    return chosen.reindex(ids).to_numpy(dtype=object)


def subset(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    share: float = 0.9,
    minor_fraction: float | None = None,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
) -> Partition:
    """Extreme quantity skew, "Subset" (FedTPF, after FedFed): one class makes up at least
    ``share`` of each client's data.

    Each client gets a dominant class: the classes in a seeded order, dealt round-robin over
    the clients (so with ``num_clients >= K`` every class dominates some client). Of each
    dominated class, ``minor_fraction`` of its rows (default ``0.9 * (1 - share)``) go to a
    common minor pool and the rest is split evenly among the clients it dominates; a class
    that dominates no client goes to the pool whole. The pool's rows are then dealt, in a
    seeded order, to clients of another dominant class, each time to the client with the
    most room left, a client's room being ``floor(dominant rows * (1 - share) / share)`` so its
    dominant class keeps at least ``share`` of its rows. Every row is assigned.

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: a
    group counts for its most frequent label (ties: the largest), shares and room count the
    rows of the groups of each label, the pool takes the groups up to the boundary nearest
    ``minor_fraction`` of a class's rows, and a pooled group goes whole to the client with
    the most room, which must fit all of it; a pooled group that fits nowhere (the room
    left is cut into pieces smaller than it) goes back to a client its label dominates. A
    group of mixed labels brings its minority rows along, so ``share`` then holds for the
    groups' labels rather than every row's.
    With one row per group this is the row-level split.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients.
        seed: seed for :func:`numpy.random.default_rng`.
        share: the dominant class's least share of each client, in (0, 1) (paper: "over 90%").
        minor_fraction: share of each dominated class given to other clients, in [0, 1 - share];
            default ``0.9 * (1 - share)``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, a client without rows of its dominant class, or a
            pool that does not fit in the clients' room (e.g. fewer clients than classes and a
            large undominated class); the message gives the sizes.
    """
    func = "subset"
    _check_table(func, table)
    groups = _Groups(func, table, group_column)
    num_clients = groups.check_clients(func, num_clients)
    if not isinstance(share, Real) or isinstance(share, bool) or not 0 < share < 1:
        raise _fail(func, f"share must be a number in (0, 1), got {share!r}")
    share = float(share)
    if minor_fraction is None:
        minor_fraction = 0.9 * (1 - share)
    if (not isinstance(minor_fraction, Real) or isinstance(minor_fraction, bool)
            or not 0 <= minor_fraction <= 1 - share):
        raise _fail(func, f"minor_fraction must be in [0, 1 - share = {1 - share:g}], got {minor_fraction!r}")
    labels = groups.labels(_labels(func, table))
    classes = np.unique(labels)
    rng = _rng(func, seed)
    order = classes[rng.permutation(len(classes))]
    dominant = [order[i % len(order)] for i in range(num_clients)]
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    pool: list[np.ndarray] = []
    for c in classes:
        gids = rng.permutation(np.flatnonzero(labels == c))
        owners = [i for i in range(num_clients) if dominant[i] == c]
        if not owners:
            pool.append(gids)
            continue
        minor, mine = groups.cut(gids, [int(math.floor(minor_fraction * groups.rows(gids)))])
        pool.append(minor)
        for i, piece in zip(owners, groups.cut(mine, _even_cuts(groups.rows(mine), len(owners)), nonempty=True)):
            buckets[i].append(piece)
    dom_rows = np.array([sum(groups.rows(p) for p in b) for b in buckets])
    empty = [str(i) for i in range(num_clients) if dom_rows[i] == 0]
    if empty:
        raise _fail(func, f"clients {empty} get no rows of their dominant class (it has fewer rows than the "
                    "clients it dominates); use fewer clients")
    room = np.floor(dom_rows * (1 - share) / share).astype(np.int64)
    total_room = int(room.sum())
    left = [gids for gids in pool if len(gids)]
    pooled = np.concatenate(left) if left else np.zeros(0, np.int64)
    pooled = pooled[rng.permutation(len(pooled))]
    extra: list[list[int]] = [[] for _ in range(num_clients)]
    dom_arr = np.asarray(dominant)
    for g in pooled:
        size = int(groups.size[g])
        free = np.where(dom_arr != labels[g], room, -1)
        i = int(np.argmax(free))
        home = np.flatnonzero(dom_arr == labels[g])
        if free[i] >= size:
            room[i] -= size
        elif groups.grouped and len(home):
            # a whole group that fits nowhere else (the room left is cut into pieces smaller
            # than a group) goes back to a client its label dominates: its share only grows
            i = int(home[np.argmax(room[home])])
            room[i] += (int(math.floor((dom_rows[i] + size) * (1 - share) / share))
                        - int(math.floor(dom_rows[i] * (1 - share) / share)))
            dom_rows[i] += size
        else:
            raise _fail(func, f"the {groups.rows(pooled)} rows for the minor classes do not fit: each client may "
                        f"hold {(1 - share) / share:.3f} x its dominant rows of other classes (room {total_room} "
                        f"in all{groups.dealt}); use more clients (every class then dominates one), a smaller "
                        "share or a smaller minor_fraction")
        extra[i].append(int(g))
    for i in range(num_clients):
        buckets[i].append(np.asarray(extra[i], dtype=np.int64))
    return groups.finish(buckets)


def _pair(func: str, name: str, value: Any, low: int, high: int | None = None) -> tuple[int, int]:
    """``[lo, hi]`` (or one integer for both) as two integers with ``low <= lo <= hi``."""
    pair = [value, value] if _is_int(value) else value
    ok = (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_int(v) for v in pair)
          and low <= pair[0] <= pair[1] and (high is None or pair[1] <= high))
    if not ok:
        top = "" if high is None else f" and hi <= {high}"
        raise _fail(func, f"{name} must be [lo, hi] integers with {low} <= lo <= hi{top} (or one integer), "
                    f"got {value!r}")
    return int(pair[0]), int(pair[1])


def class_sample(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    classes: int | list[int] = (5, 6),
    per_class: int | list[int] = (20, 60),
    group_column: str | None = "subject_id",
    rest: str | None = "global_test",
    max_retries: int = 100,
) -> Partition:
    """Few classes, few samples each; the rest is test: the NIID-2 split of FedSDC (after
    FedDisco, Ye et al. 2023).

    Each client in turn draws how many classes it holds, uniformly in ``classes`` (FedSDC:
    5 to 6), picks that many distinct classes at random among those that still have at
    least ``per_class[0]`` unassigned rows, and for each draws a sample size uniformly in
    ``per_class`` (FedSDC: 20 to 60) and takes that many of the class's unassigned rows at
    random (all of them when fewer remain). Rows are taken in whole groups (``group_column``,
    one lesion's or patient's images), so a size is rounded up to the group that crosses it
    and no group is split between a client and the test set. Rows no client takes are, with
    ``rest="global_test"``, the held-out global test set (the engine appends them to it;
    FedSDC: "the remaining samples are used for testing"), or dropped with ``rest=None``.
    A whole draw is repeated (up to ``max_retries``) when some client finds too few classes
    left.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients.
        seed: seed for :func:`numpy.random.default_rng`.
        classes: ``[lo, hi]`` classes per client (or one number), ``1 <= lo <= hi <= K``.
        per_class: ``[lo, hi]`` rows per class and client (or one number), ``lo >= 1``.
        group_column: rows sharing this column's value move together (``None``: every row
            on its own; the default ``subject_id`` may be absent; with one row per value the
            draw is the one of ``None``; a blank cell is a group of its own).
        rest: ``"global_test"`` (default) or ``None`` (drop the rows no client takes).
        max_retries: maximum number of whole draws (>= 1).

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``, with :attr:`Partition.rest`.

    Raises:
        PartitionError: on bad parameters, or when no draw within ``max_retries`` finds every
            client enough classes with ``per_class[0]`` rows left (the message says how many
            rows the request needs at least and how many the classes hold).
    """
    func = "class_sample"
    _check_table(func, table)
    n = len(table)
    num_clients = _check_clients(func, num_clients, n)
    labels = _labels(func, table)
    values = np.unique(labels)
    c_lo, c_hi = _pair(func, "classes", classes, 1, len(values))
    s_lo, s_hi = _pair(func, "per_class", per_class, 1)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    if rest not in REST_ROLES:
        raise _fail(func, f"rest must be 'global_test' or null (drop the rows no client takes), got {rest!r}")
    groups = _groups_of(func, table, group_column)
    if len(groups) and int(groups.max()) + 1 == n:   # one row per group: draw over rows, as with None
        groups = np.arange(n)
    glabel = _group_labels(labels, groups)
    gsize = np.bincount(groups, minlength=len(glabel))
    rng = _rng(func, seed)
    for _ in range(max_retries):
        pools = {c: list(rng.permutation(np.flatnonzero(glabel == c))) for c in values}
        left = {c: int(gsize[pools[c]].sum()) for c in values}
        taken: list[list[int]] = []
        for _client in range(num_clients):
            k = int(rng.integers(c_lo, c_hi + 1))
            eligible = [c for c in values if left[c] >= s_lo]
            if len(eligible) < k:
                break
            mine: list[int] = []
            for c in rng.choice(np.asarray(eligible), size=k, replace=False):
                want, got = int(rng.integers(s_lo, s_hi + 1)), 0
                while pools[c] and got < want:
                    g = pools[c].pop()
                    mine.append(g)
                    got += int(gsize[g])
                left[c] -= got
            taken.append(mine)
        else:
            member = np.full(len(glabel), -1)
            for i, mine in enumerate(taken):
                member[mine] = i
            owner = member[groups]
            return Partition({str(i): np.flatnonzero(owner == i).astype(np.int64) for i in range(num_clients)},
                             rest=rest)
    counts = {values[j].item(): int((labels == values[j]).sum()) for j in range(len(values))}
    raise _fail(func, f"impossible: {num_clients} clients of {c_lo}-{c_hi} classes with at least {s_lo} rows "
                f"each need at least {num_clients * c_lo * s_lo} rows spread over enough classes; the "
                f"classes hold {counts} (no draw worked in max_retries={max_retries}); use fewer clients, "
                "fewer classes per client or a smaller per_class")


def per_class_holdout(labels: np.ndarray, groups: np.ndarray | None, per_class: int, seed: int) -> np.ndarray:
    """Row positions of a test set of ``per_class`` rows of every class (NIID-1 of FedSDC,
    after FedDisco: "30 samples per class are reserved for testing").

    Whole groups (one patient's or lesion's rows) are taken, each counted for its most
    frequent label, in a seeded random order: first every group that still fits within
    ``per_class``, then, when the class is still short, the smallest remaining groups until
    it has ``per_class`` rows (so a class may get a few more than ``per_class``, never fewer).

    Args:
        labels: 1-D class labels, one per row.
        groups: 1-D group keys, one per row, or ``None`` (every row its own group).
        per_class: rows to hold out per class (>= 1).
        seed: seed for :func:`numpy.random.default_rng`.

    Returns:
        Sorted ``int64`` row positions.

    Raises:
        PartitionError: ``per_class`` is not a positive integer, or a class has no more than
            ``per_class`` rows (nothing would be left to train on; the message lists them).
    """
    func = "per_class_holdout"
    labels = np.asarray(labels)
    per_class = _check_int(func, "per_class", per_class, 1)
    keys = np.arange(len(labels)) if groups is None else np.unique(np.asarray(groups).astype(str),
                                                                   return_inverse=True)[1]
    glabel = _group_labels(labels, keys)
    gsize = np.bincount(keys, minlength=len(glabel))
    values, counts = np.unique(labels, return_counts=True)
    short = {v.item(): int(c) for v, c in zip(values, counts) if c <= per_class}
    if short:
        raise _fail(func, f"per_class={per_class} test rows per class leave no training rows for class(es) "
                    f"{short} (rows per class); expected every class to hold more than {per_class}")
    rng = _rng(func, seed)
    chosen = np.zeros(len(glabel), dtype=bool)
    for c in values:
        order = rng.permutation(np.flatnonzero(glabel == c))
        got = 0
        for g in order:
            if got + gsize[g] <= per_class:
                chosen[g] = True
                got += int(gsize[g])
        for g in sorted((g for g in order if not chosen[g]), key=lambda g: (gsize[g], g)):
            if got >= per_class:
                break
            chosen[g] = True
            got += int(gsize[g])
    return np.flatnonzero(chosen[keys]).astype(np.int64)


#: The built-in partitioners by name.
PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "dirichlet": dirichlet,
    "label_skew": label_skew,
    "quantity_skew": quantity_skew,
    "iid": iid,
    "natural": natural,
    "class_sample": class_sample,
    "subset": subset,
}


# --------------------------------------------------------------------------- tables


def partition_table(table: pd.DataFrame, parts: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """The saved form of a partition: one line per assigned row.

    Args:
        table: the partitioned manifest (``label`` column required).
        parts: the partition (a :class:`Partition` or plain ``dict``; names default to
            ``"client_<id>"``).

    Returns:
        A frame with columns ``row`` (position in ``table``), ``client_id``,
        ``client_name``, ``label`` and, when ``table`` has one, ``sample_id``; sorted by
        client (in ``parts`` order) then row.

    Raises:
        PartitionError: if ``table`` lacks ``label`` or a position is out of range or
            assigned twice.
    """
    _check_table("partition_table", table)
    checked = check_partition(parts, len(table), complete=False)
    ids = list(checked.keys())
    lengths = [len(pos) for pos in checked.values()]
    rows = (np.concatenate(list(checked.values())) if checked
            else np.empty(0, dtype=np.int64))
    out = pd.DataFrame({
        "row": rows.astype(np.int64),
        "client_id": pd.Series(np.repeat(np.asarray(ids, dtype=object), lengths),
                               dtype=object),
        "client_name": pd.Series(
            np.repeat(np.asarray([checked.names[c] for c in ids], dtype=object), lengths),
            dtype=object),
    })
    out["label"] = table["label"].to_numpy()[rows]
    if "sample_id" in table.columns:
        out["sample_id"] = table["sample_id"].to_numpy()[rows]
    return out.reset_index(drop=True)


def partition_from_table(saved: pd.DataFrame) -> Partition:
    """Rebuild a :class:`Partition` from the output of :func:`partition_table`.

    Args:
        saved: frame with columns ``row`` and ``client_id`` (``client_name`` optional).

    Returns:
        The partition, clients in order of first appearance.

    Raises:
        PartitionError: if the columns are missing.
    """
    _check_table("partition_from_table", saved, ("row", "client_id"))
    ids = saved["client_id"].astype(str)
    order = list(dict.fromkeys(ids.tolist()))
    data = {cid: np.sort(saved.loc[ids == cid, "row"].to_numpy(dtype=np.int64))
            for cid in order}
    names = None
    if "client_name" in saved.columns:
        names = dict(zip(ids, saved["client_name"].astype(str)))
    return Partition(data, names=names)


def class_counts(table: pd.DataFrame, parts: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """Label counts per client.

    Args:
        table: the partitioned manifest (``label`` column required).
        parts: the partition.

    Returns:
        An ``int64`` frame indexed by client id (index name ``client_id``, in ``parts``
        order) with one column per label present in ``table`` (sorted; columns name
        ``label``), zeros included.
    """
    _check_table("class_counts", table)
    labels = _labels("class_counts", table)
    classes = np.unique(labels)
    checked = check_partition(parts, len(table), complete=False)
    counts = np.zeros((len(checked), len(classes)), dtype=np.int64)
    for i, pos in enumerate(checked.values()):
        if len(pos):
            idx = np.searchsorted(classes, labels[pos])
            np.add.at(counts[i], idx, 1)
    return pd.DataFrame(
        counts,
        index=pd.Index(list(checked.keys()), name="client_id"),
        columns=pd.Index(classes.tolist(), name="label"),
    )


# --------------------------------------------------------------------------- local splits


def stratified_split(labels: np.ndarray, fractions: Mapping[str, float],
                     seed: int) -> dict[str, np.ndarray]:
    """Split positions ``0 .. n-1`` into named parts, stratified by label.

    Each class's positions are shuffled and divided by largest-remainder rounding: every
    part gets ``floor(fraction * class_size)`` or one more; the leftover rows go to the
    parts with the largest remainders, counting remainders carried over from earlier
    classes, so that part totals also follow the fractions closely. Then every part with
    fraction > 0 that is still empty takes one row from the currently largest part
    (provided ``n`` is at least the number of such parts).

    Args:
        labels: 1-D array of class labels, one per row.
        fractions: part name -> fraction (>= 0), summing to 1 within ``1e-6``, e.g.
            ``{"train": 0.7, "val": 0.15, "test": 0.15}``.
        seed: seed for :func:`numpy.random.default_rng`.

    Returns:
        Part name -> sorted ``int64`` positions, in the order of ``fractions``; disjoint
        and complete.

    Raises:
        PartitionError: on bad ``labels``, ``fractions`` or ``seed``.
    """
    func = "stratified_split"
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise _fail(func, f"labels must be a 1-D array, got shape {labels.shape}")
    if not isinstance(fractions, Mapping) or not fractions:
        raise _fail(func, f"fractions must be a non-empty dict of name -> fraction, "
                    f"got {fractions!r}")
    names = [str(k) for k in fractions]
    if len(set(names)) != len(names):
        raise _fail(func, f"fractions has duplicate part names {names}")
    fr = []
    for name, f in fractions.items():
        if (not isinstance(f, Real) or isinstance(f, bool) or not math.isfinite(f)
                or f < 0):
            raise _fail(func, f"fractions[{name!r}] must be a finite number >= 0, got {f!r}")
        fr.append(float(f))
    frac = np.asarray(fr)
    if abs(frac.sum() - 1.0) > 1e-6:
        raise _fail(func, f"fractions must sum to 1 (within 1e-6), got {frac.sum():.8g} "
                    f"for {dict(zip(names, fr))}")
    frac = frac / frac.sum()
    rng = _rng(func, seed)
    n = len(labels)
    num_parts = len(names)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
    carry = np.zeros(num_parts)
    for cls in np.unique(labels) if n else []:
        rows = rng.permutation(np.flatnonzero(labels == cls))
        quota = frac * len(rows)
        alloc = np.floor(quota).astype(np.int64)
        left = len(rows) - int(alloc.sum())
        if left > 0:
            priority = (quota - alloc) + carry
            priority[frac == 0] = -np.inf
            # Stable: ties go to the earlier part.
            order = np.argsort(-priority, kind="stable")
            alloc[order[:left]] += 1
        carry += quota - alloc
        for j, piece in enumerate(np.split(rows, np.cumsum(alloc)[:-1])):
            pieces[j].append(piece)
    parts = [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in pieces]

    positive = [j for j in range(num_parts) if frac[j] > 0]
    if n >= len(positive):
        for j in positive:
            if len(parts[j]) == 0:
                sizes = np.array([len(p) for p in parts])
                donor = int(np.argmax(sizes))
                # Take a row of the donor's most common class, to disturb balance least.
                d_lab = labels[parts[donor]]
                vals, cnt = np.unique(d_lab, return_counts=True)
                top = vals[int(np.argmax(cnt))]
                where = np.flatnonzero(d_lab == top)[-1]
                parts[j] = parts[donor][where:where + 1]
                parts[donor] = np.delete(parts[donor], where)
    return {name: np.sort(p.astype(np.int64)) for name, p in zip(names, parts)}


def grouped_stratified_split(labels: np.ndarray, groups: np.ndarray, fractions: Mapping[str, float],
                             seed: int) -> dict[str, np.ndarray]:
    """:func:`stratified_split` of whole groups (e.g. patients): every row of a group lands
    in the same part, so no patient is in both a client's training and test data.

    Groups are stratified by their most frequent label (ties: the largest label, e.g.
    malignant over benign) and split with :func:`stratified_split`; part sizes therefore
    follow the fractions in groups, not rows. When every group has one row this is exactly
    :func:`stratified_split` of the rows.

    Args:
        labels: 1-D class labels, one per row.
        groups: 1-D group keys, one per row (any hashable values).
        fractions: part name -> fraction, as for :func:`stratified_split`.
        seed: seed.

    Returns:
        Part name -> sorted ``int64`` row positions; disjoint, complete, group-pure.

    Raises:
        PartitionError: ``groups`` and ``labels`` differ in length, or what
            :func:`stratified_split` raises.
    """
    labels = np.asarray(labels)
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise _fail("grouped_stratified_split", f"groups has shape {groups.shape}, labels {labels.shape}; "
                    "expected one group per row")
    keys, inverse = np.unique(groups.astype(str), return_inverse=True)
    if len(keys) == len(labels):
        return stratified_split(labels, fractions, seed)
    inverse = inverse.ravel()
    first = np.full(len(keys), len(labels), dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(len(labels)))
    order = np.argsort(first, kind="stable")  # groups in order of first appearance
    glabels = _group_labels(labels, inverse)
    parts = stratified_split(glabels[order], fractions, seed)
    out = {}
    for name, gpos in parts.items():
        chosen = np.zeros(len(keys), dtype=bool)
        chosen[order[gpos]] = True
        out[name] = np.flatnonzero(chosen[inverse]).astype(np.int64)
    return out
