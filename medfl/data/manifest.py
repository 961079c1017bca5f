"""The generic ``manifest`` dataset: a manifest CSV written by a data_prep script, loaded
through MONAI transforms, optionally cached.

A manifest has one row per sample. ``path`` names the cached array a data_prep script wrote
(``.npy``, channel first: ``(C, H, W)`` or ``(C, H, W, D)``); any other column may be used
instead (``column``), for example ``image_path`` pointing at the original DICOM, NIfTI,
PGM or JPEG file, which MONAI's ``LoadImage`` then reads (pydicom, nibabel, PIL).

Per sample, a deterministic chain (load, float32, intensity normalisation, resize) is
followed by a random training chain (flips, rotation, intensity scaling, noise; training
sets only). With ``cache="memory"`` the deterministic part of each sample is computed once
per process and shared by every dataset built from the source (the engine builds a
client's dataset every round); ``cache="disk"`` keeps it in MONAI ``PersistentDataset``
files under ``cache_dir``, which outlive the process.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from medfl.data.images import load_sample
from medfl.data.source import DataError, FederatedSource, read_manifest

__all__ = ["manifest_source", "ManifestDataset", "build_transforms", "eval_chain", "load_sample", "AUGMENT_KEYS"]

#: Keys accepted in ``augment`` and what they do (training sets only).
AUGMENT_KEYS = {
    "flip": "list of spatial axes, each flipped with probability 0.5 (e.g. [0, 1])",
    "rotate_deg": "2D: random rotation in [-deg, deg] degrees (3D: about the last axis)",
    "intensity": "random intensity scaling by a factor in [1 - v, 1 + v]",
    "noise": "additive Gaussian noise of this standard deviation, with probability 0.5",
}
NORMALIZE = ("none", "zscore", "minmax")
CACHE = ("none", "memory", "disk")


def eval_chain(spatial_dims: int, normalize: str = "none",
               spatial_size: Sequence[int] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The deterministic chain after a sample is read, as ``(MONAI dict transform name,
    its arguments)``: float32, the intensity normalisation, the resize. :func:`build_transforms`
    builds it, and ``medfl export`` writes it into an exported bundle's ``inference.json``, so
    both preprocess alike.

    Raises:
        DataError: an unknown normalisation or a wrong spatial size.
    """
    if normalize not in NORMALIZE:
        raise DataError(f"dataset.normalize: unknown {normalize!r}; valid: {', '.join(NORMALIZE)}")
    chain: list[tuple[str, dict[str, Any]]] = [
        ("EnsureTyped", {"keys": "image", "dtype": "float32", "track_meta": False})]
    if normalize == "zscore":
        chain.append(("NormalizeIntensityd", {"keys": "image", "channel_wise": True}))
    elif normalize == "minmax":
        chain.append(("ScaleIntensityd", {"keys": "image", "minv": 0.0, "maxv": 1.0, "channel_wise": True}))
    if spatial_size:
        size = [int(s) for s in spatial_size]
        if len(size) != spatial_dims or min(size) < 1:
            raise DataError(f"dataset.spatial_size: expected {spatial_dims} positive sizes, got {list(spatial_size)}")
        chain.append(("Resized", {"keys": "image", "spatial_size": size, "mode": "area"}))
    return chain


