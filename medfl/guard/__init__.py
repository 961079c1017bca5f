"""The content guard: recognise a client's own labels and images in what leaves the client.

A method's client code runs where the data is, so no rule on what a message *looks like*
can stop a plugin that means to leak (what protects a site is its operator approving the
code that runs there, :mod:`medfl.approval`, and differential privacy on what leaves). This
guard catches *mistakes*: a plugin that puts the client's labels or images in a reply, its
metrics or an evaluation model, whatever the dtype, shape or container. It compares the
*content* of everything that leaves with the client's own data, and never refuses a tensor
because of its shape, so model weights of any dtype pass.

What is compared (:class:`ContentGuard`, built lazily from the client's datasets and cached
per dataset for the life of the process):

Labels
    each split's label vector (from the dataset's ``labels`` or its items) and, for the
    training split, the same vector in the order of the client's seeded training loader
    (first epochs), which is how a plugin collecting ``y`` from its batches would send it.
    Every tensor, every list of numbers and the run of all scalars of the message (a dict
    of per-sample metrics) is scanned, flattened row- and (2-D) column-major, as ints,
    floats or bools, for a split's labels as a contiguous run (inside padding too); a 2-D
    block (or a 1-D vector of ``n * K`` values) holding one-hot rows or class
    probabilities is also read through its argmax along either axis. A match counts only
    if it is improbable by chance. Its *surprise* is ``-sum_i log2 q(y_i) - log2(places it
    could start)``, with ``q`` the frequency of each label value among the scanned sequence's
    label-like values (integers in the labels' range, where alone a run can match; the whole
    sequence for an argmax reading): the probability of the match if those values were random
    with their own frequencies; it must reach :data:`LABEL_MIN_BITS` plus ``log2`` of the number of
    (sequence, label vector) tests in the message that could have matched. So a chance
    match has probability below ``2 ** -16`` per message even in tensors made of 0/1
    values (1-bit quantised weights); a constant label vector (surprise 0) never counts.
    The price: a split whose label vector carries fewer bits (fewer than about 20-30
    balanced binary samples) is not recognised.
Images
    for each sample of each split (seen without training augmentation), up to
    :data:`VALUE_PROBES` *probe values*: exact float32 bit patterns of distinct pixel values
    drawn from the brighter half of the sample, keeping only values that float16 and
    bfloat16 cannot represent (``0``, ``1``, ``0.5``, small integers... also occur in
    weights). A float32/float64/integer tensor (and the message's scalars) hits a probe
    when the value occurs anywhere in it: order, shape, transposition and splitting across
    several tensors do not matter, hits are pooled over the whole message. A sample is
    recognised when at least half of its probes (and at least 4) are hit; samples with
    fewer than :data:`MIN_VALUE_PROBES` usable values have no value probes.

    float16/bfloat16 tensors cannot be compared value by value (65,536 codes: a large
    tensor holds most of them), so each sample also has *gram probes*: runs of
    :data:`GRAM` consecutive pixels along each axis (both directions), rounded to float16
    and to bfloat16, at up to :data:`GRAM_POSITIONS` places per axis; a low-precision
    tensor hits a gram probe when the same run occurs in it flattened (a flattened,
    channel-squeezed or transposed image keeps the runs of one axis). Samples with too few
    distinct non-round values for value probes (integer-valued or heavily quantised
    images) get exact (float32) gram probes instead. Runs with fewer than 3 distinct values
    or more than half zeros are not used as probes (backgrounds, constant regions). A
    sample is recognised when half of its gram positions along one axis (at least 3) occur.
Images, transformed (issue 38: the plain mistakes of a careless plugin)
    *plane signatures*: for each channel of each sample (a 2D image or a 3D volume) and
    for three views of it (the plane itself; halved along every axis by ``2 x 2`` means,
    which average pooling, area and bilinear resizing by 1/2 compute; and every second
    pixel, which nearest resizing by 1/2 keeps), the values at :data:`PLANE_PIXELS` fixed
    positions of the view, centred and scaled to norm 1. A tensor of the message is read
    as planes of a view's shape where its shape allows (last dimensions, flattened planes,
    a vector of several planes, channel-last; dimensions of 1 dropped), the same positions
    are read from each plane, and a plane whose Pearson correlation with a sample's
    signature reaches :data:`PLANE_MIN_CORR` is that sample: correlation does not change
    under scaling and offset, and hardly under uint8 quantisation (per-image min-max) or
    small noise. Signatures whose values are not varied and spread enough (a quarter of
    the positions at least distinct, no value on more than three quarters: backgrounds,
    masks; 8 pixels carrying more than 90 % of the variance) are not kept
    (:func:`_standardised`); a plane of independent random values correlates above 0.95
    with a kept signature of 64 (128) pixels with odds of about ``1e-32`` (``1e-64``), the
    fraction of the sphere within that angle.

    *crop probes*: 64-bit keys of runs of :data:`CROP` exact float32 pixels along the last
    axis (first channel), starting at every pixel of every line whose other coordinates
    are multiples of :data:`CROP`, so every crop of at least ``CROP`` pixels a side holds
    one; runs of values float16/bfloat16 represent exactly are left out (they occur in
    weights), and :data:`CROP_KEYS` are kept per sample: every start in an image up to
    about 45 x 45; in a larger one every ``step``-th start of each line from a random
    offset, so every crop ``step + 3`` pixels wide is caught (11 x 11 in 128 x 128), a 4 x 4
    crop with odds ``1 / step`` per sample of a batch of crops. One key found in the message's
    float32/float64 tensors or lists recognises the sample (a chance match of 4 exact
    non-round values has odds of about ``2 ** -64``). A message is prefiltered on each
    run's largest pixel (one bit a slot, up to 2 MiB).

What it does not recognise is listed in ``docs/flower.md`` ("What the payload guard and
approvals protect"): images transformed otherwise than above (intensity augmentation,
other resampling filters and factors, rotations, crops of transformed images), images
placed in a tensor off a plane's boundary, images whose pixels take very few distinct
values (binary masks), labels re-encoded (offset, permuted, hashed) or in an order other
than the dataset's and the loader's, per-sample features computed from the images, and
anything encoded on purpose (labels XOR a constant, low mantissa bits, values hidden as
small weight deltas): no check of content reaches those, and approval of the code and
differential privacy are the protection.

Cost (``benchmarks/payload_guard.py``, 2-core VM, one thread; ``benchmarks/README.md`` has
the figures before and after the plane signatures and crop probes): building the reference
reads every sample once per process (about 1-3 ms per 128x128 image, reading included) and
keeps about 9 KB per sample (1.5 KB of value and gram probes, the rest plane signatures and
crop probes) plus up to 3 MiB of lookup tables per client; checking a ResNet-18 reply
(11.2 M values) takes about 20 ms in float32 on an idle machine before the crop probes and
about 20 ms more with them (large float32 tensors are read in place, in cache-sized steps),
65 ms in int8, 0.35 s in float16/bfloat16.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ContentGuard", "SplitReference", "LABEL_MIN_BITS", "VALUE_PROBES", "GRAM", "GRAM_POSITIONS",
           "IMAGE_FRACTION", "PLANE_PIXELS", "PLANE_MIN_CORR", "PLANE_MIN_SIDE", "CROP", "CROP_KEYS",
           "build_split_reference", "clear_reference_cache", "loader_orders"]

#: A label vector found in a message counts when a chance match anywhere in the message
#: would have probability below ``2 ** -LABEL_MIN_BITS`` (see the module docstring).
LABEL_MIN_BITS = 16.0
#: Probe values kept per sample.
VALUE_PROBES = 16
#: A sample with fewer distinct non-round values gets exact gram probes instead.
MIN_VALUE_PROBES = 8
#: Length of a gram probe (consecutive pixels along one axis).
GRAM = 8
#: Gram probes per axis, per sample and precision.
GRAM_POSITIONS = 8
#: Fraction of a sample's probes that must occur in a message for it to be recognised.
IMAGE_FRACTION = 0.5
#: Training-loader epochs whose sample order is also a reference label order.
LOADER_EPOCHS = 3
#: Pixels of a plane signature (fixed positions per view shape, fewer in views this small).
PLANE_PIXELS = 128
#: Correlation (over a signature's pixels) from which a plane of a message is a sample's view.
PLANE_MIN_CORR = 0.95
#: Smallest side of a view that gets plane signatures.
PLANE_MIN_SIDE = 8
#: Side of the smallest crop recognised by crop probes (runs of this many pixels).
CROP = 4
#: Crop probes kept per sample (every crop position of images up to about 45 x 45).
CROP_KEYS = 512

_VARIANTS = ("f16", "bf16", "exact")
_AXES = 8                          # gram groups: sample * _AXES + axis
_TABLE_BITS = 20                   # prefilter tables: at most 2**20 booleans (1 MiB) ...
_TABLE_MIN_BITS = 12               # ... at least 2**12, and 16 slots per probe in between
_TABLE_SLOTS_PER_PROBE = 16        # (a random value passes the prefilter with odds <= 1/16)
_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                  0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                 dtype=np.uint64)
_CACHE: "OrderedDict[str, SplitReference]" = OrderedDict()
_CACHE_MAX = 256                   # split references (about 1.5 KB per sample each)
_MERGED: "OrderedDict[tuple[str, ...], _Index]" = OrderedDict()   # a client's splits, merged
_MERGED_BYTES = 32 << 20          # merged indices kept, in bytes (tables sized to the probes: ~0.5-1 MiB a client)
_log = logging.getLogger("medfl.guard")
_LOCK = threading.Lock()


# ---------------------------------------------------------------------- references
@dataclass
class SplitReference:
    """What one split of a client's data looks like, for the content check.

    Attributes:
        n: number of samples.
        labels: the label of each sample, in dataset order.
        vbits: float32 bit patterns of all value probes (uint32).
        vsample: the sample of each value probe.
        vcount: number of value probes of each sample.
        grams: per precision (``f16``, ``bf16``, ``exact``): ``(keys, position)`` of each
            gram probe; a position (a run at one place of one sample) has two keys, one per
            direction, and its id indexes ``gsample``.
        gsample: per precision, the sample of each gram position.
        gaxis: per precision, the axis each gram position runs along.
        planes: per view (``(name, shape)``: ``full``, ``mean2``, ``step2``, see
            :func:`_views`), ``(signatures, sample)``: each signature is a plane's values at
            the view's :func:`plane_positions`, centred and scaled to norm 1 (float32, one
            row per channel of a sample whose values there are varied enough).
        ckeys: crop probes: 64-bit keys of runs of :data:`CROP` exact float32 pixels (see
            :func:`_crop_probes`); ``cfirst`` the float32 bits of each run's largest pixel
            in magnitude, ``csample`` its sample.
    """

    n: int
    labels: np.ndarray
    vbits: np.ndarray
    vsample: np.ndarray
    vcount: np.ndarray
    grams: dict[str, tuple[np.ndarray, np.ndarray]]
    gsample: dict[str, np.ndarray]
    gaxis: dict[str, np.ndarray]
    planes: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    ckeys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    cfirst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    csample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    def gcount(self, variant: str) -> np.ndarray:
        """Number of gram positions of each sample at a precision."""
        return np.bincount(self.gsample[variant], minlength=self.n)

    @property
    def nbytes(self) -> int:
        """Memory held by this reference."""
        total = self.labels.nbytes + self.vbits.nbytes + self.vsample.nbytes + self.vcount.nbytes
        for keys, pos in self.grams.values():
            total += keys.nbytes + pos.nbytes
        total += sum(sig.nbytes + who.nbytes for sig, who in self.planes.values())
        total += self.ckeys.nbytes + self.cfirst.nbytes + self.csample.nbytes
        return total + sum(c.nbytes for c in self.gsample.values()) + sum(c.nbytes for c in self.gaxis.values())

    @property
    def unprotected(self) -> int:
        """Samples that no image probe can recognise in float32 (too few distinct values)."""
        ok = (self.vcount >= MIN_VALUE_PROBES) | (self.gcount("exact") >= 3)
        return int((~ok).sum())


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


def _item_image(item: Any) -> Any:
    if isinstance(item, dict):
        return item.get("image", next(iter(item.values())))
    if isinstance(item, (tuple, list)):
        return item[0]
    return item


def _item_label(item: Any) -> int:
    if isinstance(item, dict):
        return int(item.get("label", -1))
    if isinstance(item, (tuple, list)) and len(item) > 1:
        return int(torch.as_tensor(item[1]).reshape(-1)[0])
    return -1


def _labels_of(ds: Dataset) -> np.ndarray | None:
    labels = getattr(ds, "labels", None)
    if labels is None:
        return None
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def _fingerprint(ds: Dataset) -> str:
    """Which samples a dataset holds: its type, size, labels, its first sample (so that
    another preprocessing of the same files differs) and its file list (or, without one,
    two more of its samples)."""
    h = hashlib.sha1()
    n = len(ds)  # type: ignore[arg-type]
    h.update(f"{type(ds).__module__}.{type(ds).__qualname__}:{n}:{VALUE_PROBES}:{GRAM}:{PLANE_PIXELS}:{CROP}".encode())
    labels = _labels_of(ds)
    if labels is not None:
        h.update(labels.tobytes())
    files = getattr(ds, "files", None) or getattr(ds, "paths", None)
    listed = files is not None and len(files) == n
    if listed:
        h.update("\n".join(map(str, files)).encode())
    for i in (sorted({0} if listed else {0, n // 2, n - 1}) if n else []):
        x = torch.as_tensor(_item_image(ds[i])).as_subclass(torch.Tensor).detach().cpu().contiguous()
        h.update(str(x.dtype).encode() + str(tuple(x.shape)).encode() + x.numpy().tobytes())
    return h.hexdigest()


#: Samples whose probes are drawn together (fewer when they would take more than 32 MiB).
_CHUNK_SAMPLES = 256


def build_split_reference(ds: Dataset, exact_grams: bool = False) -> SplitReference:
    """The reference of one dataset (every sample read once).

    Samples of one shape are probed in chunks, all at once (NumPy over the chunk instead of
    a Python loop per sample: about 20x faster); the probes drawn depend only on the
    dataset's content and size.

    Args:
        ds: a dataset of ``(image, label)`` items (or dicts with ``image``/``label``).
        exact_grams: give every sample exact gram probes (normally only samples without
            enough probe values get them).
    """
    n = len(ds)  # type: ignore[arg-type]
    labels = _labels_of(ds)
    collect = labels is None
    ys = np.zeros(n, dtype=np.int64)
    vb, vs, vc = [], [], np.zeros(n, dtype=np.int32)
    gs: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    ga: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    gr: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    planes: dict[tuple[str, tuple[int, ...]], list[tuple[np.ndarray, np.ndarray]]] = {}
    crops: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    chunk: list[np.ndarray] = []
    start = 0

    def flush() -> None:
        if not chunk:
            return
        rng = np.random.default_rng([start, n, 20251125])
        x = np.stack(chunk)
        values, grams = _chunk_probes(x, rng, exact_grams)
        for key, (sig, who) in _plane_probes(x).items():
            planes.setdefault(key, []).append((sig, who + start))
        keys, first, who = _crop_probes(x, np.random.default_rng([start, n, 20261126]))
        crops.append((keys, first, who + start))
        for j, v in enumerate(values):
            vb.append(v.view(np.uint32))
            vs.append(np.full(v.size, start + j, dtype=np.int32))
            vc[start + j] = v.size
        for variant, (sample, axis, runs) in grams.items():
            gs[variant].append(sample.astype(np.int32) + start)
            ga[variant].append(axis)
            gr[variant].append(runs)

    for i in range(n):
        item = ds[i]
        if collect:
            ys[i] = _item_label(item)
        x = torch.as_tensor(_item_image(item)).as_subclass(torch.Tensor).detach().cpu()
        x = np.ascontiguousarray((x.real if x.is_complex() else x).to(torch.float32).numpy())
        if chunk and (x.shape != chunk[0].shape or len(chunk) >= max(1, min(_CHUNK_SAMPLES, (32 << 20) // max(
                x.nbytes, 1)))):
            flush()
            chunk, start = [], i
        chunk.append(x)
    flush()
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dtype=dt))
    grams = {}
    for v in _VARIANTS:
        fwd = np.concatenate(gr[v]) if gr[v] else np.zeros((0, GRAM), dtype=np.uint32)
        pos = np.arange(len(fwd), dtype=np.int32)                # each run, read both ways
        grams[v] = (np.concatenate([_gram_keys(fwd), _gram_keys(fwd[:, ::-1])]).astype(np.uint64),
                    np.concatenate([pos, pos]))
    return SplitReference(
        n=n, labels=ys if collect else labels,
        vbits=cat(vb, np.uint32), vsample=cat(vs, np.int32), vcount=vc,
        grams=grams,
        gsample={v: cat(gs[v], np.int32) for v in _VARIANTS},
        gaxis={v: cat(ga[v], np.int8) for v in _VARIANTS},
        planes={key: (np.concatenate([sig for sig, _ in parts]), cat([who for _, who in parts], np.int32))
                for key, parts in planes.items()},
        ckeys=cat([c[0] for c in crops], np.uint64), cfirst=cat([c[1] for c in crops], np.uint32),
        csample=cat([c[2] for c in crops], np.int32))


def _lru_get(cache: "OrderedDict[Any, Any]", key: Any) -> Any:
    with _LOCK:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
        return hit


def _lru_put(cache: "OrderedDict[Any, Any]", key: Any, value: Any, size: int,
             weight: Callable[[Any], int] | None = None) -> None:
    """Keep ``value``; drop the least recently used entries beyond ``size`` entries (or,
    with ``weight``, beyond ``size`` in total weight; the newest entry always stays)."""
    with _LOCK:
        cache[key] = value
        total = (lambda: sum(map(weight, cache.values()))) if weight else (lambda: len(cache))
        while len(cache) > 1 and total() > size:
            cache.popitem(last=False)


def _cached_reference(ds: Dataset) -> tuple[str, SplitReference]:
    """``(fingerprint, reference)`` of a dataset, built once per process."""
    key = _fingerprint(ds)
    ref = _lru_get(_CACHE, key)
    if ref is None:
        ref = build_split_reference(ds)
        if ref.unprotected:
            _log.warning("payload guard: %d of %d samples (%s) have too few distinct pixel values to be "
                         "recognised in float32 messages (binary or constant images)", ref.unprotected, ref.n,
                         type(ds).__name__)
        _lru_put(_CACHE, key, ref, _CACHE_MAX)
    return key, ref


def clear_reference_cache() -> None:
    """Forget every cached split reference and merged index (tests, benchmarks)."""
    with _LOCK:
        _CACHE.clear()
        _MERGED.clear()


# ---------------------------------------------------------------------- the merged index
@dataclass
class _Index:
    """The image references of a client's splits, merged, with prefilter tables."""

    names: list[tuple[str, int]]                  # global sample -> (split, index in split)
    vbits: np.ndarray
    vsample: np.ndarray
    vneed: np.ndarray                              # hits needed per sample (0: not protected)
    vtable: np.ndarray | None
    vrange: tuple[np.uint32, np.uint32]            # smallest and largest |probe| as float32 bits
    grams: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)   # keys, position
    ggroup: dict[str, np.ndarray] = field(default_factory=dict)   # position -> sample * _AXES + axis
    gneed: dict[str, np.ndarray] = field(default_factory=dict)    # hits needed per (sample, axis) group
    gtable: dict[str, np.ndarray] = field(default_factory=dict)
    planes: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    ckeys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))     # sorted
    csample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))    # of each sorted key
    ctable: _Bitset | None = None                  # prefilter on a run's largest pixel
    crange: tuple[np.uint32, np.uint32] = (np.uint32(1), np.uint32(0))
    _vsorted: np.ndarray | None = field(default=None, repr=False)

    def probe_values(self, bits: np.ndarray) -> np.ndarray:
        """Which of ``bits`` (float32 bit patterns) are a value probe's, by binary search in
        the probes' sorted patterns (sorted once; ``np.isin`` would sort them every call)."""
        if self._vsorted is None:
            self._vsorted = np.unique(self.vbits)
        ref = self._vsorted
        if not ref.size or not bits.size:
            return np.zeros(bits.shape, dtype=bool)
        at = np.minimum(np.searchsorted(ref, bits), ref.size - 1)
        return ref[at] == bits

    def probe_ids(self, bits: np.ndarray) -> np.ndarray:
        """The value probes (ids) whose float32 bit pattern is among ``bits``."""
        return np.nonzero(np.isin(self.vbits, np.unique(bits)))[0]

    @property
    def nbytes(self) -> int:
        """Memory of the arrays (what the merged-index cache counts)."""
        arrays = [self.vbits, self.vsample, self.vneed, *self.ggroup.values(), *self.gneed.values(),
                  *self.gtable.values(), *(a for pair in self.grams.values() for a in pair),
                  *(a for pair in self.planes.values() for a in pair), self.ckeys, self.csample]
        arrays += [t for t in (self.vtable, self.ctable) if t is not None]   # type: ignore[misc]
        return int(sum(a.nbytes for a in arrays))


