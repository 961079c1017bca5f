"""A small generated 2D image dataset with a learnable class signal (demo and tests).

Each class has its own pattern (an oriented bar or a blob at a class-specific place),
drawn with random position jitter, amplitude and Gaussian noise; each of a few synthetic
``site`` values shifts intensity and noise, so site-based splits are non-IID. Samples are
written as ``.npy`` arrays with a ``manifest.csv`` in a directory whose name carries a hash
of the generation parameters, so different settings never overwrite each other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import json
from pathlib import Path

import numpy as np
import pandas as pd

from medfl.data.source import ArrayDataset, FederatedSource, read_manifest

__all__ = ["generate_synthetic2d", "synthetic2d"]


def _pattern(cls: int, size: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    jitter = rng.uniform(-0.08, 0.08, size=2)
    kind = cls % 4
    offset = (cls // 4) * 0.15
    if kind == 0:  # horizontal bar
        img = np.exp(-(((yy - 0.3 - offset - jitter[0]) / 0.06) ** 2))
    elif kind == 1:  # vertical bar
        img = np.exp(-(((xx - 0.7 + offset - jitter[1]) / 0.06) ** 2))
    elif kind == 2:  # blob
        img = np.exp(-(((yy - 0.5 - jitter[0]) ** 2 + (xx - 0.5 - offset - jitter[1]) ** 2) / 0.01))
    else:  # diagonal
        img = np.exp(-(((yy - xx - jitter[0] + offset) / 0.08) ** 2))
    return img.astype(np.float32)


def generate_synthetic2d(
    root: str | Path,
    num_samples: int = 800,
    num_classes: int = 3,
    image_size: int = 32,
    noise: float = 0.8,
    num_sites: int = 4,
    seed: int = 0,
) -> Path:
    """Write the dataset under ``root`` (if not already there) and return its directory.

    Args:
        root: parent directory; the data goes to ``root/synthetic2d-<hash>``.
        num_samples: number of images.
        num_classes: number of classes (2-8).
        image_size: side of the square images.
        noise: standard deviation of the Gaussian noise (signal amplitude is about 1).
        num_sites: number of synthetic sites (column ``site``), each with its own shift.
        seed: generation seed.

    Returns:
        The directory holding ``manifest.csv`` and ``images/*.npy``.
    """
    if not 2 <= num_classes <= 8:
        raise ValueError(f"synthetic2d: num_classes must be in 2..8, got {num_classes}")
    if num_samples < num_classes:
        raise ValueError(f"synthetic2d: num_samples ({num_samples}) < num_classes ({num_classes})")
    params = dict(num_samples=num_samples, num_classes=num_classes, image_size=image_size,
                  noise=noise, num_sites=num_sites, seed=seed)
    tag = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    out = Path(root) / f"synthetic2d-{tag}"
    if (out / "manifest.csv").is_file():
        return out
    # written into a private directory renamed into place at the end, so processes that
    # generate the same set at once (sites of a federation on one machine) never see a
    # half-written one
    final, out = out, Path(root) / f".synthetic2d-{tag}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    site_shift = rng.uniform(-0.3, 0.3, size=num_sites)
    site_noise = rng.uniform(0.8, 1.2, size=num_sites)
    rows = []
    labels = np.arange(num_samples) % num_classes
    rng.shuffle(labels)
    for i, y in enumerate(labels):
        site = int(rng.integers(num_sites))
        amp = rng.uniform(0.7, 1.3)
        img = amp * _pattern(int(y), image_size, rng) + site_shift[site]
        img += rng.normal(0, noise * site_noise[site], size=img.shape).astype(np.float32)
        name = f"images/s{i:05d}.npy"
        np.save(out / name, img[None].astype(np.float32))
        rows.append({"sample_id": f"s{i:05d}", "path": name, "label": int(y),
                     "class_name": f"class_{int(y)}", "site": f"site_{site}"})
    (out / "params.json").write_text(json.dumps(params, indent=2))
    pd.DataFrame(rows).to_csv(out / "manifest.csv", index=False)
    if final.exists() and not (final / "manifest.csv").is_file():
        shutil.rmtree(final, ignore_errors=True)   # left half-written by an older version
    try:
        out.rename(final)
    except OSError:   # another process got there first: its set is the same
        shutil.rmtree(out, ignore_errors=True)
        if not (final / "manifest.csv").is_file():
            raise
    return final


def synthetic2d(
    root: str = "data",
    num_samples: int = 800,
    num_classes: int = 3,
    image_size: int = 32,
    noise: float = 0.8,
    num_sites: int = 4,
    seed: int = 0,
) -> FederatedSource:
    """Dataset plugin ``synthetic2d``: generate (once) and load the demo dataset."""
    directory = generate_synthetic2d(root, num_samples, num_classes, image_size, noise, num_sites, seed)
    table = read_manifest(directory / "manifest.csv")

    def make_dataset(rows: pd.DataFrame, train: bool) -> ArrayDataset:
        return ArrayDataset(rows["path"].tolist(), rows["label"].to_numpy(), root=directory)

    return FederatedSource(
        table=table,
        num_classes=num_classes,
        class_names=[f"class_{c}" for c in range(num_classes)],
        sample_shape=(1, image_size, image_size),
        make_dataset=make_dataset,
        description=f"synthetic 2D patterns, {num_classes} classes, {num_samples} images",
        info={"directory": str(directory)},
    )
