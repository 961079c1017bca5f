"""FedSKD's similarity distillation terms against hand computations (paper 004, eqs. 4-15)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from medfl.losses.skd import (
    align_spatial,
    batch_similarity,
    region_masks,
    region_similarity,
    skd_loss,
    spatial_similarity,
)


# ------------------------------------------------------------------ independent reference (loops)

def _ref_sim(rows: np.ndarray) -> np.ndarray:
    """rownorm(H Hᵀ) * sqrt(n), with explicit loops over entries (float64)."""
    n = rows.shape[0]
    g = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            g[i, j] = sum(rows[i, k] * rows[j, k] for k in range(rows.shape[1]))
    for i in range(n):
        norm = math.sqrt(sum(v * v for v in g[i]))
        g[i] = g[i] / max(norm, 1e-12)
    return g * math.sqrt(n)


def _ref_term(a: np.ndarray, b: np.ndarray) -> float:
    n = a.shape[0]
    return float(((a - b) ** 2).sum()) / (n * n)


def _batch_rows(f: np.ndarray) -> np.ndarray:
    return np.stack([f[i].reshape(-1) for i in range(f.shape[0])])


def _pixel_rows(f: np.ndarray) -> np.ndarray:
    b, c = f.shape[:2]
    pos = int(np.prod(f.shape[2:]))
    flat = f.reshape(b, c, pos)
    return np.stack([[flat[i, k, p] for i in range(b) for k in range(c)] for p in range(pos)])


def _region_rows(f: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
    b, c = f.shape[:2]
    out = []
    for m in masks:
        w = m / m.sum()
        out.append([float((f[i, k] * w).sum()) for i in range(b) for k in range(c)])
    return np.array(out)


# ------------------------------------------------------------------ a value worked by hand

def test_batch_term_by_hand() -> None:
    # DAM rows e1, e2: Gram = I -> rownorm = I -> B = sqrt(2) I.
    # KTM rows e1, e1: Gram = all ones -> rows / sqrt(2) -> times sqrt(2) -> all ones.
    # ||B_D - B_K||^2 = 2 (sqrt2 - 1)^2 + 2 * 1 = 8 - 4 sqrt2; / b^2 = 2 - sqrt2.
    dam = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(2, 2, 1, 1)
    ktm = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).reshape(2, 2, 1, 1)
    assert torch.allclose(batch_similarity(dam), math.sqrt(2) * torch.eye(2))
    assert torch.allclose(batch_similarity(ktm), torch.ones(2, 2))
    loss, parts = skd_loss([dam], [ktm], terms=["batch"])
    assert loss.item() == pytest.approx(2 - math.sqrt(2), abs=1e-6)
    assert parts == {"batch": pytest.approx(2 - math.sqrt(2), abs=1e-6)}


def test_pixel_term_by_hand() -> None:
    # one sample, one channel, 1 x 2 pixels: DAM (1, 0): the second pixel's row is zero and stays
    # zero (no NaN); P_D = sqrt(2) [[1, 0], [0, 0]].  KTM (1, 1): P_K = all ones.
    # ||P_D - P_K||^2 = (sqrt2 - 1)^2 + 1 + 1 + 1 = 6 - 2 sqrt2; / (hw)^2 = 4.
    dam = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)
    ktm = torch.tensor([1.0, 1.0]).reshape(1, 1, 1, 2)
    assert torch.allclose(spatial_similarity(dam), torch.tensor([[math.sqrt(2), 0.0], [0.0, 0.0]]))
    loss, _ = skd_loss([dam], [ktm], terms=["pixel"])
    assert loss.item() == pytest.approx((6 - 2 * math.sqrt(2)) / 4, abs=1e-6)


# ------------------------------------------------------------------ against the loop reference

@pytest.mark.parametrize("spatial", [(3, 4), (2, 3, 2)], ids=["2d", "3d"])
def test_terms_match_loops_with_different_channels(spatial: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    dam = [torch.randn(3, 4, *spatial, generator=g), torch.randn(3, 6, *spatial, generator=g)]
    ktm = [torch.randn(3, 2, *spatial, generator=g), torch.randn(3, 5, *spatial, generator=g)]
    labels = torch.randint(1, 4, spatial, generator=g)
    labels.view(-1)[:3] = torch.tensor([1, 2, 3])  # every region present
    masks = region_masks(labels.numpy())
    hard = [(labels.numpy() == v).astype(float) for v in (1, 2, 3)]
    loss, parts = skd_loss(dam, ktm, masks=masks)
    exp = {"batch": 0.0, "pixel": 0.0, "region": 0.0}
    for fd, fk in zip(dam, ktm):
        d, k = fd.double().numpy(), fk.double().numpy()
        exp["batch"] += _ref_term(_ref_sim(_batch_rows(d)), _ref_sim(_batch_rows(k))) / 2
        exp["pixel"] += _ref_term(_ref_sim(_pixel_rows(d)), _ref_sim(_pixel_rows(k))) / 2
        exp["region"] += _ref_term(_ref_sim(_region_rows(d, hard)), _ref_sim(_region_rows(k, hard))) / 2
    for t in exp:
        assert parts[t] == pytest.approx(exp[t], rel=1e-4, abs=1e-6), t
    assert loss.item() == pytest.approx(sum(exp.values()), rel=1e-4)


@pytest.mark.parametrize("dims", [2, 3])
def test_mismatched_spatial_sizes_interpolate_to_the_smaller(dims: int) -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2, 3, *([4] * dims), generator=g)
    small = torch.randn(2, 5, *([2] * dims), generator=g)
    a, b = align_spatial(big, small)
    assert a.shape[2:] == b.shape[2:] == small.shape[2:]
    mode = "bilinear" if dims == 2 else "trilinear"
    shrunk = F.interpolate(big, size=small.shape[2:], mode=mode, align_corners=False)
    _, parts = skd_loss([big], [small], terms=["pixel", "batch"])
    ref_pixel = _ref_term(_ref_sim(_pixel_rows(shrunk.double().numpy())), _ref_sim(_pixel_rows(small.double().numpy())))
    ref_batch = _ref_term(_ref_sim(_batch_rows(big.double().numpy())), _ref_sim(_batch_rows(small.double().numpy())))
    assert parts["pixel"] == pytest.approx(ref_pixel, rel=1e-4)
    assert parts["batch"] == pytest.approx(ref_batch, rel=1e-4)  # the batch term needs no resizing


def test_identical_maps_give_zero_and_gradients_flow_both_ways() -> None:
    g = torch.Generator().manual_seed(2)
    f = torch.randn(4, 3, 5, 5, generator=g)
    loss, _ = skd_loss([f], [f.clone()])
    assert loss.item() == pytest.approx(0.0, abs=1e-10)
    d = torch.randn(4, 3, 5, 5, generator=g, requires_grad=True)
    k = torch.randn(4, 2, 5, 5, generator=g, requires_grad=True)
    masks = region_masks(np.arange(25).reshape(5, 5) % 3 + 1)
    loss, _ = skd_loss([d], [k], masks=masks)
    loss.backward()
    assert d.grad is not None and d.grad.abs().sum() > 0
    assert k.grad is not None and k.grad.abs().sum() > 0


def test_region_term_is_skipped_without_masks_and_bad_input_fails() -> None:
    f = torch.randn(2, 2, 3, 3)
    _, parts = skd_loss([f], [f + 1])
    assert set(parts) == {"batch", "pixel"}
    with pytest.raises(ValueError, match="unknown SKD term"):
        skd_loss([f], [f], terms=["voxel"])
    with pytest.raises(ValueError, match="number of layers"):
        skd_loss([f, f], [f])
    with pytest.raises(ValueError, match="batch sizes differ"):
        skd_loss([f], [f[:1]])


# ------------------------------------------------------------------ region masks

def test_region_masks_keep_every_region_at_every_stage_3d() -> None:
    rng = np.random.default_rng(0)
    atlas = np.zeros((16, 16, 16), dtype=np.int32)
    atlas[2:14, 2:14, 2:14] = rng.integers(1, 6, size=(12, 12, 12))
    atlas[0, 0, 0] = 7        # a one-voxel region in a corner
    atlas[15, 8, 3] = 8       # another one elsewhere
    masks = region_masks(atlas, labels=[1, 2, 3, 4, 5, 7, 8, 9])
    assert masks.labels == [1, 2, 3, 4, 5, 7, 8] and masks.dropped == [9]
    for size in [(16, 16, 16), (8, 8, 8), (4, 4, 4), (2, 2, 2), (1, 1, 1), (3, 5, 2)]:
        m = masks.at(size)
        assert m.shape == (7, *size)
        assert (m.flatten(1).sum(1) > 0).all(), size           # no region disappears
        assert (m >= 0).all() and (m.sum(0) <= 1 + 1e-6).all()  # area fractions
        # the fractions of a cell add up to its non-background share of the atlas
        share = F.adaptive_avg_pool3d(torch.tensor(atlas > 0, dtype=torch.float32)[None, None], size)[0, 0]
        assert torch.allclose(m.sum(0), share, atol=1e-6)
    # hard masks at full resolution; the single voxel keeps weight 1/8 of a cell at 8^3
    assert torch.equal(masks.at((16, 16, 16))[5], torch.tensor(atlas == 7, dtype=torch.float32))
    assert masks.at((8, 8, 8))[5, 0, 0, 0].item() == pytest.approx(1 / 8)


def test_region_masks_2d_and_soft_region_mean() -> None:
    atlas = np.array([[1, 1, 2, 2], [1, 1, 2, 2], [3, 3, 3, 0], [3, 3, 0, 0]])
    masks = region_masks(atlas)
    m = masks.at((2, 2))
    # region 3 covers 3/4 of the lower-left cell and 1/4 of the lower-right one
    assert torch.allclose(m[2], torch.tensor([[0.0, 0.0], [1.0, 0.25]]))
    f = torch.arange(8, dtype=torch.float32).reshape(1, 2, 2, 2)
    r = region_similarity(f, m)
    assert r.shape == (3, 3)
    with pytest.raises(ValueError, match="no voxel"):
        region_masks(np.zeros((3, 3), dtype=int))
    with pytest.raises(ValueError, match="do not match"):
        region_similarity(f, masks.at((4, 4)))


def test_terms_as_tensors_are_the_logged_floats_and_the_same_loss() -> None:
    """``skd_loss(read=False)`` (what FedSKD logs through ``StepMeans``) gives the parts as
    0-d tensors whose values are the read floats, and the same total, to the bit."""
    g = torch.Generator().manual_seed(5)
    d = [torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, 3, 3, generator=g)]
    k = [torch.randn(4, 2, 6, 6, generator=g), torch.randn(4, 5, 3, 3, generator=g)]
    masks = region_masks(np.arange(36).reshape(6, 6) % 4 + 1)
    loss, floats = skd_loss(d, k, masks=masks)
    total, tensors = skd_loss(d, k, masks=masks, read=False)
    assert list(tensors) == list(floats) == ["batch", "pixel", "region"]
    assert all(t.dim() == 0 and float(t) == floats[name] for name, t in tensors.items())
    assert torch.equal(total, loss)