def _need(count: np.ndarray, min_count: int, min_hits: int) -> np.ndarray:
    """Probe hits that recognise each sample (0: too few probes, never recognised)."""
    need = np.maximum(min_hits, np.ceil(IMAGE_FRACTION * count)).astype(np.int64)
    need[count < min_count] = 0
    return need


def _table_bits(probes: int) -> int:
    """Bits of a prefilter table for ``probes`` entries: about 16 slots per probe, within
    [2**12, 2**20] (a merged index is rebuilt for every client that is not cached, and a
    fixed 1 MiB table per variant made the cache hold only a few clients)."""
    return min(_TABLE_BITS, max(_TABLE_MIN_BITS, (probes * _TABLE_SLOTS_PER_PROBE - 1).bit_length()))


def _table(slots: np.ndarray, tbits: int) -> np.ndarray:
    table = np.zeros(1 << tbits, dtype=bool)
    table[slots] = True
    return table


class _Bitset:
    """A prefilter table of ``2 ** tbits`` slots stored one bit a slot (a ``bool`` table
    of the same selectivity would take 8 times the memory): indexed like one."""

    def __init__(self, slots: np.ndarray, tbits: int) -> None:
        self.size = 1 << tbits
        self.bits = np.zeros(self.size >> 3, dtype=np.uint8)
        np.bitwise_or.at(self.bits, slots >> 3, (1 << (slots & 7)).astype(np.uint8))

    def __getitem__(self, slots: np.ndarray) -> np.ndarray:
        return ((self.bits[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1).astype(bool)

    @property
    def nbytes(self) -> int:
        """Memory of the table."""
        return self.bits.nbytes


def _value_slot(bits: np.ndarray, tbits: int) -> np.ndarray:
    return (bits & np.uint32((1 << tbits) - 1)).astype(np.intp)


def _key_slot(keys: np.ndarray, tbits: int) -> np.ndarray:
    return (keys >> np.uint64(64 - tbits)).astype(np.intp)


def _magnitude_range(vbits: np.ndarray) -> tuple[np.uint32, np.uint32]:
    if not vbits.size:
        return np.uint32(1), np.uint32(0)
    mag = vbits & np.uint32(0x7FFFFFFF)
    return mag.min(), mag.max()


def _merge(refs: list[tuple[str, SplitReference]]) -> _Index:
    names: list[tuple[str, int]] = []
    vb, vs, vc = [], [], []
    gk: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    gp: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    gs: dict[str, list[np.ndarray]] = {v: [] for v in _VARIANTS}
    offset, pos_offset = 0, {v: 0 for v in _VARIANTS}
    for split, ref in refs:
        names += [(split, i) for i in range(ref.n)]
        vb.append(ref.vbits)
        vs.append(ref.vsample.astype(np.int64) + offset)
        vc.append(ref.vcount)
        for v in _VARIANTS:
            keys, pos = ref.grams[v]
            gk[v].append(keys)
            gp[v].append(pos.astype(np.int64) + pos_offset[v])
            gs[v].append((ref.gsample[v].astype(np.int64) + offset) * _AXES + ref.gaxis[v])
            pos_offset[v] += ref.gsample[v].size
        offset += ref.n
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dtype=dt))
    vbits = cat(vb, np.uint32)
    index = _Index(names=names, vbits=vbits, vsample=cat(vs, np.int64),
                   vneed=_need(cat(vc, np.int64), MIN_VALUE_PROBES, 4),
                   vtable=_table(_value_slot(vbits, _table_bits(vbits.size)), _table_bits(vbits.size))
                   if vbits.size else None,
                   vrange=_magnitude_range(vbits))
    for v in _VARIANTS:
        keys = cat(gk[v], np.uint64)
        if keys.size:
            group = cat(gs[v], np.int64)
            index.grams[v] = (keys, cat(gp[v], np.int64))
            index.ggroup[v] = group
            index.gneed[v] = _need(np.bincount(group, minlength=offset * _AXES), 3, 3)
            tbits = _table_bits(keys.size)
            index.gtable[v] = _table(_key_slot(keys, tbits), tbits)
    offsets = np.cumsum([0] + [ref.n for _, ref in refs])
    views = {key for _, ref in refs for key in ref.planes}
    for key in sorted(views):
        parts = [(ref.planes[key][0], ref.planes[key][1].astype(np.int64) + off)
                 for (_, ref), off in zip(refs, offsets) if key in ref.planes]
        index.planes[key] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    ckeys = cat([ref.ckeys for _, ref in refs], np.uint64)
    if ckeys.size:
        order = np.argsort(ckeys, kind="stable")
        csample = cat([ref.csample.astype(np.int64) + off for (_, ref), off in zip(refs, offsets)], np.int32)
        first = cat([ref.cfirst for _, ref in refs], np.uint32)
        # 64 slots a probe, up to 2**24 (2 MiB of bits): few weights reach the exact check
        tbits = min(24, max(_TABLE_MIN_BITS, (first.size * 64 - 1).bit_length()))
        index.ckeys, index.csample = ckeys[order], csample[order]
        index.ctable, index.crange = _Bitset(_value_slot(first, tbits), tbits), _magnitude_range(first)
    return index


