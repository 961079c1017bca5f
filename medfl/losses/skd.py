"""FedSKD's multi-dimensional similarity knowledge distillation (paper 004, eqs. 4-15).

For a feature map ``F`` of shape ``(b, c, *spatial)`` at one layer (``spatial`` is ``(h, w)``
in 2D and ``(d, h, w)`` in 3D; ``n = prod(spatial)``), three similarity matrices are
compared between the local model (DAM) and the received model (KTM)::

    batch   (eqs. 4-6):   H = reshape(F, b x c n)      B = rownorm(H Hᵀ) sqrt(b)   L = ||B_D - B_K||²_F / b²
    pixel/voxel (7-9):    H = reshape(F, n x b c)      P = rownorm(H Hᵀ) sqrt(n)   L = ||P_D - P_K||²_F / n²
    region  (10-14):      H_k = mean of F over region k (b x c), stacked r x b c
                                                       R = rownorm(H Hᵀ) sqrt(r)   L = ||R_D - R_K||²_F / r²

``rownorm`` divides every row by its L2 norm (dim 1). Each term is averaged over the
distilled layers (1/|L| sum over layers), and the total is their sum (eq. 15). Channel
counts of the two models may differ freely (every matrix is b x b, n x n or r x r).

Choices where the paper is loose, stated once here:

* eq. 9 prints ``1/hw^2``; it is read as ``1/(hw)^2`` (the b x b and r x r terms divide by the
  squared matrix size, and ``(hw)^2`` is the size of ``P``).
* When the two models' maps at a layer differ in spatial size, the larger map is resized to
  the smaller one by (bi/tri)linear interpolation before the pixel/voxel term (the paper:
  "bilinear interpolation"); the batch and region terms need no resizing.
* Region masks are soft: the atlas label volume (on the input grid, any resolution) becomes
  one area-fraction mask per region and feature-map size (:func:`region_masks`): the fraction
  of each feature cell covered by region k. ``H_k`` is the mask-weighted mean (eq. 10 with
  hard masks when a cell lies wholly inside one region). Every region with at least one
  voxel on the atlas grid keeps a positive weight at every stage, however coarse. A region
  with no voxel at all on the atlas grid is dropped (the same set for both models, so the
  two matrices stay comparable); :func:`region_masks` reports how many were dropped.
* A zero row (a sample or cell with all-zero features, e.g. after ReLU) is left at zero by
  the normalisation (its norm is clamped at 1e-12) instead of producing NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = [
    "SKD_TERMS",
    "row_normalize",
    "batch_similarity",
    "spatial_similarity",
    "region_features",
    "region_similarity",
    "align_spatial",
    "region_masks",
    "RegionMasks",
    "skd_loss",
]

#: The three similarity terms, in the paper's order.
SKD_TERMS = ("batch", "pixel", "region")


def row_normalize(g: Tensor, eps: float = 1e-12) -> Tensor:
    """Divide each row of ``g`` by its L2 norm (``||.||_2^(1)`` of eq. 4)."""
    return g / g.norm(p=2, dim=1, keepdim=True).clamp_min(eps)


def _gram(h: Tensor) -> Tensor:
    """``rownorm(H Hᵀ) * sqrt(rows)`` for a 2-D ``H`` (rows x features)."""
    return row_normalize(h @ h.t()) * math.sqrt(h.shape[0])


def batch_similarity(fmap: Tensor) -> Tensor:
    """Batch-wise similarity ``B`` (eq. 4), ``(b, b)``, of a map ``(b, c, *spatial)``."""
    return _gram(fmap.reshape(fmap.shape[0], -1))


def spatial_similarity(fmap: Tensor) -> Tensor:
    """Pixel/voxel-wise similarity ``P`` (eq. 7), ``(n, n)`` with ``n = prod(spatial)``:
    rows are spatial positions, features are every (sample, channel) pair."""
    b, c = fmap.shape[:2]
    h = fmap.reshape(b * c, -1).t()  # (n, b c): row = one position across samples and channels
    return _gram(h)


def region_features(fmap: Tensor, masks: Tensor) -> Tensor:
    """Region features ``H`` (eqs. 10-11), ``(r, b c)``: the mask-weighted mean of ``fmap``
    ``(b, c, *spatial)`` over each of ``masks`` ``(r, *spatial)`` (soft or hard masks)."""
    if tuple(masks.shape[1:]) != tuple(fmap.shape[2:]):
        raise ValueError(f"region masks of spatial shape {tuple(masks.shape[1:])} do not match the "
                         f"feature map {tuple(fmap.shape[2:])}")
    b, c = fmap.shape[:2]
    m = masks.reshape(masks.shape[0], -1).to(fmap.dtype)
    m = m / m.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return m @ fmap.reshape(b * c, -1).t()  # (r, b c)


def region_similarity(fmap: Tensor, masks: Tensor) -> Tensor:
    """Region-wise similarity ``R`` (eq. 12), ``(r, r)``."""
    return _gram(region_features(fmap, masks))


def align_spatial(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Resize the larger of two maps ``(b, c, *spatial)`` to the smaller one's spatial size
    ((bi/tri)linear, per axis the minimum), so the pixel/voxel term can compare them."""
    sa, sb = tuple(a.shape[2:]), tuple(b.shape[2:])
    if sa == sb:
        return a, b
    if len(sa) != len(sb):
        raise ValueError(f"cannot compare a {len(sa)}D map with a {len(sb)}D map")
    target = tuple(min(x, y) for x, y in zip(sa, sb))
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(target)]
    if sa != target:
        a = F.interpolate(a, size=target, mode=mode, align_corners=False)
    if sb != target:
        b = F.interpolate(b, size=target, mode=mode, align_corners=False)
    return a, b


