"""The probes of a sample: what of its pixels the content guard looks for in a message.

Drawn for a chunk of samples of one shape at once (NumPy over the chunk, not a loop per
sample), from the sample's float32 pixels:

- value probes (:func:`_value_probes`): exact float32 values of the sample's brighter half
  that float16 and bfloat16 cannot represent (:func:`_round_mask`);
- gram probes (:func:`_gram_probes`): runs of :data:`~medfl.guard.params.GRAM` pixels along
  each axis, as float16, bfloat16 or exact codes (:func:`_codes`), kept as 64-bit keys
  (:func:`_gram_keys`);
- plane signatures (:func:`_plane_probes`): each channel's values at the fixed
  :func:`plane_positions` of a view (:func:`_views`: the plane, its ``2 x 2`` means, every
  second pixel), centred and scaled to norm 1 (:func:`_standardised`);
- crop probes (:func:`_crop_probes`): keys of runs of :data:`~medfl.guard.params.CROP` exact
  pixels along the last axis.

:mod:`medfl.guard.reference` gathers a split's probes; the image checks
(:mod:`medfl.guard.images`) hash and standardise a message's values with the same functions.
"""

from __future__ import annotations

import math

import numpy as np

from medfl.guard.params import (
    _VARIANTS, CROP, CROP_KEYS, GRAM, GRAM_POSITIONS, MIN_VALUE_PROBES, PLANE_MIN_SIDE, PLANE_PIXELS, VALUE_PROBES,
)

__all__ = ["plane_positions"]

_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                  0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                 dtype=np.uint64)


def _round_mask(values: np.ndarray) -> np.ndarray:
    """Float32 values that float16 or bfloat16 represent exactly (and non-finite ones)."""
    with np.errstate(over="ignore", invalid="ignore"):
        f16 = values.astype(np.float16).astype(np.float32) == values
    bf16 = (values.view(np.uint32) & np.uint32(0xFFFF)) == 0
    return f16 | bf16 | ~np.isfinite(values)


def _codes(values: np.ndarray, variant: str) -> np.ndarray:
    """The integer code of each float32 value at a precision (``f16``, ``bf16``, ``exact``)."""
    if variant == "exact":
        return values.view(np.uint32)
    if variant == "f16":
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(np.float16).view(np.uint16)
    bits = values.view(np.uint32).astype(np.uint64)            # bfloat16: round to nearest even
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _zero_code(variant: str) -> tuple[int, int]:
    """The codes of ``+0`` and ``-0`` at a precision."""
    return (0, 0x80000000) if variant == "exact" else (0, 0x8000)


