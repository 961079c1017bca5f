"""The PCP derivative grid: reading 3D NIfTI volumes, checking their grid, resampling onto it
and resizing (with the aspect handled explicitly).

Below every other module of :mod:`medfl.prep.abide`: it imports none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from medfl.prep.errors import PrepError, check_file

__all__ = ["GRID_SHAPE", "GRID_AFFINE", "RESIZE_ASPECTS", "RESAMPLE_MODES", "load_volume", "same_grid",
           "resample_to_grid", "load_derivative", "resize_volume"]

#: The PCP derivative grid: shape and affine (3 mm MNI, LAS-oriented voxels).
GRID_SHAPE: tuple[int, int, int] = (61, 73, 61)
GRID_AFFINE: np.ndarray = np.array([[-3.0, 0.0, 0.0, 90.0],
                                    [0.0, 3.0, 0.0, -126.0],
                                    [0.0, 0.0, 3.0, -72.0],
                                    [0.0, 0.0, 0.0, 1.0]])

RESIZE_ASPECTS = ("stretch", "pad", "crop")
RESAMPLE_MODES = ("error", "linear", "nearest")


def _fmt_affine(a: np.ndarray) -> str:
    """A 4x4 affine's first three rows as text, for messages."""
    rows = np.asarray(a, dtype=float)[:3]
    return "[" + ", ".join("[" + ", ".join(f"{v:g}" for v in r) + "]" for r in rows) + "]"


_GRID_TEXT = f"{GRID_SHAPE[0]}x{GRID_SHAPE[1]}x{GRID_SHAPE[2]} with affine {_fmt_affine(GRID_AFFINE)}"


def load_volume(path: str | Path, what: str = "NIfTI volume") -> tuple[np.ndarray, np.ndarray]:
    """Read a 3D NIfTI volume: ``(data, affine)``; a trailing axis of length 1 is dropped.

    Raises:
        PrepError: the file is missing, not a readable file (a directory, an empty file...:
            :func:`~medfl.prep.errors.check_file`), corrupt or truncated, or not 3D.
    """
    import nibabel as nib

    path = check_file(Path(path), f"the {what}")
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
        affine = np.asarray(img.affine, dtype=float)
    except Exception as exc:  # noqa: BLE001 - nibabel, gzip and zlib raise many types
        raise PrepError(f"{path}: cannot read the {what} ({type(exc).__name__}: {exc}); expected a "
                        "complete (gzipped) NIfTI-1 file - corrupt or truncated download?", path) from exc
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise PrepError(f"{path}: shape {tuple(data.shape)} is not a 3D volume; expected the "
                        f"{what} ({GRID_SHAPE[0]}x{GRID_SHAPE[1]}x{GRID_SHAPE[2]})", path)
    return data, affine


def same_grid(shape: Sequence[int], affine: np.ndarray, atol: float = 1e-3) -> bool:
    """Whether ``shape``/``affine`` is the PCP grid (:data:`GRID_SHAPE`, :data:`GRID_AFFINE`)."""
    return tuple(int(s) for s in shape) == GRID_SHAPE and np.allclose(affine, GRID_AFFINE, atol=atol)


def resample_to_grid(data: np.ndarray, affine: np.ndarray, order: int = 1,
                     shape: Sequence[int] = GRID_SHAPE, target: np.ndarray = GRID_AFFINE) -> np.ndarray:
    """Resample a volume given on ``affine`` onto ``shape``/``target`` (default: the PCP grid).

    ``order`` 0 is nearest neighbour (labels), 1 trilinear. Voxels outside the source are 0.
    When the two grids differ by a whole-voxel shift only, the result is exact slicing.

    Raises:
        PrepError: ``affine`` is singular.
    """
    try:
        vox = np.linalg.inv(np.asarray(affine, dtype=float)) @ np.asarray(target, dtype=float)
    except np.linalg.LinAlgError as exc:
        raise PrepError(f"the affine {_fmt_affine(affine)} is singular; cannot resample") from exc
    lin, off = vox[:3, :3], vox[:3, 3]
    shape = tuple(int(s) for s in shape)
    if np.allclose(lin, np.eye(3), atol=1e-6) and np.allclose(off, np.round(off), atol=1e-4):
        out = np.zeros(shape, dtype=data.dtype)
        o = np.round(off).astype(int)
        src = tuple(slice(max(0, o[a]), min(data.shape[a], o[a] + shape[a])) for a in range(3))
        dst = tuple(slice(s.start - o[a], s.stop - o[a]) for a, s in enumerate(src))
        if all(s.stop > s.start for s in src):
            out[dst] = data[src]
        return out
    from scipy.ndimage import affine_transform

    src_data = data.astype(np.float64 if order else data.dtype, copy=False)
    out = affine_transform(src_data, lin, offset=off, output_shape=shape, order=order,
                           mode="constant", cval=0.0, prefilter=False)
    return out.astype(data.dtype if order == 0 else np.float32)


