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
row goes to exactly one client (disjoint and complete); the only exception is
:func:`label_skew` with ``allow_unassigned=True``, which drops the rows of labels no client
owns. Bad input raises :class:`PartitionError` naming the parameter and what was expected.

The built-in partitioners are listed in :data:`PARTITIONERS`. :func:`partition_table` turns a
partition into a table that can be saved (and :func:`partition_from_table` reads it back),
:func:`class_counts` tabulates labels per client, and :func:`stratified_split` splits one
client's rows into e.g. train/val/test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "grouped_stratified_split",
    "PARTITIONERS",
    "Partition",
    "PartitionError",
    "check_partition",
    "class_counts",
    "dirichlet",
    "iid",
    "label_skew",
    "natural",
    "partition_from_table",
    "partition_table",
    "quantity_skew",
    "stratified_split",
]


class PartitionError(ValueError):
    """A partition was requested with bad parameters, or cannot be produced."""


class Partition(dict[str, np.ndarray]):
    """Client id -> sorted ``int64`` row positions, plus human-readable client names.

    A plain ``dict`` in every respect (``parts["0"]``, ``len(parts)``, iteration in client
    order), with one extra attribute.

    Args:
        data: mapping or iterable of ``(client_id, positions)`` pairs. Default: empty.
        names: client id -> display name. Default: ``None``, meaning ``"client_<id>"`` for
            every client; ids missing from a given mapping also get ``"client_<id>"``.

    Attributes:
        names: client id -> display name (e.g. ``"EUROPE"`` for :func:`natural`,
            ``"client_0"`` for the other partitioners).
    """

    names: dict[str, str]

    def __init__(
        self,
        data: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]] = (),
        names: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(data)
        given = dict(names or {})
        self.names = {cid: str(given.get(cid, f"client_{cid}")) for cid in self}

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
    return Partition(data, names=names)


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
) -> Partition:
    """Label-distribution skew: per-class client proportions drawn from a Dirichlet.

    The usual split of Hsu et al. (2019) as implemented in NIID-Bench / FedLab: for every
    class, its rows are shuffled, proportions ``p ~ Dir(alpha * 1)`` over the clients are
    drawn and the rows are cut at the cumulative proportions. With ``balance`` (the common
    implementation's trick), clients already holding ``>= len(table) / num_clients`` rows get
    proportion zero for the classes still to come, which keeps client sizes from running
    away. The whole draw is repeated until every client has at least ``min_size`` rows.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        alpha: Dirichlet concentration (> 0); small values give more skew. Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``10``.
        max_retries: maximum number of whole draws (>= 1). Default: ``100``.
        balance: zero the proportion of clients already holding ``>= N / num_clients`` rows.
            Default: ``True``.

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``, or
            when no draw within ``max_retries`` gives every client ``min_size`` rows.
    """
    func = "dirichlet"
    _check_table(func, table)
    n = len(table)
    num_clients = _check_clients(func, num_clients, n)
    alpha = _check_positive(func, "alpha", alpha)
    min_size = _check_int(func, "min_size", min_size, 0)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    _check_min_size_possible(func, min_size, num_clients, n)
    labels = _labels(func, table)
    rng = _rng(func, seed)
    class_rows = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = n / num_clients
    conc = np.full(num_clients, alpha)
    best = -1
    for _ in range(max_retries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for rows in class_rows:
            rows = rng.permutation(rows)
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
            cuts = (np.cumsum(p) * len(rows)).astype(np.int64)[:-1]
            for i, piece in enumerate(np.split(rows, cuts)):
                buckets[i].append(piece)
                sizes[i] += len(piece)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _finish(buckets)
        best = max(best, smallest)
    raise _fail(
        func, f"impossible to give each of {num_clients} clients min_size={min_size} rows "
        f"with alpha={alpha} in max_retries={max_retries} draws (smallest client size "
        f"reached: {best}); use a larger alpha or a smaller min_size",
    )


def label_skew(
    table: pd.DataFrame,
    num_clients: int,
    seed: int,
    k: int = 2,
    allow_unassigned: bool = False,
) -> Partition:
    """Quantity-based label skew ``#C=k`` (Li et al. 2022, "Federated Learning on Non-IID
    Data Silos"): every client owns ``k`` distinct labels.

    Client ``i`` first owns label ``i % K`` (labels in sorted order, ``K`` distinct labels).
    Its other ``k - 1`` labels are drawn at random among its not-yet-owned labels, except
    that labels nobody owns yet are handed out first (round-robin over the clients), so
    every label has an owner whenever ``num_clients * k >= K``. Each label's rows are
    shuffled and split as evenly as possible among its owners; a client therefore holds
    exactly ``k`` labels when every label has at least as many rows as owners.

    Args:
        table: manifest with an integer ``label`` column.
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        k: labels per client, ``1 <= k <= K``. Default: ``2``.
        allow_unassigned: when some label is owned by no client (only possible if
            ``num_clients * k < K``), drop its rows instead of raising. This is the only
            partitioner option that leaves rows unassigned. Default: ``False``.

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when labels are left without owner and
            ``allow_unassigned`` is false, or when a client ends up with no rows (its
            labels have fewer rows than owners).
    """
    func = "label_skew"
    _check_table(func, table)
    n = len(table)
    num_clients = _check_clients(func, num_clients, n)
    labels = _labels(func, table)
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
        rows = rng.permutation(np.flatnonzero(labels == cls))
        # Shuffle the owners too, so the larger pieces do not always go to low client ids.
        mine = rng.permutation(owners[c])
        for i, piece in zip(mine, np.array_split(rows, len(mine))):
            buckets[i].append(piece)
    parts = _finish(buckets)
    empty = [cid for cid, pos in parts.items() if len(pos) == 0]
    if empty:
        raise _fail(
            func, f"clients {empty} got no rows: their labels have fewer rows than owners; "
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
) -> Partition:
    """Quantity skew: client sizes from ``Dir(beta)`` proportions, labels iid.

    The rows are shuffled once; client sizes are then drawn as ``Dir(beta * 1)``
    proportions of ``len(table)`` (cut at the cumulative proportions), redrawing until every
    client has at least ``min_size`` rows.

    Args:
        table: manifest (a ``label`` column is required for consistency but not used).
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.
        beta: Dirichlet concentration (> 0); small values give more unequal sizes.
            Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``1``.
        max_retries: maximum number of size draws (>= 1). Default: ``100``.

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``, or
            when no draw within ``max_retries`` satisfies ``min_size``.
    """
    func = "quantity_skew"
    _check_table(func, table)
    n = len(table)
    num_clients = _check_clients(func, num_clients, n)
    beta = _check_positive(func, "beta", beta)
    min_size = _check_int(func, "min_size", min_size, 0)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    _check_min_size_possible(func, min_size, num_clients, n)
    rng = _rng(func, seed)
    perm = rng.permutation(n)
    conc = np.full(num_clients, beta)
    best = -1
    for _ in range(max_retries):
        p = rng.dirichlet(conc)
        total = p.sum()
        if not np.isfinite(total) or total <= 0:
            continue
        cuts = (np.cumsum(p / total) * n).astype(np.int64)[:-1]
        cuts = np.clip(cuts, 0, n)
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _finish(list(np.split(perm, cuts)))
        best = max(best, smallest)
    raise _fail(
        func, f"impossible to give each of {num_clients} clients min_size={min_size} rows "
        f"with beta={beta} in max_retries={max_retries} draws (smallest client size "
        f"reached: {best}); use a larger beta or a smaller min_size",
    )


def iid(table: pd.DataFrame, num_clients: int, seed: int) -> Partition:
    """Uniform random split into clients of equal size (sizes differ by at most one).

    Args:
        table: manifest (a ``label`` column is required for consistency but not used).
        num_clients: number of clients (``1 <= num_clients <= len(table)``).
        seed: seed for :func:`numpy.random.default_rng`.

    Returns:
        The :class:`Partition`, clients named ``"client_<i>"``.

    Raises:
        PartitionError: on bad parameters.
    """
    func = "iid"
    _check_table(func, table)
    n = len(table)
    num_clients = _check_clients(func, num_clients, n)
    rng = _rng(func, seed)
    return _finish(list(np.array_split(rng.permutation(n), num_clients)))


def natural(
    table: pd.DataFrame,
    num_clients: int | None = 0,
    seed: int | None = 0,
    column: str = "site",
    mapping: Mapping[Any, str] | None = None,
) -> Partition:
    """Natural split: one client per distinct value of ``column`` (e.g. hospital site).

    Values are first mapped through ``mapping`` when given (e.g. site -> region, so that
    several sites form one client). Clients are ordered by sorted group name; their ids
    are ``"0"``, ``"1"``, ... and the group names are in :attr:`Partition.names`.

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

    Returns:
        The :class:`Partition`, clients named after their groups.

    Raises:
        PartitionError: when the column is missing or has missing values, values are absent
            from ``mapping``, or ``num_clients`` differs from the number of groups.
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
    buckets = [np.flatnonzero(group_arr == name) for name in names]
    return _finish(buckets, names=names)


#: The built-in partitioners by name.
PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "dirichlet": dirichlet,
    "label_skew": label_skew,
    "quantity_skew": quantity_skew,
    "iid": iid,
    "natural": natural,
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
    first = np.full(len(keys), len(labels), dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(len(labels)))
    order = np.argsort(first, kind="stable")  # groups in order of first appearance
    glabels = np.empty(len(keys), dtype=labels.dtype)
    for g in range(len(keys)):
        vals, counts = np.unique(labels[inverse == g], return_counts=True)
        glabels[g] = vals[counts == counts.max()].max()
    parts = stratified_split(glabels[order], fractions, seed)
    out = {}
    for name, gpos in parts.items():
        chosen = np.zeros(len(keys), dtype=bool)
        chosen[order[gpos]] = True
        out[name] = np.flatnonzero(chosen[inverse]).astype(np.int64)
    return out