# ---------------------------------------------------------------------- walking a message
@dataclass
class _Leaves:
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    stacks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    lists: list[tuple[str, np.ndarray]] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    scalar_paths: list[str] = field(default_factory=list)


def _number(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, str)


def _walk(value: Any, path: str, out: _Leaves, exempt: frozenset[str], top: bool) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.numel() == 1:
            item = t.reshape(-1)[0]
            out.scalars.append(float(item.real if t.is_complex() else item))
            out.scalar_paths.append(path)
        elif t.numel() > 1:
            out.tensors.append((path, t))
        return
    if _number(value):
        out.scalars.append(float(value))
        out.scalar_paths.append(path)
        return
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items() if not (top and k in exempt)]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        block = _number_block(value)
        if block is not None:
            out.lists.append((path, block))
    else:
        return
    for p, v in items:
        _walk(v, p, out, exempt, False)
    tensors = [v for _, v in items if isinstance(v, torch.Tensor) and 1 < v.numel() <= 4096]
    if len(tensors) > 1 and len({tuple(t.shape) for t in tensors}) == 1 and len(tensors) == len(items):
        out.stacks.append((f"{path}[*]", torch.stack([t.detach().cpu() for t in tensors])))


def _number_block(value: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """A list of numbers, or a rectangular list of lists of numbers, as a float64 array."""
    if len(value) < 2:
        return None
    if all(_number(v) for v in value):
        return np.asarray([float(v) for v in value], dtype=np.float64)
    if all(isinstance(v, (list, tuple)) and v and all(_number(u) for u in v) for v in value) and len(
            {len(v) for v in value}) == 1:
        return np.asarray([[float(u) for u in v] for v in value], dtype=np.float64)
    return None


def _numeric(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array: floats as float32/float64, integers as they are."""
    t = t.detach().cpu()
    if t.is_complex():
        t = t.real
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.dtype in (torch.float16, torch.bfloat16) or (t.is_floating_point() and t.dtype != torch.float64):
        t = t.to(torch.float32)
    elif not t.is_floating_point() and t.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32,
                                                        torch.int64):
        t = t.to(torch.int64)
    return t.contiguous().numpy()


# ---------------------------------------------------------------------- the label scan
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


class _Floats:
    """The values of a message's real floating-point tensors as float32, gathered once per
    check and read by both scans: :func:`_may_hold_runs` counts label-like values per
    tensor, and the image check looks up the float32/float64 tensors' values (the first
    :attr:`full` positions), each in a few NumPy calls over large arrays, where a model's
    dozens of tensors would otherwise cost dozens of calls each. A large float32 tensor is
    read where it lies (no copy); the others are copied into shared pieces.

    Positions run over all held tensors in order (tensor ``i`` starts at ``starts[i]``).

    Args:
        tensors: the tensors to hold (others, e.g. integer tensors, are left out; find
            each one's place with :meth:`segment`).
        more: more tensors to hold, after all of ``tensors`` (never in the first
            :attr:`full` positions): the label scan's stacks of small tensors.
    """

    HALF = (torch.float16, torch.bfloat16)
    FULL = (torch.float32, torch.float64)
    #: a float32 tensor of at least this many values is read in place, not copied
    VIEW_MIN = 1 << 15

    def __init__(self, tensors: list[torch.Tensor], more: list[torch.Tensor] | tuple[()] = ()) -> None:
        real = self.FULL + self.HALF
        full = [t for t in tensors if t.dtype in self.FULL and t.numel()]
        rest = [t for t in tensors if t.dtype in self.HALF and t.numel()]
        rest += [t for t in more if t.dtype in real and t.numel()]
        held = full + rest
        self._segment = {id(t): i for i, t in enumerate(held)}
        self._held = held   # keeps the ids valid while this object lives
        sizes = [t.numel() for t in held]
        self.starts = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.full = int(sum(sizes[:len(full)]))
        #: ``(first position, float32 values)``: consecutive tensors' values, in order
        self.pieces: list[tuple[int, np.ndarray]] = []
        small: list[torch.Tensor] = []
        with torch.no_grad():
            for group in (full, rest):   # no piece straddles the end of the first ``full`` positions
                for t in group:
                    if t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() >= self.VIEW_MIN:
                        self._flush(small)
                        self.pieces.append((int(self.starts[self._segment[id(t)]]), t.detach().reshape(-1).numpy()))
                    else:
                        small.append(t)
                self._flush(small)

    def _flush(self, small: list[torch.Tensor]) -> None:
        if small:
            at = int(self.starts[self._segment[id(small[0])]])
            self.pieces.append((at, torch.cat([t.detach().reshape(-1).cpu().to(torch.float32) for t in small]).numpy()))
            small.clear()

    def segment(self, t: torch.Tensor) -> int | None:
        """The index of ``t`` among the held tensors, or None when ``t`` is not held."""
        return self._segment.get(id(t))

    def values(self, k: int) -> np.ndarray:
        """The float32 values of held tensor ``k`` (a view)."""
        a = int(self.starts[k])
        for at, v in reversed(self.pieces):
            if at <= a:
                return v[a - at:a - at + int(self.sizes[k])]
        raise IndexError(k)

    def label_like(self, lo: int, hi: int) -> np.ndarray:
        """Per held tensor, the number of label-like values (whole numbers in ``[lo, hi]``).
        Whole numbers are found first (trained weights hold few), then only those are
        range-checked and counted."""
        found = []
        with np.errstate(invalid="ignore"):
            for at, piece in self.pieces:
                for a in range(0, piece.size, _SCAN_CHUNK):   # temporaries that stay in cache
                    v = piece[a:a + _SCAN_CHUNK]
                    hit = np.flatnonzero(np.floor(v) == v)   # NaN: never; infinities: out of range
                    w = v[hit]
                    found.append(hit[(w >= lo) & (w <= hi)] + (at + a))
        where = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return np.bincount(np.searchsorted(self.starts, where, side="right") - 1, minlength=self.sizes.size)

    def nonnegative(self, k: int) -> bool:
        """Whether every value of held tensor ``k`` is ``>= 0`` (NaN is not)."""
        return bool(np.min(self.values(k)) >= 0)


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


def _plane_readings(t: torch.Tensor, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    """The ways a tensor is read as planes of a view's ``shape`` (``(rows, prod(shape))``,
    views where they can be, float64 once gathered), dimensions of 1 dropped: its last dimensions are ``shape``; its
    last dimension is the plane's size (flattened planes) or, for a vector, a multiple of it;
    its last dimensions are ``shape`` and up to 4 channels (channel-last)."""
    if t.is_complex():
        t = t.real
    size, k = math.prod(shape), len(shape)
    t = t.detach().cpu()
    if 1 in t.shape and t.numel() > 1:   # a channel or batch of one, anywhere
        t = t.squeeze()
    out = []
    if t.dim() >= k and tuple(t.shape[-k:]) == shape:
        out.append(("", t.reshape(-1, size)))
    elif t.dim() >= 1 and t.shape[-1] == size:
        out.append((" (as flattened planes)", t.reshape(-1, size)))
    elif t.dim() == 1 and t.numel() % size == 0 and t.numel() > size:
        out.append((f" (as {t.numel() // size} planes)", t.reshape(-1, size)))
    if t.dim() > k and tuple(t.shape[-k - 1:-1]) == shape and 2 <= t.shape[-1] <= 4:
        out.append((" (channel-last)", t.movedim(-1, -k - 1).reshape(-1, size)))
    return out


def _prefiltered(pieces: list[tuple[int, np.ndarray]], table: "np.ndarray | _Bitset",
                 vrange: tuple[np.uint32, np.uint32]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The positions (and bit patterns) in ``pieces`` (``(first position, float32 bits)``)
    that may hold a probe's pattern: values outside the probes' magnitude range ``vrange``
    are dropped by an integer comparison (the bit patterns of non-negative floats are
    ordered), the rest by the prefilter ``table`` (:func:`_value_slot`)."""
    lo, hi = vrange
    if hi < lo:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint32)
    tbits = table.size.bit_length() - 1
    where, values = [], []
    for first, piece in pieces:
        for a in range(0, piece.size, _SCAN_CHUNK):
            c = piece[a:a + _SCAN_CHUNK]
            mag = c & np.uint32(0x7FFFFFFF)
            np.subtract(mag, lo, out=mag)   # in range iff mag - lo (wrapping) <= hi - lo
            at = np.flatnonzero(mag <= hi - lo)
            if at.size:
                at = at[table[_value_slot(c[at], tbits)]]
            if at.size:
                where.append(at + (first + a))
                values.append(c[at])
    if not where:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint32)
    return np.concatenate(where), np.concatenate(values)