def load_derivative(path: str | Path, resample: str = "error", what: str = "derivative map"
                    ) -> tuple[np.ndarray, bool, tuple[int, int]]:
    """Read one derivative map on the PCP grid: ``(float32 volume, resampled, (NaN, inf))``,
    the last the counts of NaN and of infinite voxels, which become 0.

    A volume on another grid is resampled (``resample`` ``linear`` or ``nearest``) or
    refused (``error``).

    Raises:
        PrepError: missing/unreadable/not 3D (see :func:`load_volume`), another grid with
            ``resample="error"``, or a volume without any non-zero finite voxel.
    """
    if resample not in RESAMPLE_MODES:
        raise PrepError(f"--resample: unknown {resample!r}; valid: {', '.join(RESAMPLE_MODES)}")
    path = Path(path)
    data, affine = load_volume(path, what)
    resampled = False
    if not same_grid(data.shape, affine):
        if resample == "error":
            raise PrepError(f"{path}: grid {'x'.join(map(str, data.shape))} with affine "
                            f"{_fmt_affine(affine)} is not the ABIDE PCP grid; expected {_GRID_TEXT}. "
                            "Pass --resample linear to resample such files explicitly, or --skip-bad "
                            "to skip them", path)
        data = resample_to_grid(data.astype(np.float32), affine, order=1 if resample == "linear" else 0)
        resampled = True
    vol = np.asarray(data, dtype=np.float32)
    nan, inf = int(np.isnan(vol).sum()), int(np.isinf(vol).sum())
    if nan or inf:
        vol = np.where(np.isfinite(vol), vol, np.float32(0))
    if not np.any(vol):
        raise PrepError(f"{path}: no non-zero finite voxel; expected a {what}", path)
    return vol, resampled, (nan, inf)


def _index_map(n_old: int, n_new: int, aspect: str, scale: float) -> tuple[int, int, float, float]:
    """Per axis: (scaled size m, offset p, old-per-new a, b) with old = a * new + b."""
    m = n_new if aspect == "stretch" else max(1, int(round(n_old * scale)))
    p = {"pad": (n_new - m) // 2, "crop": -((m - n_new) // 2)}.get(aspect, 0)
    a = n_old / m
    return m, p, a, (0.5 - p) * a - 0.5


def resize_volume(vol: np.ndarray, size: Sequence[int], aspect: str = "stretch", order: int = 1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Resize a 3D volume ``(X, Y, Z)`` or ``(C, X, Y, Z)`` to ``size``, aspect handled explicitly.

    ``stretch`` scales each axis to fit (FedSKD's 61x73x61 -> 48^3); ``pad`` scales all axes
    by the same factor so the volume fits and pads with zeros; ``crop`` scales so it covers
    and crops the centre. ``order`` 1: linear with anti-aliasing (maps); 0: nearest (labels).

    Returns:
        The resized volume (same dtype for ``order=0``, float32 otherwise) and the 4x4
        matrix that maps new voxel indices to old ones (new affine = old affine @ matrix).
    """
    from skimage.transform import resize

    if aspect not in RESIZE_ASPECTS:
        raise PrepError(f"--aspect: unknown {aspect!r}; valid: {', '.join(RESIZE_ASPECTS)}")
    chan = vol.ndim == 4
    x = vol if chan else vol[None]
    old = x.shape[1:]
    new = tuple(int(s) for s in size)
    if len(new) != 3 or min(new) < 1:
        raise PrepError(f"--size: expected 1 or 3 positive sizes, got {list(size)}")
    scale = (min if aspect == "pad" else max)(n / o for n, o in zip(new, old))
    geo = [_index_map(o, n, aspect, scale) for o, n in zip(old, new)]
    scaled = tuple(g[0] for g in geo)
    out_dtype = vol.dtype if order == 0 else np.float32
    result = np.zeros((x.shape[0],) + new, dtype=out_dtype)
    for c in range(x.shape[0]):
        y = resize(x[c], scaled, order=order, anti_aliasing=order > 0, preserve_range=True, mode="edge")
        y = np.rint(y).astype(out_dtype) if order == 0 else y.astype(np.float32)
        src, dst = [], []
        for (m, p, _, _), n in zip(geo, new):
            lo, hi = max(0, -p), min(m, n - p)
            src.append(slice(lo, hi))
            dst.append(slice(lo + p, hi + p))
        result[(c, *dst)] = y[tuple(src)]
    matrix = np.eye(4)
    for axis, (_, _, a, b) in enumerate(geo):
        matrix[axis, axis], matrix[axis, 3] = a, b
    return (result if chan else result[0]), matrix
