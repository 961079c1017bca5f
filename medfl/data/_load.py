"""The MONAI transform that reads a manifest row's image, in a module of its own so that
importing :mod:`medfl.data.manifest` (as loading medfl's plugins does) does not import MONAI,
which loads all of its subpackages (seconds on a slow CPU); :func:`medfl.data.manifest.
build_transforms` imports it when a manifest dataset is built."""

from __future__ import annotations

from typing import Any

import torch
from monai.transforms import Transform

from medfl.data.images import load_sample

__all__ = ["LoadImageArray"]


class LoadImageArray(Transform):
    """MONAI dict transform: ``{"image": path}`` -> ``{"image": float32 tensor}`` through
    :func:`~medfl.data.images.load_sample`. A MONAI ``Transform`` (deterministic), so
    ``PersistentDataset`` caches its output."""

    def __call__(self, d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "image": torch.from_numpy(load_sample(d["image"]))}
