"""The label check: a client's label vectors looked for in an outgoing message.

Every tensor, list and the run of the message's numbers is read as 1-D sequences
(:func:`_label_candidates`: flattened, by columns, through the argmax of one-hot or
probability blocks, :func:`_block_shapes`), and each split's label vector (and its training
loader's orders) is searched in them (:func:`_search`); a match counts when its surprise
(:func:`_surprise`) reaches :data:`~medfl.guard.params.LABEL_MIN_BITS` plus the
multiple-testing correction. :class:`_LabelCheck` is that check as
:class:`~medfl.guard.ContentGuard` runs it.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from medfl.guard.index import _Index
from medfl.guard.params import LABEL_MIN_BITS
from medfl.guard.walk import _Floats, _Leaves

__all__: list[str] = []


def _runs(mask: np.ndarray, min_len: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of True of at least ``min_len``."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    starts, ends = np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]
    keep = (ends - starts) >= min_len
    return list(zip(starts[keep].tolist(), ends[keep].tolist()))


def _surprise(seq: np.ndarray, y: np.ndarray, pool: np.ndarray | None = None) -> float:
    """``-sum_i log2 q(y_i) - log2(len(seq) - n + 1)``, ``q`` the frequency of each value in
    ``pool`` (default ``seq``): for a run search, the label-like values of ``seq``, where
    alone a match can lie. Frequencies over the whole sequence would count the values that
    cannot be labels (most codes of a quantized update) as evidence: a run of 0/1 codes in
    such a tensor (an update's entries saturated at its minimum) matched a 39-sample split of
    38 zeros and a one at "25.5 bits" when its 0s and 1s were rare in the tensor but dense
    where the match was."""
    pool = seq if pool is None else pool
    vals, counts = np.unique(y, return_counts=True)
    bits = 0.0
    for v, c in zip(vals.tolist(), counts.tolist()):
        q = max(int(np.count_nonzero(pool == v)), 1) / max(len(pool), 1)
        bits -= c * math.log2(q)
    return bits - math.log2(len(seq) - len(y) + 1)


def _search(seq: np.ndarray, labels: list[tuple[str, np.ndarray]], whole: bool
            ) -> tuple[list[tuple[str, int, int, float]], int]:
    """Look for each label vector in ``seq``: as a contiguous run (``whole``: as the whole
    sequence). Returns the matches ``(description, start, length, surprise in bits)`` and
    the number of tests that could have matched by chance (label vectors that fit in a run
    of label-like values of ``seq``), for the multiple-testing correction."""
    if whole:
        usable = [(d, y) for d, y in labels if len(y) == len(seq)]
        found = [(d, 0, len(y), _surprise(seq, y)) for d, y in usable if np.array_equal(seq, y)]
        return found, len(usable)
    usable = [(d, y) for d, y in labels if len(y) <= len(seq)]
    if not usable:
        return [], 0
    lo = min(int(y.min()) for _, y in usable)
    hi = max(int(y.max()) for _, y in usable)
    if seq.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            mask = (seq >= lo) & (seq <= hi) & (seq == np.floor(seq))
    else:
        mask = (seq >= lo) & (seq <= hi)
    runs = _runs(mask, min(len(y) for _, y in usable))
    if not runs:
        return [], 0
    longest = max(b - a for a, b in runs)
    tests = sum(1 for _, y in usable if len(y) <= longest)
    found: dict[str, tuple[str, int, int, float]] = {}
    pool = seq[mask]
    patterns = [(d, y, np.ascontiguousarray(y, dtype=np.int64).tobytes()) for d, y in usable]
    for a, b in runs:
        seg = np.ascontiguousarray(seq[a:b]).astype(np.int64).tobytes()
        for desc, y, pat in patterns:
            if desc in found or len(y) > b - a:
                continue
            at = seg.find(pat)
            while at != -1 and at % 8:
                at = seg.find(pat, at + 1)
            if at != -1:
                found[desc] = (desc, a + at // 8, len(y), _surprise(seq, y, pool))
    return list(found.values()), tests


def _class_block(m: np.ndarray, axis: int) -> bool:
    """Whether a 2-D block looks like one-hot rows or class probabilities along ``axis``
    (non-negative, summing to 1): only such blocks are read through their argmax, since the
    argmax of arbitrary numbers is a fair coin that would match short label vectors."""
    if m.shape[axis] < 2 or m.dtype.kind not in "fiub":
        return False
    with np.errstate(invalid="ignore"):
        if not np.all(m >= 0):
            return False
        # ``np.allclose(sums, 1, atol=1e-3)`` without its per-call overhead (NaN fails both)
        return bool(np.max(np.abs(m.sum(axis=axis, dtype=np.float64) - 1.0)) <= 1e-3 + 1e-5)


def _block_shapes(shape: tuple[int, ...], sizes: set[int], one_d: bool) -> list[tuple[str, tuple[int, int]]]:
    """The 2-D blocks that :func:`_label_candidates` reads a value of ``shape`` as, each with
    its description: a 2-D shape itself (dimensions of 1 dropped); a vector (or ``one_d``
    value) of ``n * K`` values, ``n`` a label vector's length and ``2 <= K <= 1024``, as
    ``n`` rows of ``K`` and as ``K`` rows of ``n``; anything else none."""
    dims = [d for d in shape if d != 1]
    if len(dims) == 2:
        return [("", (dims[0], dims[1]))]
    if not (one_d or len(dims) <= 1):
        return []
    size = math.prod(shape)
    out = []
    for n in sizes:
        k = size // n
        if 2 <= k <= 1024 and k * n == size:
            out += [(f" (as {n} rows of {k})", (n, k)), (f" (as {k} rows of {n})", (k, n))]
    return out


def _label_candidates(arr: np.ndarray, sizes: set[int], one_d: bool, runs: bool = True
                      ) -> list[tuple[str, np.ndarray, bool]]:
    """The 1-D sequences of a tensor (or list) in which label vectors are looked for, and
    whether a label vector must fill the whole sequence: flattened (runs); a 2-D block also
    by columns (runs) and, when it holds one-hot rows or class probabilities, through its
    argmax (whole); a vector of ``n * K`` such values also as ``n`` rows of ``K`` (whole)
    (:func:`_block_shapes`). ``runs=False`` (the tensor holds too few label-like values for
    any run to match) leaves out the two run readings."""
    out = [("", arr.reshape(-1), False)] if runs else []
    blocks = [(how, arr.reshape(rc)) for how, rc in _block_shapes(arr.shape, sizes, one_d)]
    total = float(arr.sum(dtype=np.float64)) if blocks and arr.dtype.kind in "fiub" else math.nan
    for how, m in blocks:
        if runs and not how:   # the value itself is 2-D: read by columns too
            out.append((" (read by columns)", np.ascontiguousarray(m.T).reshape(-1), False))
        if m.shape[0] in sizes and _may_sum_to(total, m.shape[0]) and _class_block(m, 1):
            out.append((f"{how} (argmax of each row)", m.argmax(axis=1), True))
        if m.shape[1] in sizes and _may_sum_to(total, m.shape[1]) and _class_block(m, 0):
            out.append((f"{how} (argmax of each column)", m.argmax(axis=0), True))
    return out


def _may_sum_to(total: float, groups: int) -> bool:
    """Whether a block whose values add up to ``total`` can be ``groups`` one-hot rows or
    probability vectors (each summing to 1 within :func:`_class_block`'s tolerance): a
    test on one number that spares reading most blocks (a weight tensor sums to anything)."""
    return abs(total - groups) <= 2 * (1e-3 + 1e-5) * groups + 1e-6 * groups


def _may_hold_runs(tensors: list[torch.Tensor], lo: int, hi: int, shortest: int,
                   floats: _Floats | None = None) -> list[bool]:
    """For each tensor, whether it holds at least ``shortest`` label-like values (whole
    numbers in ``[lo, hi]``, the range of every label vector): one with fewer cannot hold a
    run that :func:`_search` would match, in any reading. Real floating-point tensors are
    counted together over ``floats`` (made here when not given); any other tensor is
    answered True (searched as before). Counting in float32 only adds candidates: a whole
    number in range stays one, and a value that rounds onto one is searched too."""
    if floats is None:
        floats = _Floats(tensors)
    counts = floats.label_like(lo, hi)
    out = []
    for t in tensors:
        k = floats.segment(t)
        out.append(True if k is None else bool(counts[k] >= shortest))
    return out


def _nonnegative(t: torch.Tensor, floats: _Floats) -> bool:
    """Whether every value of ``t`` is ``>= 0`` (a one-hot or probability block must be);
    True for a tensor ``floats`` does not hold (read as before)."""
    k = floats.segment(t)
    return True if k is None else floats.nonnegative(k)


class _LabelCheck:
    """The label check of :class:`~medfl.guard.ContentGuard` (which inherits it): uses the
    guard's ``client_id``, its label vectors ``_labels`` and ``_fail``."""

    client_id: str
    _labels: list[tuple[str, np.ndarray]]
    _varied: tuple[list[tuple[str, np.ndarray]], list[tuple[str, np.ndarray]]] | None
    _fail: Callable[[str], None]

    def _varied_labels(self) -> list[tuple[str, np.ndarray]]:
        """The label vectors worth looking for: more than one sample, more than one value
        (a constant vector carries no surprise); worked out once per reference."""
        if self._varied is None or self._varied[0] is not self._labels:
            self._varied = (self._labels, [(d, y) for d, y in self._labels if len(y) > 1 and np.unique(y).size > 1])
        return self._varied[1]

    def _check_labels(self, ix: _Index, leaves: _Leaves, where: str, floats: _Floats) -> None:
        """Refuse a message holding a split's label vector (or a training loader's order of it)
        with enough surprise (:data:`~medfl.guard.params.LABEL_MIN_BITS`, corrected for the tests made)."""
        labels = self._varied_labels()
        if not labels:
            return
        sizes = {len(y) for _, y in labels}
        shortest = min(sizes)
        tensors = [(path, t) for path, t in leaves.tensors + leaves.stacks if t.numel() >= shortest]
        runs = _may_hold_runs([t for _, t in tensors], min(int(y.min()) for _, y in labels),
                              max(int(y.max()) for _, y in labels), shortest, floats)
        seqs: list[tuple[str, np.ndarray, bool, bool]] = []
        read: list[tuple[str, torch.Tensor, bool]] = []
        for (path, t), can_run in zip(tensors, runs):
            # a tensor without a run is read only as class blocks: shapes that fit, values >= 0
            if can_run or (_block_shapes(tuple(t.shape), sizes, t.dim() == 1) and _nonnegative(t, floats)):
                read.append((path, t, can_run))
        for (path, t, can_run), arr in zip(read, floats.arrays([t for _, t, _ in read])):   # one copy off a GPU
            seqs.append((path, arr, t.dim() == 1, can_run))
        for path, arr in leaves.lists:
            if arr.size >= shortest:
                seqs.append((path, arr, arr.ndim == 1, True))
        if len(leaves.scalars) >= shortest:
            seqs.append(("\0scalars", np.asarray(leaves.scalars, dtype=np.float64), True, True))
        matches, tests = [], 0
        for path, arr, one_d, can_run in seqs:
            for how, seq, whole in _label_candidates(arr, sizes, one_d, can_run):
                found, n_tests = _search(seq, labels, whole)
                tests += n_tests
                matches += [(path, how, *m) for m in found]
        if not matches:
            return
        need = LABEL_MIN_BITS + math.log2(max(tests, 1))
        for path, how, desc, start, n, bits in matches:
            if bits < need:
                continue
            if path == "\0scalars":
                if how:
                    path = f" (the message's {len(leaves.scalars)} numbers, in order)"
                else:
                    path = f"{leaves.scalar_paths[start]}..{leaves.scalar_paths[start + n - 1]}"
            self._fail(f"{where}{path}{how}: holds the labels of client {self.client_id}'s {desc} "
                       f"({n} samples, from position {start}; {bits:.0f} bits, a chance match would need "
                       f"{need:.0f}); per-sample labels never leave a client")