def build_transforms(spatial_dims: int, normalize: str = "none",
                     spatial_size: Sequence[int] | None = None,
                     augment: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The deterministic (:class:`~medfl.data._load.LoadImageArray`, then :func:`eval_chain`)
    and the random MONAI ``Compose`` over ``{"image", "label"}`` dicts.

    Raises:
        DataError: an unknown normalisation, augmentation key or a wrong spatial size.
    """
    import monai.transforms  # here, not at the top: importing MONAI takes seconds
    from monai.transforms import Compose, RandFlipd, RandGaussianNoised, RandRotated, RandScaleIntensityd

    from medfl.data._load import LoadImageArray

    det: list[Any] = [LoadImageArray(), *(getattr(monai.transforms, name)(**kwargs)
                                          for name, kwargs in eval_chain(spatial_dims, normalize, spatial_size))]
    rand: list[Any] = []
    augment = dict(augment or {})
    unknown = sorted(set(augment) - set(AUGMENT_KEYS))
    if unknown:
        raise DataError(f"dataset.augment: unknown key(s) {unknown}; valid: "
                        + "; ".join(f"{k} ({v})" for k, v in AUGMENT_KEYS.items()))
    for axis in augment.get("flip") or []:
        if not 0 <= int(axis) < spatial_dims:
            raise DataError(f"dataset.augment.flip: axis {axis} outside 0..{spatial_dims - 1}")
        rand.append(RandFlipd(keys="image", prob=0.5, spatial_axis=int(axis)))
    if augment.get("rotate_deg"):
        r = float(np.deg2rad(float(augment["rotate_deg"])))
        kw = {"range_x": r} if spatial_dims == 2 else {"range_z": r}
        rand.append(RandRotated(keys="image", prob=1.0, keep_size=True, padding_mode="zeros", **kw))
    if augment.get("intensity"):
        rand.append(RandScaleIntensityd(keys="image", factors=float(augment["intensity"]), prob=1.0))
    if augment.get("noise"):
        rand.append(RandGaussianNoised(keys="image", prob=0.5, std=float(augment["noise"])))
    return Compose(det), Compose(rand)


class ManifestDataset(Dataset):
    """``(image, label)`` items of manifest rows through the deterministic chain (cached as
    the source says) and, for training sets, the random chain.

    Attributes:
        labels: the integer labels, shape ``(N,)``.
    """

    def __init__(self, files: list[Path], labels: np.ndarray, det: Any, rand: Any | None,
                 memory: dict[str, torch.Tensor] | None = None, lock: threading.Lock | None = None,
                 cache_dir: Path | None = None) -> None:
        self.files = files
        self.labels = np.asarray(labels, dtype=np.int64)
        self.det, self.rand = det, rand
        self.memory, self.lock = memory, lock or threading.Lock()
        self.persistent = None
        if cache_dir is not None:
            from monai.data import PersistentDataset

            self.persistent = PersistentDataset([{"image": str(f)} for f in files], transform=det,
                                                cache_dir=cache_dir)
        if rand is not None:
            # MONAI's random transforms draw from their own generator: seed it from numpy's
            # global one, which the engine seeds for every client and round.
            rand.set_random_state(seed=int(np.random.randint(0, 2**31 - 1)))

    def __len__(self) -> int:
        return len(self.files)

    def _deterministic(self, i: int) -> torch.Tensor:
        key = str(self.files[i])
        if self.memory is not None:
            with self.lock:
                hit = self.memory.get(key)
            if hit is not None:
                return hit
        if self.persistent is not None:
            x = self.persistent[i]["image"]
        else:
            x = self.det({"image": key})["image"]
        x = torch.as_tensor(x, dtype=torch.float32)
        if self.memory is not None:
            with self.lock:
                self.memory[key] = x
        return x

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self._deterministic(i)
        if self.rand is not None and len(self.rand.transforms):
            x = torch.as_tensor(self.rand({"image": x.clone()})["image"], dtype=torch.float32)
        return x, int(self.labels[i])


def manifest_source(path: str, root: str | None = None, num_classes: int | None = None,
                    column: str = "path", normalize: str = "none",
                    spatial_size: Sequence[int] | None = None, augment: dict[str, Any] | None = None,
                    cache: str = "none", cache_dir: str | None = None) -> FederatedSource:
    """Dataset plugin ``manifest``: the samples a manifest CSV lists, through MONAI transforms.

    Args:
        path: the manifest CSV (columns ``label`` and ``column``; optional ``class_name``,
            ``split``, ``site``, ``sex``, ``subject_id``, ``sample_id``...).
        root: directory that relative file names are resolved against (default: the
            manifest's directory).
        num_classes: number of classes (default: largest label + 1).
        column: the column naming each sample's file (default ``path``, the cached array).
        normalize: ``none``, ``zscore`` (per channel) or ``minmax`` (per channel to [0, 1]).
        spatial_size: resize every sample to this size (MONAI ``Resized``, area mode).
        augment: random training transforms, see :data:`AUGMENT_KEYS`.
        cache: ``none``, ``memory`` (deterministic part kept per process) or ``disk``
            (MONAI ``PersistentDataset`` under ``cache_dir``).
        cache_dir: where ``disk`` caches (default ``<manifest dir>/.medfl_cache``).

    Raises:
        DataError: unreadable manifest, a missing column, negative labels, an unreadable
            first sample, or a bad option.
    """
    table = read_manifest(path, required=("label", column))
    base = Path(root) if root else Path(path).parent
    if (table["label"] < 0).any():
        raise DataError(f"{path}: column 'label' has negative values")
    if table[column].isna().any():
        bad = int(table[column].isna().to_numpy().argmax())
        raise DataError(f"{path}: column {column!r} is empty in row {bad + 2} (line of the CSV)")
    if cache not in CACHE:
        raise DataError(f"dataset.cache: unknown {cache!r}; valid: {', '.join(CACHE)}")
    k = int(num_classes or table["label"].max() + 1)
    if table["label"].max() >= k:
        raise DataError(f"{path}: label {int(table['label'].max())} >= num_classes {k}")
    if "class_name" in table.columns:
        names = (table.drop_duplicates("label").set_index("label")["class_name"]
                 .reindex(range(k)).fillna("").astype(str).tolist())
    else:
        names = [f"class_{c}" for c in range(k)]
    first = load_sample(base / str(table[column].iloc[0]))
    spatial_dims = first.ndim - 1
    det, _ = build_transforms(spatial_dims, normalize, spatial_size, augment)
    sample_shape = tuple(det({"image": str(base / str(table[column].iloc[0]))})["image"].shape)
    memory: dict[str, torch.Tensor] | None = {} if cache == "memory" else None
    lock = threading.Lock()
    disk = None
    if cache == "disk":
        disk = Path(cache_dir) if cache_dir else Path(path).parent / ".medfl_cache"
        disk.mkdir(parents=True, exist_ok=True)

    def make_dataset(rows: pd.DataFrame, train: bool) -> ManifestDataset:
        d, r = build_transforms(spatial_dims, normalize, spatial_size, augment if train else None)
        files = [base / str(p) for p in rows[column]]
        return ManifestDataset(files, rows["label"].to_numpy(), d, r if train else None,
                               memory=memory, lock=lock, cache_dir=disk)

    return FederatedSource(table=table, num_classes=k, class_names=names, sample_shape=sample_shape,
                           make_dataset=make_dataset, description=f"manifest {path}",
                           info={"column": column, "normalize": normalize, "cache": cache,
                                 "spatial_size": list(spatial_size) if spatial_size else None})
