"""The image checks: a client's samples looked for in an outgoing message.

:class:`_ImageCheck` holds the checks :class:`~medfl.guard.ContentGuard` runs after the
label check: value and gram probes (``_check_images``: a probe value anywhere in a float
tensor, a run of pixels in a flattened one, through the prefilter tables of
:func:`_prefiltered` and :func:`_rolling_keys`), crop probes (``_check_crops``) and plane
signatures (``_check_planes``: a message's tensors read as planes, :func:`_plane_readings`,
and correlated with the signatures).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from medfl.guard.device import _device_tables, _DeviceFloats, _item_hits
from medfl.guard.index import _Bitset, _Index, _key_slot, _value_slot
from medfl.guard.params import _AXES, CROP, GRAM, PLANE_MIN_CORR
from medfl.guard.probes import _MULT, _gram_keys, _standardised, plane_positions
from medfl.guard.walk import _SCAN_CHUNK, _Floats, _Leaves

__all__: list[str] = []

#: keys computed per step of a gram scan (:meth:`_ImageCheck._gram_hits`)
_CHUNK = 1 << 20


def _plane_readings(t: torch.Tensor, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    """The ways a tensor is read as planes of a view's ``shape`` (``(rows, prod(shape))``,
    views where they can be, on the tensor's device: the caller gathers the signature
    positions before copying anything off it), dimensions of 1 dropped: its last dimensions are ``shape``; its
    last dimension is the plane's size (flattened planes) or, for a vector, a multiple of it;
    its last dimensions are ``shape`` and up to 4 channels (channel-last)."""
    if t.is_complex():
        t = t.real
    size, k = math.prod(shape), len(shape)
    t = t.detach()
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


def _to_host(parts: list[tuple[str, torch.Tensor]]) -> list[tuple[str, np.ndarray]]:
    """``parts`` (name, 2-D tensor of one width, wherever it lies) as float64 NumPy arrays, in
    order, in one copy off each device (a GPU waits once, not once per tensor)."""
    out: list[np.ndarray | None] = [None] * len(parts)
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(parts):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        whole = torch.cat([parts[i][1].to(torch.float64) for i in idx]).cpu().numpy()
        at = 0
        for i in idx:
            rows = parts[i][1].shape[0]
            out[i], at = whole[at:at + rows], at + rows
    return [(name, a) for (name, _), a in zip(parts, out)]   # type: ignore[misc]


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


class _ImageCheck:
    """The image checks of :class:`~medfl.guard.ContentGuard` (which inherits them): use the
    guard's ``client_id`` and ``_fail``."""

    client_id: str
    _fail: Callable[[str], None]

    def _check_images(self, ix: _Index, leaves: _Leaves, where: str, floats: _Floats) -> None:
        """Refuse a message in which at least half of a sample's value probes (and 4), or of
        its gram positions along one axis (and 3), occur, pooled over the whole message."""
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
        tables = _device_tables(ix, floats.device) if isinstance(floats, _DeviceFloats) else None
        if held and ix.vtable is not None:
            # every float tensor's values in one lookup; the probes hit are then told apart
            # by tensor (for the error message), which costs a call only per tensor hit
            if tables is not None:
                at, found = floats.value_hits(tables)   # type: ignore[attr-defined]
            else:
                at = self._value_positions(ix, [(a, v.view(np.uint32)) for a, v in floats.pieces if a < floats.full])
            if at.size:
                seg = np.searchsorted(floats.starts, at, side="right") - 1
                for path, k in held:
                    mine = seg == k
                    if mine.any():
                        bits = (found[mine] if tables is not None
                                else floats.values(k).view(np.uint32)[at[mine] - floats.starts[k]])
                        vhits[path] = ix.probe_ids(bits)
        if "exact" in ix.grams and tables is not None:
            named = {k: path for path, k in held}
            for k, keys in floats.gram_hits(tables, "exact"):   # type: ignore[attr-defined]
                self._gram_record(ix, "exact", keys, named.get(k, ""), ghits)
        elif "exact" in ix.grams:
            for path, k in held:
                self._gram_hits(ix, "exact", floats.values(k).view(np.uint32), path, ghits)
        if tables is not None:   # the tensors among them, on the device, together
            on_device = [(path, t) for path, t in items if isinstance(t, torch.Tensor)]
            items = [(path, t) for path, t in items if not isinstance(t, torch.Tensor)]
            found, grams = _item_hits(tables, [t for _, t in on_device])
            for i, bits in found:
                vhits[on_device[i][0]] = ix.probe_ids(bits)
            for variant, per_item in grams.items():
                for i, keys in per_item:
                    self._gram_record(ix, variant, keys, on_device[i][0], ghits)
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
        self._refuse_hits(ix, where, vhits, ghits)

    def _refuse_hits(self, ix: _Index, where: str, vhits: dict[str, np.ndarray],
                     ghits: dict[str, dict[str, np.ndarray]]) -> None:
        """:meth:`_check_images`'s verdict on the probes it found: ``vhits`` (path -> matched
        value-probe ids) and ``ghits`` (variant -> path -> matched gram positions)."""
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
        runs: list[tuple[str | None, int, np.ndarray, np.ndarray]] = []   # path, first position, run starts, runs
        if isinstance(floats, _DeviceFloats):
            if paths:   # the held tensors' runs found on their device; the lists' on the host
                runs.append((None, 0, *floats.crop_runs(_device_tables(ix, floats.device))))
            pieces = [p for p in pieces if p[0] is not None]
        for path, parts in pieces:
            for first, bits in parts:
                peaks, _ = _prefiltered([(0, bits)], ix.ctable, ix.crange)
                at = np.unique((peaks[:, None] - np.arange(CROP)).reshape(-1))   # the runs holding a peak
                at = at[(at >= 0) & (at <= bits.size - CROP)]
                runs.append((path, first, at, bits[at[:, None] + np.arange(CROP)]))
        hits: dict[str, np.ndarray] = {}                        # path -> samples hit
        for path, first, at, run in runs:
            if not at.size:
                continue
            keys = _gram_keys(run)
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
            # only the signature positions of each plane leave the tensor's device, all at once
            picks = [(path + how, rows[:, pos.to(rows.device)])
                     for path, t in values for how, rows in _plane_readings(t, key[1])]
            for path, picked in _to_host(picks):
                std, varied = _standardised(picked, False)
                std = std[varied]
                step = max(1, (1 << 22) // max(sig.shape[0], 1))
                for a in range(0, std.shape[0], step):
                    corr = std[a:a + step] @ sig.T.astype(np.float64)
                    r, c = np.nonzero(corr >= PLANE_MIN_CORR)
                    found += [(float(corr[i, j]), int(who[j]), path, key) for i, j in zip(r, c)]
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
                found.append(cand)
        if found:
            self._gram_record(ix, variant, np.concatenate(found), path, ghits)

    @staticmethod
    def _gram_record(ix: _Index, variant: str, cand: np.ndarray, path: str,
                     ghits: dict[str, dict[str, np.ndarray]]) -> None:
        """Record the gram positions of ``variant`` whose key is among ``cand`` (keys found in
        the tensor at ``path``; more keys found there add to them)."""
        keys, pos = ix.grams[variant]
        hit = np.isin(keys, cand)
        if hit.any():
            by_path = ghits.setdefault(variant, {})
            by_path[path] = np.union1d(by_path.get(path, np.zeros(0, dtype=pos.dtype)), pos[hit])

    def _image_error(self, ix: _Index, where: str, path: str, sample: int, hits: int, total: int,
                     what: str, count: int) -> None:
        """Refuse the message, naming the sample recognised and how."""
        split, i = ix.names[sample]
        more = f" (and {count - 1} more of its samples)" if count > 1 else ""
        self._fail(f"{where}{path}: holds image {i} of client {self.client_id}'s {split} split{more}: "
                   f"{hits} of its {total} {what} occur in it; images never leave a client")
