"""A split's reference: every probe of every sample of one dataset, and its labels.

:func:`build_split_reference` reads each sample of a dataset once, draws its probes
(:mod:`medfl.guard.probes`) chunk by chunk and keeps them, with the split's label vector, in
a :class:`SplitReference`; :func:`_fingerprint` says which samples a dataset holds (the key
under which :mod:`medfl.guard.index` caches references).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from medfl.guard.params import _VARIANTS, CROP, GRAM, MIN_VALUE_PROBES, PLANE_PIXELS, VALUE_PROBES
from medfl.guard.probes import _chunk_probes, _crop_probes, _gram_keys, _plane_probes

__all__ = ["SplitReference", "build_split_reference"]


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
            :func:`~medfl.guard.probes._views`), ``(signatures, sample)``: each signature is a
            plane's values at the view's :func:`~medfl.guard.probes.plane_positions`, centred
            and scaled to norm 1 (float32, one row per channel of a sample whose values there
            are varied enough).
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


def _item_image(item: Any) -> Any:
    """The image of a dataset item: a dict's ``image`` (else its first value), a tuple's first
    element, or the item itself."""
    if isinstance(item, dict):
        return item.get("image", next(iter(item.values())))
    if isinstance(item, (tuple, list)):
        return item[0]
    return item


def _item_label(item: Any) -> int:
    """The label of a dataset item (``label`` of a dict, the second of a tuple; -1: none)."""
    if isinstance(item, dict):
        return int(item.get("label", -1))
    if isinstance(item, (tuple, list)) and len(item) > 1:
        return int(torch.as_tensor(item[1]).reshape(-1)[0])
    return -1


def _labels_of(ds: Dataset) -> np.ndarray | None:
    """A dataset's ``labels`` as an int64 vector, or None when it has none."""
    labels = getattr(ds, "labels", None)
    if labels is None:
        return None
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def _name_bytes(name: Any) -> bytes:
    """A file name as the bytes the file system holds (``os.fsencode``): a path prep wrote
    into a folder whose name is not UTF-8 holds surrogate escapes (``'\\udcff'``) that
    ``str.encode`` refuses. The same bytes as ``str(name).encode()`` for every UTF-8 name."""
    if isinstance(name, (str, bytes, os.PathLike)):
        return os.fsencode(name)
    return str(name).encode("utf-8", "surrogatepass")


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
        h.update(b"\n".join(map(_name_bytes, files)))
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
