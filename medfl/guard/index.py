"""A client's index: its splits' references merged, with prefilter tables, and the caches.

:func:`_merge` joins the references of a client's splits (:mod:`medfl.guard.reference`) into
one :class:`_Index`: global sample numbers, the probes with the hits each sample needs
(:func:`_need`), and prefilter tables (:func:`_table`, :class:`_Bitset`) that drop most of a
message's values with one lookup before the exact comparison. Split references are cached
per process by fingerprint (:func:`_cached_reference`), merged indices by the client's
splits, in bytes (:data:`_MERGED`); :func:`clear_reference_cache` forgets both.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset

from medfl.guard.params import _AXES, _VARIANTS, IMAGE_FRACTION, MIN_VALUE_PROBES
from medfl.guard.reference import SplitReference, _fingerprint, build_split_reference

__all__ = ["clear_reference_cache"]

_TABLE_BITS = 20                   # prefilter tables: at most 2**20 booleans (1 MiB) ...
_TABLE_MIN_BITS = 12               # ... at least 2**12, and 16 slots per probe in between
_TABLE_SLOTS_PER_PROBE = 16        # (a random value passes the prefilter with odds <= 1/16)
_CACHE: "OrderedDict[str, SplitReference]" = OrderedDict()
_CACHE_MAX = 256                   # split references (about 1.5 KB per sample each)
_MERGED: "OrderedDict[tuple[str, ...], _Index]" = OrderedDict()   # a client's splits, merged
_MERGED_BYTES = 32 << 20          # merged indices kept, in bytes (tables sized to the probes: ~0.5-1 MiB a client)
_log = logging.getLogger("medfl.guard")
_LOCK = threading.Lock()


def _lru_get(cache: "OrderedDict[Any, Any]", key: Any) -> Any:
    """The value kept under ``key`` (now the most recently used), or None."""
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
    cpeaks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))   # each key's largest pixel
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
                  *(a for pair in self.planes.values() for a in pair), self.ckeys, self.csample, self.cpeaks]
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
    """A prefilter table of ``2 ** tbits`` booleans, True at ``slots``."""
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
    """The prefilter slot of each float32 bit pattern: its low ``tbits`` bits."""
    return (bits & np.uint32((1 << tbits) - 1)).astype(np.intp)


def _key_slot(keys: np.ndarray, tbits: int) -> np.ndarray:
    """The prefilter slot of each 64-bit key: its high ``tbits`` bits."""
    return (keys >> np.uint64(64 - tbits)).astype(np.intp)


def _magnitude_range(vbits: np.ndarray) -> tuple[np.uint32, np.uint32]:
    """The smallest and largest magnitude among float32 bit patterns (``(1, 0)``: none)."""
    if not vbits.size:
        return np.uint32(1), np.uint32(0)
    mag = vbits & np.uint32(0x7FFFFFFF)
    return mag.min(), mag.max()


def _merge(refs: list[tuple[str, SplitReference]]) -> _Index:
    """The merged index of a client's split references (``(split, reference)``, in order)."""
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
        index.cpeaks = np.unique(first)
    return index
