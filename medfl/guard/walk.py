"""Walking an outgoing message: its tensors, lists and numbers, and its float values.

:func:`_walk` visits a message part (a reply's payload or metrics, a model state) whatever
its containers, and sorts what it holds into :class:`_Leaves`: tensors with their key paths,
stacks of small tensors of one shape, rectangular lists of numbers, and the run of all its
scalars. :class:`_Floats` gathers the real floating-point tensors' values as float32 once per
check, for both the label check (:mod:`medfl.guard.labels`) and the image checks
(:mod:`medfl.guard.images`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__: list[str] = []

#: values per step of the one-pass scans: their temporaries stay in the CPU's cache (about
#: twice as fast on a 2-core VM as whole-tensor passes, which stream every temporary through memory)
_SCAN_CHUNK = 1 << 16


# ---------------------------------------------------------------------- walking a message
@dataclass
class _Leaves:
    """What :func:`_walk` found in a message: tensors, stacks of small tensors, lists of
    numbers (each with its key path) and the scalars in order."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    stacks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    lists: list[tuple[str, np.ndarray]] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    scalar_paths: list[str] = field(default_factory=list)
    #: one-value tensors: ``(place in scalars, tensor)``, read together by :meth:`resolve`
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def resolve(self) -> None:
        """Fill in the scalars of one-value tensors, one copy off each device (on a GPU, a
        model's BatchNorm counters read one by one would each wait for the device)."""
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for at, t in self.pending:
            by_device.setdefault(t.device, []).append((at, t))
        for items in by_device.values():
            values = torch.stack([(t.real if t.is_complex() else t).reshape(()).to(torch.float64)
                                  for _, t in items]).cpu().tolist()
            for (at, _), v in zip(items, values):
                self.scalars[at] = v
        self.pending.clear()


def _number(x: Any) -> bool:
    """Whether ``x`` is a Python number (bool, int or float)."""
    return isinstance(x, (bool, int, float)) and not isinstance(x, str)


def _walk(value: Any, path: str, out: _Leaves, exempt: frozenset[str], top: bool) -> None:
    """Sort what ``value`` holds into ``out``, with key paths below ``path`` (``exempt``:
    top-level keys left out)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.numel() == 1:   # read with the others of its device by _Leaves.resolve
            out.pending.append((len(out.scalars), t))
            out.scalars.append(float("nan"))
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
        one = len({t.device for t in tensors}) == 1   # stacked where they are (a GPU's stay there)
        out.stacks.append((f"{path}[*]", torch.stack([t.detach() if one else t.detach().cpu() for t in tensors])))


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
    return _as_numeric(t.detach().cpu()).contiguous().numpy()


def _as_numeric(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype :func:`_numeric` reads it as, where it lies: the real part of a
    complex tensor, booleans as uint8, float16/bfloat16/float32 as float32, float64 and the
    common integer dtypes as they are, other integers as int64."""
    if t.is_complex():
        t = t.real
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.dtype in (torch.float16, torch.bfloat16) or (t.is_floating_point() and t.dtype != torch.float64):
        t = t.to(torch.float32)
    elif not t.is_floating_point() and t.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32,
                                                        torch.int64):
        t = t.to(torch.int64)
    return t


class _Floats:
    """The values of a message's real floating-point tensors as float32, gathered once per
    check and read by both scans: :func:`~medfl.guard.labels._may_hold_runs` counts
    label-like values per tensor, and the image check looks up the float32/float64 tensors'
    values (the first :attr:`full` positions), each in a few NumPy calls over large arrays,
    where a model's dozens of tensors would otherwise cost dozens of calls each. A large
    float32 tensor is read where it lies (no copy); the others are copied into shared pieces.

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
    #: :meth:`arrays` gathers CPU tensors too (the device path, run on the CPU device)
    GATHER = False

    def __init__(self, tensors: list[torch.Tensor], more: list[torch.Tensor] | tuple[()] = ()) -> None:
        full, rest = self._hold(tensors, more)
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

    def _hold(self, tensors: list[torch.Tensor], more: list[torch.Tensor] | tuple[()]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Choose the tensors held and their positions (:attr:`starts`, :attr:`sizes`,
        :attr:`full`, :meth:`segment`); return them as ``(float32/float64, the others)``."""
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
        return full, rest

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

    def arrays(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        """Each tensor's values as :func:`_numeric` gives them (what the label search reads),
        in one copy off each device for each dtype (a GPU waits once, not once per tensor)."""
        out: list[np.ndarray | None] = [None] * len(tensors)
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        for i, t in enumerate(tensors):
            if t.device.type == "cpu" and not self.GATHER:
                out[i] = _numeric(t)   # read in place
            else:
                v = _as_numeric(t.detach())
                groups.setdefault((v.device, v.dtype), []).append((i, v))
        for items in groups.values():
            whole = torch.cat([v.reshape(-1) for _, v in items]).cpu().numpy()
            at = 0
            for i, v in items:
                out[i], at = whole[at:at + v.numel()].reshape(tuple(v.shape)), at + v.numel()
        return out   # type: ignore[return-value]