def _gram_keys(grams: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of ``grams`` (up to 8 codes: ``GRAM``, or ``CROP``)."""
    g = grams.astype(np.uint64)
    key = np.zeros(len(g), dtype=np.uint64)
    for k in range(g.shape[1]):
        key += g[:, k] * _MULT[k]
    key ^= key >> np.uint64(31)
    key *= np.uint64(0x7FB5D329728EA185)
    key ^= key >> np.uint64(27)
    return key


def _values_of(cand: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Up to :data:`VALUE_PROBES` probe values drawn from ``cand`` (a sample's distinct
    non-round values): from its brighter half where that half holds enough of them; none
    when ``cand`` has fewer than :data:`MIN_VALUE_PROBES`."""
    if cand.size < MIN_VALUE_PROBES:
        return np.zeros(0, dtype=np.float32)
    mag = np.abs(cand)
    bright = cand[mag >= np.median(mag)]
    if bright.size >= MIN_VALUE_PROBES:
        cand = bright
    return rng.choice(cand, size=min(VALUE_PROBES, cand.size), replace=False).astype(np.float32)


def _value_probes(x: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """The value probes of each sample of ``x`` (``(m, ...)`` float32, samples of one shape):
    distinct non-round values among 512 random picks of the sample (all its distinct values
    when the picks hold fewer than ``2 * VALUE_PROBES``), then :func:`_values_of`'s draw,
    done for all samples at once."""
    m = x.shape[0]
    flat = x.reshape(m, -1)
    size = flat.shape[1]
    if size == 0:
        return [np.zeros(0, dtype=np.float32)] * m
    picks = np.sort(np.take_along_axis(flat, rng.integers(0, size, size=(m, min(size, 512))), axis=1), axis=1)
    valid = np.ones(picks.shape, dtype=bool)
    valid[:, 1:] = picks[:, 1:] != picks[:, :-1]            # distinct (sorted: repeats are neighbours)
    valid &= ~_round_mask(picks)
    count = valid.sum(axis=1)
    enough = count >= 2 * VALUE_PROBES                        # the others look at all their values below
    mag = np.abs(picks)
    median = np.zeros(m, dtype=mag.dtype)
    if enough.any():
        median[enough] = np.nanmedian(np.where(valid[enough], mag[enough], np.nan), axis=1)
    bright = valid & (mag >= median[:, None])
    use = np.where((bright.sum(axis=1) >= MIN_VALUE_PROBES)[:, None], bright, valid)
    draw = np.where(use, rng.random(picks.shape), 2.0)        # a random order of the usable values
    order = np.argsort(draw, axis=1, kind="stable")[:, :VALUE_PROBES]
    drawn = np.take_along_axis(picks, order, axis=1)
    keep = np.minimum(use.sum(axis=1), VALUE_PROBES)
    out = []
    for j in range(m):
        if enough[j]:
            out.append(drawn[j, :keep[j]].astype(np.float32))
        else:   # few distinct values among the picks: look at all of the sample's values
            cand = np.unique(flat[j])
            out.append(_values_of(cand[~_round_mask(cand)], rng))
    return out


def _gram_probes(flat: np.ndarray, shape: tuple[int, ...], variant: str, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gram probes of one precision of each sample of ``flat`` (``(m, prod(shape))`` float32,
    samples of ``shape`` flattened): along each axis of at least :data:`GRAM` values,
    ``8 * GRAM_POSITIONS`` random runs, of which the first :data:`GRAM_POSITIONS` distinct
    ones with at least 3 distinct values and at most half zeros are kept. Only the runs
    drawn are read and rounded, so the cost does not grow with the image. Returns
    ``(sample, axis, runs)``: the sample (row of ``flat``) and axis of each kept run and the
    runs' codes (``(k, GRAM)``), sample by sample."""
    m = flat.shape[0]
    tries = 8 * GRAM_POSITIONS
    zeros = _zero_code(variant)
    if m == 0 or flat.shape[1] == 0:   # no sample, or samples without a value
        shape = ()
    strides = [int(np.prod(shape[a + 1:], dtype=np.int64)) for a in range(len(shape))]
    samples, axes, runs = [], [], []
    for axis, size in enumerate(shape):
        if size < GRAM:
            continue
        # a random line along the axis (the other coordinates) and a start on it
        base = np.zeros((m, tries), dtype=np.int64)
        for other, dim in enumerate(shape):
            if other != axis:
                base += rng.integers(0, dim, size=(m, tries)) * strides[other]
        start = rng.integers(0, size - GRAM + 1, size=(m, tries))
        where = base[:, :, None] + (start[:, :, None] + np.arange(GRAM)) * strides[axis]
        cand = _codes(np.ascontiguousarray(flat[np.arange(m)[:, None, None], where]), variant)
        srt = np.sort(cand, axis=2)
        distinct = 1 + (srt[:, :, 1:] != srt[:, :, :-1]).sum(axis=2)
        nzero = ((cand == zeros[0]) | (cand == zeros[1])).sum(axis=2)
        ok = (distinct >= 3) & (nzero <= GRAM // 2)
        # the first occurrence of each distinct usable run, found through the runs' 64-bit
        # keys (what the index stores): sort by key, usable ones first, then by try
        keys = _gram_keys(cand.reshape(-1, GRAM)).reshape(m, tries)
        order = np.lexsort((np.broadcast_to(np.arange(tries), (m, tries)), ~ok, keys), axis=1)
        skeys, sok = np.take_along_axis(keys, order, axis=1), np.take_along_axis(ok, order, axis=1)
        lead = np.ones_like(sok)
        lead[:, 1:] = skeys[:, 1:] != skeys[:, :-1]
        first = np.zeros_like(ok)
        np.put_along_axis(first, order, lead & sok, axis=1)
        take = first & (np.cumsum(first, axis=1) <= GRAM_POSITIONS)
        si, ti = np.nonzero(take)                               # sample by sample, in try order
        samples.append(si)
        axes.append(np.full(si.size, axis, dtype=np.int8))
        runs.append(cand[si, ti])
    if not samples:
        dtype = np.uint32 if variant == "exact" else np.uint16
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8), np.zeros((0, GRAM), dtype=dtype)
    sample = np.concatenate(samples)
    order = np.argsort(sample, kind="stable")                   # sample by sample, axis by axis
    return sample[order], np.concatenate(axes)[order], np.concatenate(runs)[order]


def _chunk_probes(x: np.ndarray, rng: np.random.Generator, exact_grams: bool
                  ) -> tuple[list[np.ndarray], dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Value probes and gram probes (per precision, :func:`_gram_probes`'s triple) of the
    samples of ``x`` (``(m, ...)`` float32, one shape). Exact (float32) gram probes are
    taken for the samples with too few value probes, or for all with ``exact_grams``."""
    values = _value_probes(x, rng)
    flat, shape = x.reshape(x.shape[0], -1), tuple(x.shape[1:])
    grams = {}
    for variant in _VARIANTS:
        if variant == "exact":
            rows = np.arange(x.shape[0]) if exact_grams else np.array(
                [j for j, v in enumerate(values) if v.size < MIN_VALUE_PROBES], dtype=np.int64)
            if not rows.size:
                continue
            sample, axis, runs = _gram_probes(flat[rows], shape, variant, rng)
            grams[variant] = (rows[sample], axis, runs)
        else:
            grams[variant] = _gram_probes(flat, shape, variant, rng)
    return values, grams


# ------------------------------------------------- probes that survive plain transformations
def _spatial(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
    """``(channels, spatial shape)`` of a sample of ``shape``: ``(H, W)`` is one plane,
    ``(C, H, W)`` and ``(C, D, H, W)`` are ``C`` planes; other shapes have none."""
    if len(shape) == 2:
        return 1, tuple(shape)
    if len(shape) in (3, 4):
        return shape[0], tuple(shape[1:])
    return None


def _views(planes: np.ndarray) -> list[tuple[tuple[str, tuple[int, ...]], np.ndarray]]:
    """The views of ``planes`` (``(m, *spatial)``) that get signatures: the planes themselves
    (``full``) and, halved along every axis, their ``2 x 2`` (``2 x 2 x 2``) means
    (``mean2``: average pooling, area and bilinear resizing by 1/2) and every second pixel
    from the first (``step2``: nearest resizing by 1/2, ``x[::2, ::2]``); a view whose
    smallest side is below :data:`PLANE_MIN_SIDE` is left out."""
    spatial = planes.shape[1:]
    out: list[tuple[tuple[str, tuple[int, ...]], np.ndarray]] = []
    if min(spatial) >= PLANE_MIN_SIDE:
        out.append((("full", spatial), planes))
    half = tuple(d // 2 for d in spatial)
    if min(half) >= PLANE_MIN_SIDE:
        even = planes[(slice(None), *(slice(0, 2 * h) for h in half))]
        pairs = even.reshape(planes.shape[0], *(x for h in half for x in (h, 2)))
        out.append((("mean2", half), pairs.mean(axis=tuple(range(2, 2 + 2 * len(half), 2)), dtype=np.float64)))
        out.append((("step2", half), even[(slice(None), *(slice(None, None, 2),) * len(half))]))
    return out


_POSITIONS: dict[tuple[int, ...], np.ndarray] = {}


def plane_positions(shape: tuple[int, ...]) -> np.ndarray:
    """The flat positions of a view of ``shape`` at which plane signatures are taken: the
    same :data:`PLANE_PIXELS` random pixels (all, in a smaller view) for every sample, so
    that a message's plane is read there once for all samples."""
    pos = _POSITIONS.get(shape)
    if pos is None:
        size = math.prod(shape)
        rng = np.random.default_rng([*shape, 20261126])
        pos = np.sort(rng.choice(size, size=min(PLANE_PIXELS, size), replace=False)).astype(np.intp)
        _POSITIONS[shape] = pos
    return pos


def _standardised(rows: np.ndarray, signatures: bool) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` (``(r, M)``) centred and scaled to norm 1 (float64), and which rows can be
    compared (finite, not constant). A signature must also be varied and spread: at least
    ``M // 4`` distinct values, none on more than three quarters of the positions (a
    background or a mask says nothing about a sample), and its 8 largest pixels carrying at
    most 90 % of its variance (so no row with 8 or fewer outstanding values, say a weight
    vector with one large entry, reaches a correlation of 0.95 with it)."""
    rows = np.asarray(rows, dtype=np.float64)
    m = rows.shape[1]
    centred = rows - rows.mean(axis=1, keepdims=True)
    norm = np.sqrt((centred * centred).sum(axis=1))
    usable = (norm > 0) & np.isfinite(norm)
    with np.errstate(invalid="ignore", divide="ignore"):
        unit = np.where(usable[:, None], centred / np.where(usable, norm, 1)[:, None], 0.0)
    if signatures:
        srt = np.sort(rows, axis=1)
        usable &= 1 + (srt[:, 1:] != srt[:, :-1]).sum(axis=1) >= m // 4
        top = (3 * m) // 4
        if 0 < top < m:
            usable &= (srt[:, top:] != srt[:, :-top]).all(axis=1)
        usable &= -np.sort(-unit * unit, axis=1)[:, :8].sum(axis=1) <= 0.9
    return unit, usable


def _plane_probes(x: np.ndarray) -> dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]]:
    """Plane signatures of the samples of ``x`` (``(m, ...)`` float32, one shape), per view:
    ``(signatures, sample)`` with ``sample`` the row of ``x`` of each signature."""
    layout = _spatial(tuple(x.shape[1:]))
    if layout is None or x.shape[0] == 0:
        return {}
    channels, spatial = layout
    planes = x.reshape(x.shape[0] * channels, *spatial)
    out = {}
    for key, view in _views(planes):
        rows, varied = _standardised(view.reshape(view.shape[0], -1)[:, plane_positions(key[1])], True)
        keep = np.nonzero(varied)[0]
        out[key] = (rows[keep].astype(np.float32), (keep // channels).astype(np.int32))
    return out


def _crop_probes(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crop probes of the samples of ``x`` (``(m, ...)`` float32, one shape): keys of the runs
    of :data:`CROP` exact pixels of the first channel along the last axis, starting at every
    pixel of the lines whose other coordinates are multiples of :data:`CROP`, so that every
    crop of at least ``CROP`` pixels a side holds one. Only runs of values that float16 and
    bfloat16 cannot represent, with at least 3 distinct values, are kept (a run of round
    numbers also occurs in weights), up to :data:`CROP_KEYS` per sample: where a sample has
    more starts, every ``step``-th of each line from a random offset (every crop of
    ``step + CROP - 1`` pixels a side or more still holds one).
    Returns ``(keys, bits of each run's largest pixel in magnitude, sample)``: a message is
    prefiltered on those (most weights are smaller than an image's bright pixels)."""
    layout = _spatial(tuple(x.shape[1:]))
    none = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int32))
    if layout is None or x.shape[0] == 0 or min(layout[1]) < CROP:
        return none
    m, spatial = x.shape[0], layout[1]
    plane = x.reshape(m, layout[0], *spatial)[:, 0]
    lines = plane[(slice(None), *(slice(None, None, CROP),) * (len(spatial) - 1))].reshape(m, -1, spatial[-1])
    runs = np.lib.stride_tricks.sliding_window_view(lines, CROP, axis=2)        # (m, lines, starts, CROP)
    round_ = np.lib.stride_tricks.sliding_window_view(_round_mask(lines), CROP, axis=2).any(axis=3)
    srt = np.sort(runs, axis=3)
    ok = ~round_ & (1 + (srt[..., 1:] != srt[..., :-1]).sum(axis=3) >= 3)
    # a large image keeps every step-th start of each line, from a random offset per line:
    # every crop at least step + CROP - 1 pixels wide holds a kept run, a narrower one with
    # odds 1 / step (independently for each sample of a batch of crops)
    step = -(-ok.shape[1] * ok.shape[2] // CROP_KEYS)
    if step > 1:
        offset = rng.integers(0, step, size=ok.shape[:2])
        ok &= (np.arange(ok.shape[2]) - offset[..., None]) % step == 0
    ok = ok.reshape(m, -1)
    draw = np.where(ok, rng.random(ok.shape), 2.0)
    order = np.argsort(draw, axis=1, kind="stable")[:, :CROP_KEYS]
    take = np.take_along_axis(ok, order, axis=1)
    si, k = np.nonzero(take)
    picked = order[si, k]
    values = np.ascontiguousarray(runs.reshape(m, -1, CROP)[si, picked])
    peak = np.take_along_axis(values, np.abs(values).argmax(axis=1)[:, None], axis=1)[:, 0]
    return _gram_keys(values.view(np.uint32)), peak.view(np.uint32), si.astype(np.int32)
