"""Partitioners that skew labels or sizes by a random draw: :func:`dirichlet` (label
proportions from a Dirichlet), :func:`label_skew` (``#C=k`` labels per client, the shards
split), :func:`quantity_skew` (client sizes from a Dirichlet) and :func:`iid` (equal sizes).
Each deals whole ``group_column`` groups (:mod:`medfl.data.partition.groups`), takes ``table``
(the manifest; its integer ``label`` column is checked even where unused), ``num_clients`` (at
most one per row, or per group when grouped) and ``seed`` (of :func:`numpy.random.default_rng`),
and returns a :class:`Partition` of clients named ``"client_<i>"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from medfl.data.partition.base import Partition, _check_int, _check_positive, _fail, _labels, _rng
from medfl.data.partition.groups import DEFAULT_GROUP_COLUMN, _dealt_groups, _Groups

__all__ = ["dirichlet", "iid", "label_skew", "quantity_skew"]


def _check_redraws(func: str, min_size: Any, max_retries: Any, num_clients: int, n: int) -> tuple[int, int]:
    """``min_size`` and ``max_retries`` checked, failing at once when ``min_size`` rows for
    each client exceed the table's ``n``."""
    min_size = _check_int(func, "min_size", min_size, 0)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    if min_size * num_clients > n:
        raise _fail(
            func, f"impossible: min_size={min_size} for each of num_clients={num_clients} "
            f"clients needs {min_size * num_clients} rows but the table has {n}; "
            "use a smaller min_size or fewer clients",
        )
    return min_size, max_retries


def _redraw_min_size(func: str, groups: _Groups, draw: Callable[[], list[Any] | None], num_clients: int,
                     min_size: int, max_retries: int, knob: tuple[str, float]) -> Partition:
    """Deal and retry: the partition of the first of up to ``max_retries`` draws (``draw()``:
    each client's groups, or ``None`` for a failed draw) that gives every client ``min_size``
    rows. The failure names the smallest client size reached and the concentration ``knob``
    (name, value) to raise."""
    best = -1
    for _ in range(max_retries):
        buckets = draw()
        if buckets is None:
            continue
        smallest = min(groups.rows(bucket) for bucket in buckets)
        if smallest >= min_size:
            return groups.finish(buckets)
        best = max(best, smallest)
    name, value = knob
    raise _fail(
        func, f"impossible to give each of {num_clients} clients min_size={min_size} rows "
        f"with {name}={value} in max_retries={max_retries} draws (smallest client size "
        f"reached: {best}{groups.dealt}); use a larger {name} or a smaller min_size",
    )