@dataclass
class RegionMasks:
    """Area-fraction region masks from an atlas label volume, computed per feature-map size.

    Attributes:
        labels: the region label of each mask row (atlas values, background 0 excluded).
        dropped: atlas labels asked for but with no voxel on the atlas grid.
    """

    one_hot: Tensor                 # (r, *atlas spatial), float32, hard masks on the atlas grid
    labels: list[int]
    dropped: list[int]

    def __post_init__(self) -> None:
        self._cache: dict[tuple[int, ...], Tensor] = {}

    def at(self, size: Sequence[int]) -> Tensor:
        """Masks ``(r, *size)``: the fraction of each cell of a ``size`` grid covered by each
        region (adaptive average pooling of the hard masks; each cell's fractions sum to
        its non-background share)."""
        key = tuple(int(s) for s in size)
        if key not in self._cache:
            if len(key) != self.one_hot.dim() - 1:
                raise ValueError(f"atlas is {self.one_hot.dim() - 1}D; feature map is {len(key)}D")
            pool = F.adaptive_avg_pool3d if len(key) == 3 else F.adaptive_avg_pool2d
            chunks = [pool(part.unsqueeze(0), key)[0] for part in torch.split(self.one_hot, 32)]
            self._cache[key] = torch.cat(chunks) if chunks else self.one_hot.new_zeros((0, *key))
        return self._cache[key]


def region_masks(atlas: np.ndarray | Tensor, labels: Sequence[int] | None = None) -> RegionMasks:
    """Build :class:`RegionMasks` from an integer label volume (0 = background).

    Args:
        atlas: label volume on the input grid, ``(H, W)`` or ``(D, H, W)``, the same field of
            view as the model input (its resolution may differ).
        labels: the regions to use (default: every non-zero label present).

    Raises:
        ValueError: no region left.
    """
    arr = torch.as_tensor(np.asarray(atlas)).long()
    present = sorted(int(v) for v in torch.unique(arr).tolist() if v != 0)
    wanted = present if labels is None else [int(v) for v in labels]
    keep = [v for v in wanted if v in set(present)]
    dropped = [v for v in wanted if v not in set(present)]
    if not keep:
        raise ValueError(f"atlas has no voxel of any requested region (requested {len(wanted)})")
    one_hot = torch.stack([(arr == v).float() for v in keep])
    return RegionMasks(one_hot=one_hot, labels=keep, dropped=dropped)


def _term(a: Tensor, b: Tensor) -> Tensor:
    n = a.shape[0]
    return (a - b).pow(2).sum() / float(n * n)


def skd_loss(
    dam_feats: Sequence[Tensor],
    ktm_feats: Sequence[Tensor],
    *,
    terms: Sequence[str] = SKD_TERMS,
    masks: RegionMasks | None = None,
    read: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """The multi-dimensional SKD loss (eq. 15) between two models' feature maps.

    Args:
        dam_feats: the DAM's maps of the distilled layers, each ``(b, c, *spatial)``.
        ktm_feats: the KTM's maps of the same layers (channels and spatial size may differ).
        terms: which of ``batch``, ``pixel``, ``region`` to include (the paper's ablations).
        masks: region masks; the region term is skipped when ``None`` (no atlas).
        read: give the parts as floats; ``False`` leaves them 0-d tensors where they were
            computed, for a loop that logs them without waiting for the GPU each step
            (:class:`medfl.training.StepMeans`; same values).

    Returns:
        ``(loss, parts)``: the sum of the included terms, each the mean over layers of eqs.
        6, 9 and 14; ``parts`` holds each term's value (for logging).

    Raises:
        ValueError: different numbers of layers or batch sizes, or an unknown term.
    """
    unknown = sorted(set(terms) - set(SKD_TERMS))
    if unknown:
        raise ValueError(f"unknown SKD term(s) {unknown}; valid: {', '.join(SKD_TERMS)}")
    if len(dam_feats) != len(ktm_feats) or not dam_feats:
        raise ValueError(f"SKD needs the same non-zero number of layers from both models, got "
                         f"{len(dam_feats)} and {len(ktm_feats)}")
    active = [t for t in SKD_TERMS if t in terms and (t != "region" or masks is not None)]
    sums = {t: dam_feats[0].new_zeros(()) for t in active}
    for fd, fk in zip(dam_feats, ktm_feats):
        if fd.shape[0] != fk.shape[0]:
            raise ValueError(f"batch sizes differ: {fd.shape[0]} vs {fk.shape[0]}")
        if "batch" in sums:
            sums["batch"] = sums["batch"] + _term(batch_similarity(fd), batch_similarity(fk))
        if "pixel" in sums:
            a, b = align_spatial(fd, fk)
            sums["pixel"] = sums["pixel"] + _term(spatial_similarity(a), spatial_similarity(b))
        if "region" in sums:
            assert masks is not None
            md, mk = masks.at(fd.shape[2:]).to(fd.device), masks.at(fk.shape[2:]).to(fk.device)
            sums["region"] = sums["region"] + _term(region_similarity(fd, md), region_similarity(fk, mk))
    layers = float(len(dam_feats))
    parts = {t: v / layers for t, v in sums.items()}
    total = sum(parts.values(), dam_feats[0].new_zeros(()))
    return total, ({t: float(v.detach()) for t, v in parts.items()} if read else parts)
