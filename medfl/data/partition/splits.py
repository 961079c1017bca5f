"""Splits of rows into roles rather than clients, keeping groups whole: :func:`stratified_split`
(one client's rows into e.g. train/val/test), :func:`grouped_stratified_split` (the same over
whole patients) and :func:`per_class_holdout` (a test set of a fixed number of rows per class,
the engine's ``global_test_per_class``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

import numpy as np

from medfl.data.partition.base import _check_int, _fail, _rng
from medfl.data.partition.groups import _group_labels

__all__ = ["grouped_stratified_split", "per_class_holdout", "stratified_split"]


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