def _dirichlet_draw(rng: np.random.Generator, groups: _Groups, class_groups: list[np.ndarray],
                    conc: np.ndarray, cap: float, balance: bool) -> list[list[np.ndarray]]:
    """One draw of :func:`dirichlet`: each client's pieces of the classes' groups, cut at
    proportions ``Dir(conc)``; with ``balance``, a client holding ``cap`` rows or more gets
    none of the classes still to come."""
    num_clients = len(conc)
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
    return buckets


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
        alpha: Dirichlet concentration (> 0); small values give more skew. Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``10``.
        max_retries: maximum number of whole draws (>= 1). Default: ``100``.
        balance: zero the proportion of clients already holding ``>= N / num_clients`` rows.
            Default: ``True``.
        group_column: rows sharing its value are dealt together; ``None`` deals rows one
            by one; the default ``"subject_id"`` may be absent (then rows). A blank cell
            (NaN) makes its row a group of its own. Default: ``"subject_id"``.

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``,
            when there are fewer groups than clients, or when no draw within
            ``max_retries`` gives every client ``min_size`` rows.
    """
    func = "dirichlet"
    groups, num_clients = _dealt_groups(func, table, num_clients, group_column)
    alpha = _check_positive(func, "alpha", alpha)
    min_size, max_retries = _check_redraws(func, min_size, max_retries, num_clients, len(table))
    glabels = groups.labels(_labels(func, table))
    rng = _rng(func, seed)
    class_groups = [np.flatnonzero(glabels == c) for c in np.unique(glabels)]
    conc, cap = np.full(num_clients, alpha), len(table) / num_clients
    return _redraw_min_size(func, groups, lambda: _dirichlet_draw(rng, groups, class_groups, conc, cap, balance),
                            num_clients, min_size, max_retries, ("alpha", alpha))


def _label_owners(rng: np.random.Generator, num_clients: int, num_classes: int, k: int) -> list[list[int]]:
    """:func:`label_skew`'s ownership: the clients owning each label (by index). Client ``i``
    owns label ``i % K`` first, then ``k - 1`` more, labels nobody owns handed out first."""
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
    return owners


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
        k: labels per client, ``1 <= k <= K``. Default: ``2``.
        allow_unassigned: when some label is owned by no client (only possible if
            ``num_clients * k < K``), drop its rows instead of raising. This is the only
            partitioner option that leaves rows unassigned. Default: ``False``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Raises:
        PartitionError: on bad parameters, when labels are left without owner and
            ``allow_unassigned`` is false, or when a client ends up with no rows (its
            labels have fewer rows, or groups, than owners).
    """
    func = "label_skew"
    groups, num_clients = _dealt_groups(func, table, num_clients, group_column)
    labels = groups.labels(_labels(func, table))
    classes = np.unique(labels)
    num_classes = len(classes)
    k = _check_int(func, "k", k, 1, num_classes,
                   why=f" (the table has {num_classes} distinct labels)")
    rng = _rng(func, seed)
    owners = _label_owners(rng, num_clients, num_classes, k)
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
        for i, piece in zip(mine, groups.even(gids, len(mine))):
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
        beta: Dirichlet concentration (> 0); small values give more unequal sizes.
            Default: ``0.5``.
        min_size: minimum rows per client (>= 0). Default: ``1``.
        max_retries: maximum number of size draws (>= 1). Default: ``100``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Raises:
        PartitionError: on bad parameters, when ``min_size * num_clients > len(table)``,
            when there are fewer groups than clients, or when no draw within
            ``max_retries`` satisfies ``min_size``.
    """
    func = "quantity_skew"
    groups, num_clients = _dealt_groups(func, table, num_clients, group_column)
    n = len(table)
    beta = _check_positive(func, "beta", beta)
    min_size, max_retries = _check_redraws(func, min_size, max_retries, num_clients, n)
    rng = _rng(func, seed)
    perm = rng.permutation(groups.count)
    conc = np.full(num_clients, beta)

    def draw() -> list[np.ndarray] | None:
        p = rng.dirichlet(conc)
        total = p.sum()
        if not np.isfinite(total) or total <= 0:
            return None
        return groups.cut(perm, np.clip((np.cumsum(p / total) * n).astype(np.int64)[:-1], 0, n))

    return _redraw_min_size(func, groups, draw, num_clients, min_size, max_retries, ("beta", beta))


def iid(table: pd.DataFrame, num_clients: int, seed: int,
        group_column: str | None = DEFAULT_GROUP_COLUMN) -> Partition:
    """Uniform random split into clients of equal size (sizes differ by at most one).

    Rows sharing ``group_column`` (one patient's or lesion's images) go to one client: the
    groups are shuffled and cut at the group boundaries nearest to an even split of the
    rows (every client getting at least one group), so sizes differ by up to about one
    group instead of one row. With one row per group this is the row-level split.

    Args:
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Raises:
        PartitionError: on bad parameters, or fewer groups than clients.
    """
    func = "iid"
    groups, num_clients = _dealt_groups(func, table, num_clients, group_column)
    rng = _rng(func, seed)
    return groups.finish(groups.even(rng.permutation(groups.count), num_clients, nonempty=True))
