"""Partitioners that follow a rule of the data or of a paper: :func:`natural` (one client per
value of a column such as ``site``), :func:`subset` (FedTPF's "Subset": one dominant class per
client) and :func:`class_sample` (FedSDC's NIID-2: few classes, few rows each, the rest is
test). Each deals whole ``group_column`` groups (:mod:`medfl.data.partition.groups`); in
:func:`subset` and :func:`class_sample`, ``table`` is the manifest (an integer ``label`` column),
``seed`` that of :func:`numpy.random.default_rng`, and clients are named ``"client_<i>"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from numbers import Real
from typing import Any

import numpy as np
import pandas as pd

from medfl.data.partition.base import (
    REST_ROLES, Partition, _check_clients, _check_int, _check_table, _fail, _finish, _is_int, _labels,
    _rng,
)
from medfl.data.partition.groups import DEFAULT_GROUP_COLUMN, _dealt_groups, _Groups

__all__ = ["class_sample", "natural", "subset"]


def _all_empty(table: pd.DataFrame, column: str) -> str:
    """Why ``natural`` cannot split a table whose ``column`` is empty in every row: the note
    of the data_prep report that left it empty where the table carries one
    (``table.attrs["prep_notes"]``, :func:`medfl.data.source.read_manifest`), else what to do."""
    said = [n for n in table.attrs.get("prep_notes", ()) if re.search(rf"\b{re.escape(column)}\b", n)]
    why = (f"data_prep's report.json says: {said[0]}" if said
           else "choose another partitioner (dirichlet, iid, ...) or fill the column")
    return f"column {column!r} is empty in every row: there is no {column} to make one client per value of; {why}"


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
    num_clients = _check_int(func, "num_clients", 0 if num_clients is None else num_clients, 0,
                             why=" (0 or None: as many clients as groups)")
    values = table[column]
    if values.isna().all():
        raise _fail(func, _all_empty(table, column))
    if values.isna().any():
        raise _fail(func, f"column {column!r} has {int(values.isna().sum())} missing value(s)")
    group_arr = _mapped(func, column, values, mapping)
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


def _mapped(func: str, column: str, values: pd.Series, mapping: Mapping[Any, str] | None) -> np.ndarray:
    """:func:`natural`'s client name of each row: ``mapping`` of its ``column`` value (looked
    up as is, then as ``str``), or the value as a string without ``mapping``."""
    if mapping is None:
        return values.astype(str).to_numpy(dtype=object)
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
    return np.asarray(groups, dtype=object)


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
        share: the dominant class's least share of each client, in (0, 1) (paper: "over 90%").
        minor_fraction: share of each dominated class given to other clients, in [0, 1 - share];
            default ``0.9 * (1 - share)``.
        group_column: rows sharing its value are dealt together, as for :func:`dirichlet`.
            Default: ``"subject_id"`` (rows one by one when the table has no such column).

    Raises:
        PartitionError: on bad parameters, a client without rows of its dominant class, or a
            pool that does not fit in the clients' room (e.g. fewer clients than classes and a
            large undominated class); the message gives the sizes.
    """
    func = "subset"
    groups, num_clients = _dealt_groups(func, table, num_clients, group_column)
    share, minor_fraction = _check_shares(func, share, minor_fraction)
    labels = groups.labels(_labels(func, table))
    classes = np.unique(labels)
    rng = _rng(func, seed)
    order = classes[rng.permutation(len(classes))]
    dominant = np.asarray([order[i % len(order)] for i in range(num_clients)])
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
        for i, piece in zip(owners, groups.even(mine, len(owners), nonempty=True)):
            buckets[i].append(piece)
    dom_rows = np.array([groups.rows(b) for b in buckets])
    empty = [str(i) for i in range(num_clients) if dom_rows[i] == 0]
    if empty:
        raise _fail(func, f"clients {empty} get no rows of their dominant class (it has fewer rows than the "
                    "clients it dominates); use fewer clients")
    extra = _deal_pool(func, groups, labels, dominant, dom_rows, pool, share, rng)
    for i in range(num_clients):
        buckets[i].append(np.asarray(extra[i], dtype=np.int64))
    return groups.finish(buckets)


def _check_shares(func: str, share: Any, minor_fraction: Any) -> tuple[float, float]:
    """:func:`subset`'s ``share`` and ``minor_fraction`` checked, the latter defaulted."""
    if not isinstance(share, Real) or isinstance(share, bool) or not 0 < share < 1:
        raise _fail(func, f"share must be a number in (0, 1), got {share!r}")
    share = float(share)
    if minor_fraction is None:
        minor_fraction = 0.9 * (1 - share)
    if (not isinstance(minor_fraction, Real) or isinstance(minor_fraction, bool)
            or not 0 <= minor_fraction <= 1 - share):
        raise _fail(func, f"minor_fraction must be in [0, 1 - share = {1 - share:g}], got {minor_fraction!r}")
    return share, minor_fraction