def _rolling_keys(codes: np.ndarray) -> np.ndarray:
    """:func:`_gram_keys` of every run of ``GRAM`` consecutive codes (``len - GRAM + 1`` keys)."""
    m = codes.size - GRAM + 1
    key = np.zeros(m, dtype=np.uint64)
    for k in range(GRAM):
        key += codes[k:k + m].astype(np.uint64) * _MULT[k]
    key ^= key >> np.uint64(31)
    key *= np.uint64(0x7FB5D329728EA185)
    key ^= key >> np.uint64(27)
    return key


_CHUNK = 1 << 20
#: values per step of the one-pass scans: their temporaries stay in the CPU's cache (about
#: twice as fast on a 2-core VM as whole-tensor passes, which stream every temporary through memory)
_SCAN_CHUNK = 1 << 16


# ---------------------------------------------------------------------- the guard
class ContentGuard:
    """Recognise a client's own labels and images in an outgoing message.

    Args:
        client_id: the client, for messages.
        datasets: the client's splits: name -> a dataset or a function building it (called
            at the first check; build it without training augmentation).
        loader_orders: per split, the sample orders of the client's training loader (the
            label vector in these orders is looked for too), or a function returning them.

    The reference of each dataset is built at the first check (one pass over its samples)
    and cached for the process, keyed by what the dataset holds.
    """

    def __init__(self, client_id: str, datasets: dict[str, Dataset | Callable[[], Dataset]],
                 loader_orders: dict[str, list[np.ndarray]] | Callable[[], dict[str, list[np.ndarray]]] | None = None
                 ) -> None:
        self.client_id = str(client_id)
        self._datasets = dict(datasets)
        self._orders = loader_orders
        self._index: _Index | None = None
        self._labels: list[tuple[str, np.ndarray]] = []
        self._varied: tuple[list[tuple[str, np.ndarray]], list[tuple[str, np.ndarray]]] | None = None

    @classmethod
    def for_client(cls, ctx: Any) -> "ContentGuard":
        """The guard of a :class:`~medfl.engine.client.ClientContext`: its splits seen
        without augmentation, and the orders of its training loader's first epochs."""
        splits = list(ctx.datasets)

        def plain(split: str) -> Callable[[], Dataset]:
            def build() -> Dataset:
                try:
                    return ctx.dataset(split, augment=False)
                except TypeError:   # a dataset factory without an augment switch
                    return ctx.dataset(split)
            key = getattr(ctx.datasets.get(split), "guard_key", None)
            if key:
                build.guard_key = key  # type: ignore[attr-defined]
            return build

        def orders() -> dict[str, list[np.ndarray]]:
            if "train" not in splits:
                return {}
            epochs = min(int(ctx.train.get("epochs", 1) or 1), LOADER_EPOCHS)
            try:
                return {"train": loader_orders(ctx.loader("train"), epochs)}
            except Exception:  # noqa: BLE001 - no loader to replay: the dataset order only
                return {}

        return cls(ctx.client_id, {s: plain(s) for s in splits}, orders)

    # -------------------------------------------------------------- reference
    def index(self) -> _Index:
        """The merged image reference of the client's splits (built on first use; the
        label vectors to look for are set at the same time)."""
        if self._index is None:
            refs, keys = [], []
            for split, ds in self._datasets.items():
                # a factory that names its samples (``guard_key``: the engine's datasets, the
                # same every round) is not built again once its reference is cached
                hint = getattr(ds, "guard_key", None) if callable(ds) and not isinstance(ds, Dataset) else None
                ref = _lru_get(_CACHE, f"key:{hint}") if hint else None
                if ref is not None:
                    key = f"key:{hint}"
                else:
                    if callable(ds) and not isinstance(ds, Dataset):
                        ds = ds()
                    key, ref = _cached_reference(ds)
                    if hint:
                        _lru_put(_CACHE, f"key:{hint}", ref, _CACHE_MAX)
                        key = f"key:{hint}"
                refs.append((split, ref))
                keys.append(f"{split}:{key}")
            orders = self._orders() if callable(self._orders) else (self._orders or {})
            labels = []
            for split, ref in refs:
                labels.append((f"{split} split", ref.labels))
                for e, order in enumerate(orders.get(split, []), 1):
                    if len(order) == ref.n:
                        labels.append((f"{split} split, in the order of training epoch {e}", ref.labels[order]))
            merged = _lru_get(_MERGED, tuple(keys))
            if merged is None:
                merged = _merge(refs)
                _lru_put(_MERGED, tuple(keys), merged, _MERGED_BYTES, weight=lambda ix: ix.nbytes)
            self._labels, self._index = labels, merged
        return self._index

    def split_labels(self, split: str) -> np.ndarray | None:
        """The label vector of ``split`` in the dataset's order, as the guard reads it (the
        labels a declared per-sample release may send in the clear), or ``None`` for a split
        the client does not have."""
        self.index()
        return next((y for name, y in self._labels if name == f"{split} split"), None)

    def stats(self) -> dict[str, Any]:
        """Samples covered, probes and memory of the reference (reports, benchmarks)."""
        ix = self.index()
        protected = ix.vneed > 0
        if "exact" in ix.gneed:
            protected = protected | (ix.gneed["exact"].reshape(-1, _AXES) > 0).any(axis=1)
        ref_bytes = ix.vbits.nbytes + ix.vsample.nbytes + sum(y.nbytes for _, y in self._labels)
        ref_bytes += sum(k.nbytes + p.nbytes for k, p in ix.grams.values())
        ref_bytes += sum(g.nbytes for g in ix.ggroup.values())
        ref_bytes += sum(sig.nbytes + who.nbytes for sig, who in ix.planes.values()) + ix.ckeys.nbytes + ix.csample.nbytes
        tables = sum(t.nbytes for t in (ix.vtable, ix.ctable, *ix.gtable.values()) if t is not None)
        signed = np.zeros(len(ix.names), dtype=bool)
        for _, who in ix.planes.values():
            signed[who] = True
        return {"samples": len(ix.names), "unprotected_samples": int((~protected).sum()),
                "value_probes": int(ix.vbits.size),
                "gram_probes": {v: int(g[0].size) for v, g in ix.grams.items()},
                "plane_signatures": {f"{view} {'x'.join(map(str, shape))}": int(sig.shape[0])
                                     for (view, shape), (sig, _) in ix.planes.items()},
                "samples_without_plane_signature": int((~signed).sum()), "crop_probes": int(ix.ckeys.size),
                "label_vectors": len(self._labels), "reference_bytes": int(ref_bytes), "table_bytes": int(tables)}

    # -------------------------------------------------------------- the check
    def check(self, value: Any, where: str, exempt: frozenset[str] = frozenset()) -> None:
        """Refuse ``value`` if it holds the client's labels or images.

        Args:
            value: an outgoing message part (a reply's payload or metrics, a model state).
            where: its readable location, e.g. ``"reply of method 'x' from client 3"``.
            exempt: top-level keys not checked (a declared per-sample release's keys, whose
                noise medfl adds before they leave: ``SampleRelease``).

        Raises:
            PayloadError: naming the key path, the client, the split and what was found.
        """
        leaves = _Leaves()
        _walk(value, "", leaves, exempt, True)
        if not (leaves.tensors or leaves.scalars or leaves.stacks):
            return
        ix = self.index()
        floats = _Floats([t for _, t in leaves.tensors], [t for _, t in leaves.stacks])
        self._check_labels(ix, leaves, where, floats)
        self._check_images(ix, leaves, where, floats)
        self._check_crops(ix, leaves, where, floats)
        self._check_planes(ix, leaves, where)

    def _fail(self, msg: str) -> None:
        from medfl.messages import PayloadError

        raise PayloadError(msg)

    def _varied_labels(self) -> list[tuple[str, np.ndarray]]:
        """The label vectors worth looking for: more than one sample, more than one value
        (a constant vector carries no surprise); worked out once per reference."""
        if self._varied is None or self._varied[0] is not self._labels:
            self._varied = (self._labels, [(d, y) for d, y in self._labels if len(y) > 1 and np.unique(y).size > 1])
        return self._varied[1]

    def _check_labels(self, ix: _Index, leaves: _Leaves, where: str, floats: _Floats) -> None:
        labels = self._varied_labels()
        if not labels:
            return
        sizes = {len(y) for _, y in labels}
        shortest = min(sizes)
        tensors = [(path, t) for path, t in leaves.tensors + leaves.stacks if t.numel() >= shortest]
        runs = _may_hold_runs([t for _, t in tensors], min(int(y.min()) for _, y in labels),
                              max(int(y.max()) for _, y in labels), shortest, floats)
        seqs: list[tuple[str, np.ndarray, bool, bool]] = []
        for (path, t), can_run in zip(tensors, runs):
            # a tensor without a run is read only as class blocks: shapes that fit, values >= 0
            if can_run or (_block_shapes(tuple(t.shape), sizes, t.dim() == 1) and _nonnegative(t, floats)):
                seqs.append((path, _numeric(t), t.dim() == 1, can_run))
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

    def _check_images(self, ix: _Index, leaves: _Leaves, where: str, floats: _Floats) -> None:
        vhits: dict[str, np.ndarray] = {}                       # path -> matched value-probe ids
        ghits: dict[str, dict[str, np.ndarray]] = {}            # variant -> path -> matched positions
        held: list[tuple[str, int]] = []                        # float32/float64 tensors: (path, segment)
        items: list[tuple[str, Any]] = []
        for path, t in leaves.tensors:
            k = floats.segment(t)
            if k is not None and t.dtype in _Floats.FULL:
                held.append((path, k))
            else:
                items.append((path, t))
        items += [(path, arr.astype(np.float32).reshape(-1)) for path, arr in leaves.lists]
        if leaves.scalars:
            items.append((f" (the message's {len(leaves.scalars)} numbers)",
                          np.asarray(leaves.scalars, dtype=np.float32)))
        if held and ix.vtable is not None:
            # every float tensor's values in one lookup; the probes hit are then told apart
            # by tensor (for the error message), which costs a call only per tensor hit
            at = self._value_positions(ix, [(a, v.view(np.uint32)) for a, v in floats.pieces if a < floats.full])
            if at.size:
                seg = np.searchsorted(floats.starts, at, side="right") - 1
                for path, k in held:
                    mine = at[seg == k] - floats.starts[k]
                    if mine.size:
                        bits = floats.values(k).view(np.uint32)
                        vhits[path] = ix.probe_ids(bits[mine])
        if "exact" in ix.grams:
            for path, k in held:
                self._gram_hits(ix, "exact", floats.values(k).view(np.uint32), path, ghits)
        for path, t in items:
            if isinstance(t, torch.Tensor):
                t = t.detach().cpu()
                if t.is_complex():
                    t = t.real
                if t.dtype in (torch.float16, torch.bfloat16):
                    variant = "f16" if t.dtype == torch.float16 else "bf16"
                    codes = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
                    self._gram_hits(ix, variant, codes, path, ghits)
                    continue
                values = t.to(torch.float32).contiguous().numpy().reshape(-1)
            else:
                values = t
            bits = values.view(np.uint32)
            if ix.vtable is not None:
                hit = self._value_hits(ix, bits)
                if hit.size:
                    vhits[path] = hit
            self._gram_hits(ix, "exact", bits, path, ghits)
        if vhits:
            hits = np.unique(np.concatenate(list(vhits.values())))
            per_sample = np.bincount(ix.vsample[hits], minlength=len(ix.names))
            bad = np.nonzero((ix.vneed > 0) & (per_sample >= ix.vneed))[0]
            if bad.size:
                s = int(bad[np.argmax(per_sample[bad] / ix.vneed[bad])])
                path = max(vhits, key=lambda p: int((ix.vsample[vhits[p]] == s).sum()))
                self._image_error(ix, where, path, s, int(per_sample[s]), int((ix.vsample == s).sum()),
                                  "probe values", bad.size)
        for variant, by_path in ghits.items():
            group = ix.ggroup[variant]
            hits = np.unique(np.concatenate(list(by_path.values())))
            per_group = np.bincount(group[hits], minlength=len(ix.names) * _AXES)
            need = ix.gneed[variant]
            bad = np.nonzero((need > 0) & (per_group >= need))[0]
            if bad.size:
                g = int(bad[np.argmax(per_group[bad] / need[bad])])
                path = max(by_path, key=lambda p: int((group[by_path[p]] == g).sum()))
                name = {"f16": "float16", "bf16": "bfloat16", "exact": "float32"}[variant]
                self._image_error(ix, where, path, g // _AXES, int(per_group[g]), int((group == g).sum()),
                                  f"runs of {GRAM} pixels along axis {g % _AXES} (as {name})",
                                  np.unique(bad // _AXES).size)

    def _check_crops(self, ix: _Index, leaves: _Leaves, where: str, floats: _Floats) -> None:
        """Refuse a message in which a crop probe's run of exact pixels occurs (a crop of
        at least :data:`CROP` pixels a side of an image, in float32 or float64, or a list)."""
        if ix.ctable is None:
            return
        paths = {floats.segment(t): path for path, t in leaves.tensors if t.dtype in _Floats.FULL}
        pieces = [(path, [(a, v.view(np.uint32)) for a, v in floats.pieces if a < floats.full])
                  for path in [None] if paths]
        pieces += [(path, [(0, arr.astype(np.float32).reshape(-1).view(np.uint32))]) for path, arr in leaves.lists]
        hits: dict[str, np.ndarray] = {}                        # path -> samples hit
        for path, parts in pieces:
            for first, bits in parts:
                peaks, _ = _prefiltered([(0, bits)], ix.ctable, ix.crange)
                at = np.unique((peaks[:, None] - np.arange(CROP)).reshape(-1))   # the runs holding a peak
                at = at[(at >= 0) & (at <= bits.size - CROP)]
                if not at.size:
                    continue
                keys = _gram_keys(bits[at[:, None] + np.arange(CROP)])
                k = np.minimum(np.searchsorted(ix.ckeys, keys), ix.ckeys.size - 1)
                hit = ix.ckeys[k] == keys
                if not hit.any():
                    continue
                if path is None:   # the held tensors: tell them apart by position
                    seg = np.searchsorted(floats.starts, at[hit] + first, side="right") - 1
                    for s in np.unique(seg).tolist():
                        named = paths.get(s, " (a stack of small tensors)")
                        hits[named] = np.concatenate([hits.get(named, np.zeros(0, np.int64)),
                                                      ix.csample[k[hit][seg == s]]])
                else:
                    hits[path] = np.concatenate([hits.get(path, np.zeros(0, np.int64)), ix.csample[k[hit]]])
        if hits:
            per_sample = np.bincount(np.concatenate(list(hits.values())), minlength=len(ix.names))
            s = int(np.argmax(per_sample))
            path = max(hits, key=lambda p: int((hits[p] == s).sum()))
            self._image_error(ix, where, path, s, int(per_sample[s]), int((ix.csample == s).sum()),
                              f"runs of {CROP} pixels (crop probes: a crop of {CROP} x {CROP} pixels or more)",
                              int((per_sample > 0).sum()))

    def _check_planes(self, ix: _Index, leaves: _Leaves, where: str) -> None:
        """Refuse a message holding a plane that correlates with a sample's plane signature
        (:data:`PLANE_MIN_CORR`): an image, or an image halved in size, scaled, shifted,
        quantised (per-image min-max to uint8) or with a little noise. A tensor is read as
        planes of a view's shape when its last dimensions are that shape, its last dimension
        (or a vector's whole length) is a multiple of the plane's size, or it holds planes
        channel-last (:func:`_plane_readings`)."""
        if not ix.planes:
            return
        found: list[tuple[float, int, str, tuple[str, tuple[int, ...]]]] = []
        values = [(path, t) for path, t in leaves.tensors + leaves.stacks if t.dtype != torch.bool]
        values += [(path, torch.from_numpy(arr)) for path, arr in leaves.lists]
        for key, (sig, who) in ix.planes.items():
            pos = torch.from_numpy(plane_positions(key[1]))
            for path, t in values:
                for how, rows in _plane_readings(t, key[1]):
                    std, varied = _standardised(rows[:, pos].to(torch.float64).numpy(), False)
                    std = std[varied]
                    step = max(1, (1 << 22) // max(sig.shape[0], 1))
                    for a in range(0, std.shape[0], step):
                        corr = std[a:a + step] @ sig.T.astype(np.float64)
                        r, c = np.nonzero(corr >= PLANE_MIN_CORR)
                        found += [(float(corr[i, j]), int(who[j]), path + how, key) for i, j in zip(r, c)]
        if not found:
            return
        corr, sample, path, (view, shape) = max(found)
        split, i = ix.names[sample]
        others = len({f[1] for f in found}) - 1
        more = f" (and {others} more of its samples)" if others else ""
        what = {"full": "its pixels", "mean2": "its 2 x 2 means (the image halved in size)",
                "step2": "every second pixel of it (the image halved in size)"}[view]
        self._fail(f"{where}{path}: holds image {i} of client {self.client_id}'s {split} split{more}, transformed: "
                   f"a plane of {'x'.join(map(str, shape))} values correlates with {what} at "
                   f"{plane_positions(shape).size} pixels ({corr:.4f}; a scaled, shifted, quantised, resampled or "
                   f"noisy copy); images never leave a client")

    @staticmethod
    def _value_positions(ix: _Index, bits: np.ndarray | list[tuple[int, np.ndarray]]) -> np.ndarray:
        """The positions in ``bits`` (float32 bit patterns, or ``(first position, bits)``
        pieces of one sequence) holding a value probe's pattern: :func:`_prefiltered`, then
        exactly (once for all pieces)."""
        pieces = [(0, bits)] if isinstance(bits, np.ndarray) else bits
        where, values = _prefiltered(pieces, ix.vtable, ix.vrange)   # type: ignore[arg-type]
        return where[ix.probe_values(values)]

    @classmethod
    def _value_hits(cls, ix: _Index, bits: np.ndarray) -> np.ndarray:
        """The value probes (ids) whose float32 bit pattern occurs in ``bits``."""
        at = cls._value_positions(ix, bits)
        if not at.size:
            return np.zeros(0, dtype=np.int64)
        return ix.probe_ids(bits[at])

    def _gram_hits(self, ix: _Index, variant: str, codes: np.ndarray, path: str,
                   ghits: dict[str, dict[str, np.ndarray]]) -> None:
        """Record which gram positions of ``variant`` occur in ``codes`` (a flattened tensor)."""
        if variant not in ix.grams or codes.size < GRAM:
            return
        keys, pos = ix.grams[variant]
        table = ix.gtable[variant]
        tbits = table.size.bit_length() - 1
        m = codes.size - GRAM + 1
        found = []
        for a in range(0, m, _CHUNK):
            k = _rolling_keys(codes[a:min(m, a + _CHUNK) + GRAM - 1])
            cand = k[table[_key_slot(k, tbits)]]
            if cand.size:
                hit = np.isin(keys, cand)
                if hit.any():
                    found.append(pos[hit])
        if found:
            ghits.setdefault(variant, {})[path] = np.unique(np.concatenate(found))

    def _image_error(self, ix: _Index, where: str, path: str, sample: int, hits: int, total: int,
                     what: str, count: int) -> None:
        split, i = ix.names[sample]
        more = f" (and {count - 1} more of its samples)" if count > 1 else ""
        self._fail(f"{where}{path}: holds image {i} of client {self.client_id}'s {split} split{more}: "
                   f"{hits} of its {total} {what} occur in it; images never leave a client")


def loader_orders(loader: DataLoader, epochs: int) -> list[np.ndarray]:
    """The sample order of each of the first ``epochs`` passes over ``loader`` (a shuffling
    loader with its own generator, as :meth:`ClientContext.loader` builds), replayed on
    sample indices without reading a sample."""
    gen = getattr(loader, "generator", None)
    if gen is None or not isinstance(loader.sampler, torch.utils.data.RandomSampler):
        return []
    n = len(loader.dataset)  # type: ignore[arg-type]
    replay = torch.Generator()
    replay.set_state(gen.get_state())
    # one batch per pass: the order is the sampler's whatever the batch size (without
    # drop_last), and collating 1 batch instead of n / batch_size is what costs here
    idx = DataLoader(range(n), batch_size=max(n, 1), shuffle=True, generator=replay)  # type: ignore[arg-type]
    out = []
    for _ in range(max(0, epochs)):
        order = [b.reshape(-1) for b in idx]
        out.append(torch.cat(order).numpy() if order else np.zeros(0, dtype=np.int64))
    return out
