"""A fixed random image dataset in blocks, generated lazily (benchmarks and tests).

The table has one row per sample: ``block`` (an integer block id, e.g. one per client),
``offset`` (position inside the block), ``label`` and ``sample_id``. Only the labels are
drawn up front; a block's images are drawn from a generator seeded by ``(seed, block)``
the moment a dataset that needs them is built, so the samples of one block are always the
same, wherever and however often they are built, and no more than the blocks of one
dataset are ever in memory. Each image is Gaussian noise plus ``signal`` times a fixed
smooth random pattern of its class, so a model can learn something.

Partition it with the ``natural`` partitioner on column ``block`` to give every block its
own client::

    {"dataset": {"name": "random_blocks", "num_blocks": 10, "samples_per_block": 256},
     "partition": {"name": "natural", "column": "block"}, "num_clients": 10}

:func:`random_blocks` is registered by medfl's built-in dataset plugin as ``random_blocks``
(so processes that load the plugins themselves, such as the simulation runtime's Ray
actors, have it too).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch.utils.data import TensorDataset

from medfl.data.source import FederatedSource
from medfl.seeding import derive_seed

__all__ = ["BlockDataset", "block_images", "random_blocks"]


class BlockDataset(TensorDataset):
    """A :class:`~torch.utils.data.TensorDataset` ``(images, labels)`` that also exposes
    its labels as a NumPy array (``labels``), as medfl's datasets do."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__(images, labels)
        self.labels = labels.numpy()


def _block_labels(seed: int, block: int, n: int, num_classes: int) -> np.ndarray:
    return np.random.default_rng(derive_seed(seed, "labels", block)).integers(0, num_classes, n)


def _prototypes(seed: int, num_classes: int, image_size: int, spatial_dims: int = 2) -> torch.Tensor:
    """One smooth random pattern per class (a 7x7 (x7) Gaussian grid, upsampled)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "prototypes"))
    coarse = torch.randn(num_classes, 1, *(7,) * spatial_dims, generator=gen)
    return torch.nn.functional.interpolate(coarse, size=(image_size,) * spatial_dims,
                                           mode="trilinear" if spatial_dims == 3 else "bilinear", align_corners=False)


def block_images(seed: int, block: int, labels: np.ndarray, image_size: int = 28,
                 signal: float = 1.0, num_classes: int = 10, spatial_dims: int = 2) -> torch.Tensor:
    """The images of one block, shape ``(n, 1, image_size, image_size)`` float32
    (``(n, 1, s, s, s)`` with ``spatial_dims=3``).

    Args:
        seed: dataset seed.
        block: block id.
        labels: the block's labels (``n`` of them, in offset order).
        image_size: side of the square (cubic) images.
        signal: amplitude of the class pattern added to unit Gaussian noise.
        num_classes: number of classes (selects the pattern set).
        spatial_dims: 2 (images) or 3 (volumes).
    """
    gen = torch.Generator().manual_seed(derive_seed(seed, "images", block))
    x = torch.randn(len(labels), 1, *(image_size,) * spatial_dims, generator=gen)
    protos = _prototypes(seed, num_classes, image_size, spatial_dims)
    return x.add_(protos[torch.as_tensor(labels, dtype=torch.long)], alpha=float(signal))


def random_blocks(num_blocks: int = 10, samples_per_block: int = 256, num_classes: int = 10,
                  image_size: int = 28, signal: float = 1.0, seed: int = 0, spatial_dims: int = 2
                  ) -> FederatedSource:
    """A :class:`FederatedSource` of ``num_blocks * samples_per_block`` random images.

    Args:
        num_blocks: number of blocks (column ``block``: ``0 .. num_blocks - 1``).
        samples_per_block: samples in every block.
        num_classes: number of classes (labels drawn uniformly per block).
        image_size: side of the square single-channel images.
        signal: amplitude of the class pattern (noise has unit variance).
        seed: dataset seed; the data is a pure function of the arguments.
        spatial_dims: 2 (square images) or 3 (cubic volumes, e.g. an ABIDE-like 3D job).

    Raises:
        ValueError: a count below 1, or ``spatial_dims`` other than 2 or 3.
    """
    if spatial_dims not in (2, 3):
        raise ValueError(f"random_blocks: spatial_dims must be 2 or 3, got {spatial_dims!r}")
    for name, v in (("num_blocks", num_blocks), ("samples_per_block", samples_per_block),
                    ("num_classes", num_classes), ("image_size", image_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"random_blocks: {name} must be an integer >= 1, got {v!r}")
    n = samples_per_block
    shape = (image_size,) * spatial_dims
    blocks = np.repeat(np.arange(num_blocks, dtype=np.int64), n)
    offsets = np.tile(np.arange(n, dtype=np.int64), num_blocks)
    labels = np.concatenate([_block_labels(seed, b, n, num_classes) for b in range(num_blocks)])
    table = pd.DataFrame({
        "block": blocks, "offset": offsets, "label": labels.astype(np.int64),
        "sample_id": [f"b{b}-{o}" for b, o in zip(blocks.tolist(), offsets.tolist())],
    })

    def make_dataset(rows: pd.DataFrame, train: bool) -> BlockDataset:
        block_col = rows["block"].to_numpy()
        offset_col = rows["offset"].to_numpy()
        x = torch.empty(len(rows), 1, *shape)
        y = torch.tensor(rows["label"].to_numpy(dtype=np.int64))
        for b in pd.unique(block_col):
            where = np.flatnonzero(block_col == b)
            labs = _block_labels(seed, int(b), n, num_classes)
            imgs = block_images(seed, int(b), labs, image_size, signal, num_classes, spatial_dims)
            x[torch.as_tensor(where)] = imgs[torch.as_tensor(offset_col[where])]
        return BlockDataset(x, y)

    return FederatedSource(
        table=table, num_classes=num_classes, class_names=[f"class_{k}" for k in range(num_classes)],
        sample_shape=(1, *shape), make_dataset=make_dataset,
        description=f"random_blocks: {num_blocks} blocks x {n} random {'x'.join(map(str, shape))} "
                    + ("images" if spatial_dims == 2 else "volumes"),
        info={"num_blocks": num_blocks, "samples_per_block": n, "seed": seed, "signal": signal,
              "spatial_dims": spatial_dims},
    )