def _deal_pool(func: str, groups: _Groups, labels: np.ndarray, dominant: np.ndarray, dom_rows: np.ndarray,
               pool: list[np.ndarray], share: float, rng: np.random.Generator) -> list[list[int]]:
    """:func:`subset`'s minor pool dealt: each of its groups, in a seeded order, to the client
    of another dominant class with the most room, or back to one its label dominates when
    it fits nowhere. Returns each client's extra groups.

    Raises:
        PartitionError: a group fits nowhere and cannot go back (the pool does not fit)."""
    left = [gids for gids in pool if len(gids)]
    pooled = np.concatenate(left) if left else np.zeros(0, np.int64)
    pooled = pooled[rng.permutation(len(pooled))]
    room = np.floor(dom_rows * (1 - share) / share).astype(np.int64)
    total_room = int(room.sum())
    extra: list[list[int]] = [[] for _ in range(len(dominant))]
    for g in pooled:
        size = int(groups.size[g])
        free = np.where(dominant != labels[g], room, -1)
        i = int(np.argmax(free))
        home = np.flatnonzero(dominant == labels[g])
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
    return extra


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


def _sample_classes(rng: np.random.Generator, groups: _Groups, glabels: np.ndarray, values: np.ndarray,
                    num_clients: int, classes: tuple[int, int], per_class: tuple[int, int]) -> list[np.ndarray] | None:
    """One draw of :func:`class_sample`: each client's groups, or ``None`` when a client finds
    fewer classes than it drew with ``per_class[0]`` rows left."""
    pools = {c: list(rng.permutation(np.flatnonzero(glabels == c))) for c in values}
    left = {c: int(groups.size[pools[c]].sum()) for c in values}
    taken: list[np.ndarray] = []
    for _client in range(num_clients):
        k = int(rng.integers(classes[0], classes[1] + 1))
        eligible = [c for c in values if left[c] >= per_class[0]]
        if len(eligible) < k:
            return None
        mine: list[int] = []
        for c in rng.choice(np.asarray(eligible), size=k, replace=False):
            want, got = int(rng.integers(per_class[0], per_class[1] + 1)), 0
            while pools[c] and got < want:
                g = pools[c].pop()
                mine.append(g)
                got += int(groups.size[g])
            left[c] -= got
        taken.append(np.asarray(mine, dtype=np.int64))
    return taken


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
        classes: ``[lo, hi]`` classes per client (or one number), ``1 <= lo <= hi <= K``.
        per_class: ``[lo, hi]`` rows per class and client (or one number), ``lo >= 1``.
        group_column: rows sharing this column's value move together (``None``: every row
            on its own; the default ``subject_id`` may be absent; with one row per value the
            draw is the one of ``None``; a blank cell is a group of its own).
        rest: ``"global_test"`` (default) or ``None`` (drop the rows no client takes).
        max_retries: maximum number of whole draws (>= 1).

    Returns:
        The :class:`Partition`, with :attr:`Partition.rest`.

    Raises:
        PartitionError: on bad parameters, or when no draw within ``max_retries`` finds every
            client enough classes with ``per_class[0]`` rows left (the message says how many
            rows the request needs at least and how many the classes hold).
    """
    func = "class_sample"
    _check_table(func, table)
    num_clients = _check_clients(func, num_clients, len(table))
    labels = _labels(func, table)
    values = np.unique(labels)
    c_lo, c_hi = _pair(func, "classes", classes, 1, len(values))
    s_lo, s_hi = _pair(func, "per_class", per_class, 1)
    max_retries = _check_int(func, "max_retries", max_retries, 1)
    if rest not in REST_ROLES:
        raise _fail(func, f"rest must be 'global_test' or null (drop the rows no client takes), got {rest!r}")
    groups = _Groups(func, table, group_column, by_key=True)   # the draw follows the sorted keys
    glabels = groups.labels(labels)
    rng = _rng(func, seed)
    for _ in range(max_retries):   # deal, retry, finish
        taken = _sample_classes(rng, groups, glabels, values, num_clients, (c_lo, c_hi), (s_lo, s_hi))
        if taken is not None:
            return groups.finish(taken, rest=rest)
    counts = {values[j].item(): int((labels == values[j]).sum()) for j in range(len(values))}
    raise _fail(func, f"impossible: {num_clients} clients of {c_lo}-{c_hi} classes with at least {s_lo} rows "
                f"each need at least {num_clients * c_lo * s_lo} rows spread over enough classes; the "
                f"classes hold {counts} (no draw worked in max_retries={max_retries}); use fewer clients, "
                "fewer classes per client or a smaller per_class")
