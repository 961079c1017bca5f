"""The guard's scans where the tensors are: a message on a GPU is checked there.

A reply computed on a GPU used to be checked on the host: every tensor copied off the device
(once for the value scans, again for each plane-signature view), which a CPU run does not
pay and which made a GPU round twice as slow (issue 50). Here the scans that read every value
of a message run with torch on the device that holds it, and only what they find comes back:

- :class:`_DeviceFloats` gathers the message's real floating-point tensors into one float32
  buffer on the device (as :class:`~medfl.guard.walk._Floats` does on the host, with the same
  positions) and answers the label check's per-tensor counts (label-like values, negative
  values) in one copy of two small vectors;
- value probes: each float32 bit pattern is looked up exactly in the probes' sorted patterns
  (``torch.searchsorted``); only the positions that hit (almost never in weights) come back;
- gram probes: the 64-bit keys of every run of :data:`~medfl.guard.params.GRAM` codes are
  computed on the device (:func:`_rolling_keys_torch`, the same keys as
  :func:`~medfl.guard.probes._gram_keys`) and looked up in the probes' sorted keys; only the
  keys that hit come back;
- crop probes: the positions holding a crop probe's largest pixel exactly are found on the
  device; the :data:`~medfl.guard.params.CROP` runs around them (a handful) come back to be
  hashed;
- plane signatures read only the signature positions of each plane on the device
  (:func:`~medfl.guard.images._plane_readings` gathers them before any copy).

Every check keeps its host decisions (thresholds, surprise, error messages), so a message
gets the same verdict and the same error on either path; the exact lookups replace the host's
prefilter tables, which only ever dropped values that cannot match. :data:`SCAN` chooses the
path; tests set it to ``"device"`` to run this code on the CPU device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from medfl.guard.index import _Index
from medfl.guard.params import CROP, GRAM
from medfl.guard.probes import _MULT
from medfl.guard.walk import _Floats, _Leaves

__all__ = ["SCAN", "DeviceReads"]

#: Where a message is scanned: ``"auto"`` (with torch on the device of its tensors when any is
#: on a GPU, else with NumPy on the host), ``"device"`` (always with torch, on the CPU device
#: for a CPU message: what the tests use to run the GPU code without a GPU) or ``"host"``
#: (always NumPy: tensors on a GPU are copied off it). Set from the environment variable
#: ``MEDFL_GUARD_SCAN`` at import; anything else there is refused at the first check.
SCAN = os.environ.get("MEDFL_GUARD_SCAN", "auto")

#: values per step of a device scan (bounds its temporaries: 8 bytes a value for gram keys)
_DEVICE_CHUNK = 1 << 22

#: the multipliers of :func:`~medfl.guard.probes._gram_keys` as the int64 values torch multiplies by
_MULT_SIGNED = [int(v) for v in _MULT.view(np.int64)]
_MIX_SIGNED = int(np.array([0x7FB5D329728EA185], dtype=np.uint64).view(np.int64)[0])


class DeviceReads(TorchFunctionMode):
    """Count, inside ``with DeviceReads() as reads:``, the calls that copy a tensor off its
    device or wait for it (``.cpu()``, ``.item()``, ``.tolist()``, ``nonzero``, ``unique``...):
    on a GPU each one synchronises with it, so ``reads.count`` is what a check pays there,
    measured on any machine (the benchmarks and tests count the guard's)."""

    READS = frozenset({"cpu", "item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "unique", "_unique2"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Count ``func`` when it reads off the device, then call it."""
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _scan_device(leaves: _Leaves) -> torch.device | None:
    """The device a message's scans run on (:data:`SCAN`): the first non-CPU device holding
    one of its tensors, the CPU device when :data:`SCAN` is ``"device"``, or ``None`` (the
    host path)."""
    if SCAN not in ("auto", "device", "host"):
        raise ValueError(f"MEDFL_GUARD_SCAN (medfl.guard.device.SCAN) is {SCAN!r}: expected auto, device or host")
    if SCAN == "host":
        return None
    for _, t in leaves.tensors + leaves.stacks:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu") if SCAN == "device" else None


def _signed(a: np.ndarray) -> np.ndarray:
    """Unsigned codes viewed as the signed integers torch compares, sorted that way."""
    return np.sort(np.unique(a).view(np.int32 if a.dtype == np.uint32 else np.int64))


@dataclass
class _Probes:
    """One kind of probe on a device: its codes sorted for ``torch.searchsorted`` (signed, as
    torch compares them) and the index's prefilter table over them (``table[slot(code)]``;
    a bit set when ``bitset``), which drops most of a message's values in one gather before
    the exact search (on a CPU, a binary search per value costs 4 times the table)."""

    codes: torch.Tensor
    table: torch.Tensor
    slot: Callable[[torch.Tensor], torch.Tensor]
    bitset: bool = False

    def find(self, x: torch.Tensor) -> torch.Tensor:
        """The positions of ``x`` (same dtype, 1-D) whose code is a probe's, exactly, looked
        up :data:`_DEVICE_CHUNK` values at a time (bounding the temporaries)."""
        if not self.codes.numel() or not x.numel():
            return torch.zeros(0, dtype=torch.int64, device=x.device)
        if x.numel() > _DEVICE_CHUNK:
            return torch.cat([self.find(x[a:a + _DEVICE_CHUNK]) + a for a in range(0, x.numel(), _DEVICE_CHUNK)])
        slots = self.slot(x)
        if self.bitset:
            maybe = ((self.table[slots >> 3].to(torch.int32) >> (slots & 7).to(torch.int32)) & 1).bool()
        else:
            maybe = self.table[slots]
        at = torch.nonzero(maybe).reshape(-1)
        return at[_lookup(self.codes, x[at])]


@dataclass
class _DeviceTables:
    """An index's probes on one device (built on first use, kept with the index): value
    patterns as int32, gram keys per variant as int64, crop probes' largest pixels."""

    device: torch.device
    values: _Probes | None = None
    grams: dict[str, _Probes] = field(default_factory=dict)
    peaks: _Probes | None = None


def _low_bits(tbits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The slot of a value's bit pattern: its low ``tbits`` bits (:func:`~medfl.guard.index._value_slot`)."""
    return lambda x: (x & ((1 << tbits) - 1)).long()


def _high_bits(tbits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The slot of a 64-bit key: its high ``tbits`` bits (:func:`~medfl.guard.index._key_slot`)."""
    return lambda x: _lsr(x, 64 - tbits)


def _device_tables(ix: _Index, device: torch.device) -> _DeviceTables:
    """The tables of ``ix`` on ``device``, kept with the index (one copy per device)."""
    cache = ix.__dict__.setdefault("_device_tables", {})
    tables = cache.get(str(device))
    if tables is None:
        on = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device))   # noqa: E731
        tables = cache[str(device)] = _DeviceTables(device)
        if ix.vtable is not None:
            tables.values = _Probes(on(_signed(ix.vbits)), on(ix.vtable), _low_bits(ix.vtable.size.bit_length() - 1))
        for v, (keys, _) in ix.grams.items():
            table = ix.gtable[v]
            tables.grams[v] = _Probes(on(_signed(keys)), on(table), _high_bits(table.size.bit_length() - 1))
        if ix.ctable is not None:
            tables.peaks = _Probes(on(_signed(ix.cpeaks)), on(ix.ctable.bits),
                                   _low_bits(ix.ctable.size.bit_length() - 1), bitset=True)
    return tables


def _lookup(sorted_ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Whether each of ``x`` is among ``sorted_ref`` (same dtype and device), exactly."""
    if not sorted_ref.numel():
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    at = torch.searchsorted(sorted_ref, x).clamp_(max=sorted_ref.numel() - 1)
    return sorted_ref[at] == x


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values holding unsigned 64-bit ones."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _rolling_keys_torch(codes: torch.Tensor, width: int = GRAM) -> torch.Tensor:
    """The 64-bit key (as int64) of every run of ``width`` consecutive ``codes`` (non-negative
    int64 holding uint16/uint32 codes): bit for bit the keys of
    :func:`~medfl.guard.probes._gram_keys` (int64 products wrap as uint64 ones do)."""
    m = codes.numel() - width + 1
    key = torch.zeros(max(m, 0), dtype=torch.int64, device=codes.device)
    if m <= 0:
        return key
    for k in range(width):
        key.add_(codes[k:k + m], alpha=_MULT_SIGNED[k])
    key ^= _lsr(key, 31)
    key *= _MIX_SIGNED
    key ^= _lsr(key, 27)
    return key


class _DeviceFloats(_Floats):
    """:class:`~medfl.guard.walk._Floats` on a device: the same tensors, positions, segments
    and answers, from one float32 buffer on ``device`` (tensors elsewhere are copied to it).
    Its :attr:`pieces` stay empty: the image checks ask it for hits
    (:meth:`value_hits`, :meth:`gram_hits`, :meth:`crop_runs`) instead of reading values."""

    GATHER = True

    def __init__(self, tensors: list[torch.Tensor], more: list[torch.Tensor] | tuple[()] = (),
                 device: torch.device = torch.device("cpu")) -> None:
        full, rest = self._hold(tensors, more)
        held = full + rest
        self.device = device
        self.pieces = []
        with torch.no_grad():
            self.flat = (torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in held])
                         if held else torch.zeros(0, dtype=torch.float32, device=device))
        self._counts: dict[tuple[int, int], np.ndarray] = {}
        self._negative: np.ndarray | None = None

    def _per_segment(self, masks: list[torch.Tensor]) -> np.ndarray:
        """How many True values of each mask (over :attr:`flat`) each held tensor holds:
        ``(len(masks), tensors)``, in one copy off the device."""
        if not self.sizes.size:
            return np.zeros((len(masks), 0), dtype=np.int64)
        ends = torch.from_numpy(self.starts + self.sizes - 1).to(self.device)
        before = torch.from_numpy(np.maximum(self.starts - 1, 0)).to(self.device)
        first = torch.from_numpy(self.starts == 0).to(self.device)
        out = []
        for m in masks:
            cs = torch.cumsum(m, 0, dtype=torch.int64)
            out.append(cs[ends] - torch.where(first, torch.zeros_like(cs[before]), cs[before]))
        return torch.stack(out).cpu().numpy()

    def label_like(self, lo: int, hi: int) -> np.ndarray:
        """Per held tensor, the number of label-like values (whole numbers in ``[lo, hi]``),
        and (kept for :meth:`nonnegative`) of values that are not ``>= 0``: counted on the device."""
        key = (int(lo), int(hi))
        if key not in self._counts:
            v = self.flat
            like = (torch.floor(v) == v) & (v >= lo) & (v <= hi)
            counts, negative = self._per_segment([like, ~(v >= 0)])
            self._counts[key], self._negative = counts, negative
        return self._counts[key]

    def nonnegative(self, k: int) -> bool:
        """Whether every value of held tensor ``k`` is ``>= 0`` (NaN is not)."""
        if self._negative is None:
            self._negative = self._per_segment([~(self.flat >= 0)])[0]
        return bool(self._negative[k] == 0)

    def values(self, k: int) -> np.ndarray:
        """The float32 values of held tensor ``k``, copied off the device (a tensor read in
        full: the label search of a tensor that may hold labels)."""
        a = int(self.starts[k])
        return self.flat[a:a + int(self.sizes[k])].cpu().numpy()

    def value_hits(self, tables: _DeviceTables) -> tuple[np.ndarray, np.ndarray]:
        """The positions among the first :attr:`full` values (float32/float64 tensors) whose
        bit pattern is a value probe's, and those patterns (uint32)."""
        bits = self.flat[:self.full].view(torch.int32)
        if tables.values is None or not bits.numel():
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint32)
        at = tables.values.find(bits)
        return at.cpu().numpy(), bits[at].cpu().numpy().view(np.uint32)

    def gram_hits(self, tables: _DeviceTables, variant: str) -> list[tuple[int, np.ndarray]]:
        """Per float32/float64 tensor (its index), the exact gram keys of ``variant`` that
        occur in it (runs inside one tensor: a run across two is not a flattened tensor's)."""
        n = int(np.searchsorted(self.starts, self.full))   # the float32/float64 tensors
        codes = self.flat[:self.full].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return _segmented(tables.grams[variant], codes, self.starts[:n], self.sizes[:n], GRAM)

    def crop_runs(self, tables: _DeviceTables) -> tuple[np.ndarray, np.ndarray]:
        """The runs of :data:`CROP` values among the first :attr:`full` values that hold a crop
        probe's largest pixel exactly: their first positions and their bits (``(runs, CROP)``
        uint32), copied off the device (a handful: weights hold few exact image pixels)."""
        bits = self.flat[:self.full].view(torch.int32)
        n = bits.numel()
        if n < CROP or tables.peaks is None:
            return np.zeros(0, dtype=np.int64), np.zeros((0, CROP), dtype=np.uint32)
        peaks = tables.peaks.find(bits)
        if not peaks.numel():
            return np.zeros(0, dtype=np.int64), np.zeros((0, CROP), dtype=np.uint32)
        offsets = torch.arange(CROP, device=bits.device)
        at = torch.unique((peaks[:, None] - offsets).reshape(-1))
        at = at[(at >= 0) & (at <= n - CROP)]
        runs = bits[at[:, None] + offsets]
        return at.cpu().numpy(), runs.cpu().numpy().view(np.uint32)


def _segmented(probes: _Probes, codes: torch.Tensor, starts: np.ndarray, sizes: np.ndarray, width: int
               ) -> list[tuple[int, np.ndarray]]:
    """Per segment of ``codes`` (``starts``, ``sizes``: consecutive tensors), the probes found
    inside it: gram keys (uint64) of runs of ``width`` codes that do not cross into the next
    segment (``width`` :data:`GRAM`), or value patterns (uint32; ``width`` 1)."""
    if width == 1:
        at_t = probes.find(codes)
        at, found = at_t.cpu().numpy(), codes[at_t].cpu().numpy().view(np.uint32)
    else:
        at, found = _gram_key_hits(probes, codes)
    if not at.size:
        return []
    seg = np.searchsorted(starts, at, side="right") - 1
    inside = at - starts[seg] + width <= sizes[seg]
    return [(int(s), found[inside & (seg == s)]) for s in np.unique(seg[inside]).tolist()]


def _item_hits(tables: _DeviceTables, items: list[torch.Tensor]
               ) -> tuple[list[tuple[int, np.ndarray]], dict[str, list[tuple[int, np.ndarray]]]]:
    """The value and gram probes in tensors that are not float32/float64 (integers, booleans,
    float16/bfloat16), a few lookups for all of them: ``(value patterns per item, gram keys
    per variant per item)``, items by their index in ``items``. Float16/bfloat16 tensors are
    looked up by their codes (gram probes of their precision); the others as float32 values
    (value probes and exact gram probes)."""
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {"f16": [], "bf16": [], "exact": []}
    for i, t in enumerate(items):
        t = t.detach().to(tables.device)
        t = t.real if t.is_complex() else t
        if t.dtype in (torch.float16, torch.bfloat16):
            codes = t.contiguous().reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
            groups["f16" if t.dtype == torch.float16 else "bf16"].append((i, codes))
        else:
            groups["exact"].append((i, t.to(torch.float32).contiguous().reshape(-1).view(torch.int32)))
    values: list[tuple[int, np.ndarray]] = []
    grams: dict[str, list[tuple[int, np.ndarray]]] = {}
    for variant, parts in groups.items():
        if not parts:
            continue
        sizes = np.asarray([c.numel() for _, c in parts], dtype=np.int64)
        starts = np.cumsum(np.concatenate([[0], sizes[:-1]])).astype(np.int64)
        codes = torch.cat([c for _, c in parts])
        if variant == "exact" and tables.values is not None:
            values = [(parts[k][0], v) for k, v in _segmented(tables.values, codes, starts, sizes, 1)]
        if variant in tables.grams:
            wide = codes.to(torch.int64) & 0xFFFFFFFF if variant == "exact" else codes
            grams[variant] = [(parts[k][0], v) for k, v in _segmented(tables.grams[variant], wide, starts, sizes, GRAM)]
    return values, grams


def _gram_key_hits(probes: _Probes, codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The start positions of the runs of :data:`GRAM` ``codes`` (int64 on a device) whose key
    is one of ``probes``, and those keys (as uint64), copied off the device."""
    m = codes.numel() - GRAM + 1
    found_at, found = [], []
    for a in range(0, max(m, 0), _DEVICE_CHUNK):
        keys = _rolling_keys_torch(codes[a:min(m, a + _DEVICE_CHUNK) + GRAM - 1])
        at = probes.find(keys)
        if at.numel():
            found_at.append(at + a)
            found.append(keys[at])
    if not found:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
    return torch.cat(found_at).cpu().numpy(), torch.cat(found).cpu().numpy().view(np.uint64)
