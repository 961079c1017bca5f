"""Read one sample's image file (a manifest row's ``path`` or ``image_path``) as a float32
channel-first array.

Below both :mod:`medfl.data.manifest` (which reads the first sample to learn the shape) and
:mod:`medfl.data._load` (the MONAI transform that reads every sample), so that neither imports
the other. MONAI is imported only when a file other than ``.npy`` is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from medfl.data.source import DataError

__all__ = ["load_sample", "NETPBM", "reader_for"]

#: Netpbm suffixes, which MONAI's automatic reader choice gives to its DICOM reader; PIL reads them.
NETPBM = (".pgm", ".ppm", ".pbm", ".pnm")


def reader_for(path: str | Path) -> str | None:
    """The MONAI reader :func:`load_sample` gives ``LoadImage`` for a file that is not
    ``.npy``: ``"PILReader"`` for netpbm files, ``None`` (MONAI's choice by suffix) otherwise."""
    return "PILReader" if Path(path).suffix.lower() in NETPBM else None


def load_sample(path: str | Path) -> np.ndarray:
    """Read one sample as a float32 channel-first array.

    ``.npy`` files are taken as written (channel first); anything else goes through MONAI's
    ``LoadImage`` with ``ensure_channel_first``.

    Raises:
        DataError: the file is missing or unreadable, naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found (named by the manifest)")
    try:
        if path.suffix.lower() == ".npy":
            arr = np.load(path, allow_pickle=False)
        else:
            from monai.transforms import LoadImage

            arr = np.asarray(LoadImage(reader=reader_for(path), image_only=True, ensure_channel_first=True)(str(path)))
    except Exception as exc:  # noqa: BLE001 - every reader error becomes one clear message
        raise DataError(f"{path}: cannot read image ({type(exc).__name__}: {exc})") from exc
    if arr.ndim < 3:
        raise DataError(f"{path}: expected a channel-first array (C, H, W[, D]), got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)
