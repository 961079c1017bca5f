"""random_blocks: the benchmark dataset is a pure function of its arguments, built lazily."""

from __future__ import annotations

import pytest
import torch

from medfl.data.random_blocks import block_images, random_blocks


def test_blocks_are_the_same_however_they_are_built():
    src = random_blocks(num_blocks=3, samples_per_block=10, num_classes=4, image_size=8, seed=5)
    t = src.table
    assert len(t) == 30 and sorted(t["block"].unique()) == [0, 1, 2]
    assert t["sample_id"].is_unique and t["label"].between(0, 3).all()
    whole = src.make_dataset(t, True)
    x_all, y_all = whole.tensors
    assert x_all.shape == (30, 1, 8, 8) and torch.equal(y_all, torch.tensor(t["label"].to_numpy()))
    # a subset in another order gives the same samples
    sub = t.iloc[[25, 3, 14, 4]]
    x_sub, y_sub = src.make_dataset(sub, False).tensors
    assert torch.equal(x_sub, x_all[[25, 3, 14, 4]]) and torch.equal(y_sub, y_all[[25, 3, 14, 4]])
    # rebuilding the source gives the same data; another seed does not
    again = random_blocks(num_blocks=3, samples_per_block=10, num_classes=4, image_size=8, seed=5)
    assert torch.equal(again.make_dataset(again.table, True).tensors[0], x_all)
    other = random_blocks(num_blocks=3, samples_per_block=10, num_classes=4, image_size=8, seed=6)
    assert not torch.equal(other.make_dataset(other.table, True).tensors[0], x_all)


def test_class_signal_is_learnable():
    src = random_blocks(num_blocks=1, samples_per_block=400, num_classes=2, image_size=8, signal=2.0, seed=0)
    x, y = src.make_dataset(src.table, True).tensors
    m0, m1 = x[y == 0].mean(0), x[y == 1].mean(0)
    # nearest class mean classifies far above chance
    d0 = ((x - m0) ** 2).flatten(1).sum(1)
    d1 = ((x - m1) ** 2).flatten(1).sum(1)
    assert ((d1 < d0).long() == y).float().mean() > 0.9


def test_block_images_shape_and_bad_arguments():
    import numpy as np

    assert block_images(0, 0, np.array([0, 1, 2]), image_size=6, num_classes=3).shape == (3, 1, 6, 6)
    for bad in ({"num_blocks": 0}, {"samples_per_block": -1}, {"image_size": 2.5}, {"num_classes": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            random_blocks(**bad)


def test_volumes_for_a_3d_job():
    """``spatial_dims=3`` (the ABIDE-like benchmark workload): cubic volumes, the same
    determinism, a learnable class signal; 2D data is unchanged by the option."""
    src = random_blocks(num_blocks=2, samples_per_block=200, num_classes=2, image_size=6, signal=2.0, seed=1,
                        spatial_dims=3)
    assert src.sample_shape == (1, 6, 6, 6) and "6x6x6 volumes" in src.description
    x, y = src.make_dataset(src.table, True).tensors
    assert x.shape == (400, 1, 6, 6, 6)
    assert torch.equal(src.make_dataset(src.table.iloc[[7, 301]], False).tensors[0], x[[7, 301]])
    m0, m1 = x[y == 0].mean(0), x[y == 1].mean(0)
    d0, d1 = ((x - m0) ** 2).flatten(1).sum(1), ((x - m1) ** 2).flatten(1).sum(1)
    assert ((d1 < d0).long() == y).float().mean() > 0.9
    flat = random_blocks(num_blocks=1, samples_per_block=5, image_size=8, seed=3)
    assert torch.equal(flat.make_dataset(flat.table, True).tensors[0],
                       random_blocks(num_blocks=1, samples_per_block=5, image_size=8, seed=3,
                                     spatial_dims=2).make_dataset(flat.table, True).tensors[0])
    with pytest.raises(ValueError, match="spatial_dims must be 2 or 3"):
        random_blocks(spatial_dims=1)
