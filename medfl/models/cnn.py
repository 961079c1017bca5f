"""PFedCDP's two-block CNNs (models A, B, C and the post-hoc student) and a weighted ensemble.

PFedCDP (section IV.A.2) gives each capability cluster a CNN of two convolutional blocks and
one dense layer before the classifier:

=========================  =======  =====  ================
model                      filters  dense  dropout
=========================  =======  =====  ================
A (high capability)        32, 64   128    none
B (medium capability)      16, 32   64     0.5 (our choice)
C (low capability)         8, 16    32     none
student (server, post hoc) 16, 32   64     0.5
=========================  =======  =====  ================

:class:`TwoBlockCNN` follows the :class:`~medfl.models.resnet.FeatureModel` protocol; its body
("feature extractor" in the paper) is everything but ``head``. :class:`WeightedEnsemble` holds
several registered models and returns the weighted sum of their logits; it is how the
cluster teachers' ensemble travels to clients as a JSON spec plus a state dict.

Example:
    >>> import torch
    >>> m = pfedcdp_a(spatial_dims=2, in_channels=1, num_classes=3).eval()
    >>> logits, (f1, f2) = m.forward_features(torch.zeros(2, 1, 32, 32))
    >>> tuple(logits.shape), tuple(f1.shape), tuple(f2.shape), m.embed_dim
    ((2, 3), (2, 32, 16, 16), (2, 64, 8, 8), 128)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from medfl.models.registry import build_model
from medfl.models.resnet import (
    _ADAPTIVE_AVG_POOL, _CONV, _MAX_POOL, _check_int, _check_io, _init_weights, _KeysMixin, _TwoBlocks,
)

__all__ = ["PFEDCDP_B_DROPOUT", "TwoBlockCNN", "WeightedEnsemble", "InputWeighted", "input_weighted", "two_block_cnn",
           "pfedcdp_a", "pfedcdp_b", "pfedcdp_c", "pfedcdp_student", "weighted_ensemble"]

#: Dropout of model B, which the paper describes only as "includes dropout regularization".
PFEDCDP_B_DROPOUT = 0.5


def _check_filters(filters: Any) -> tuple[int, int]:
    if isinstance(filters, (str, bytes)) or not isinstance(filters, Sequence) or len(filters) != 2:
        raise ValueError(f"filters must be a pair of integers >= 1 (f1, f2), got {filters!r}")
    f1 = _check_int("filters[0]", filters[0])
    f2 = _check_int("filters[1]", filters[1])
    return f1, f2


def _check_dropout(dropout: Any) -> float:
    if (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not 0.0 <= float(dropout) < 1.0
    ):
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    return float(dropout)


class TwoBlockCNN(_TwoBlocks):
    """Two conv blocks, a dense layer and a linear head (PFedCDP's client and student CNNs).

    Module tree (state-dict keys never depend on the widths, the dropout or ``pool``):

    * ``layer1`` = conv3x3(in, f1, padding 1) -> ReLU -> maxpool(2);
    * ``layer2`` = conv3x3(f1, f2, padding 1) -> ReLU -> maxpool(2);
    * ``avgpool`` = adaptive average pool to ``pool`` per spatial side, then flatten;
    * ``fc`` = ``nn.Linear(f2 * pool**spatial_dims, dense)`` -> ReLU -> ``drop``
      (``nn.Dropout(dropout)``, or ``nn.Identity`` when ``dropout == 0``);
    * ``head`` = ``nn.Linear(dense, num_classes)``.

    Convolutions use 3x3 (2D) or 3x3x3 (3D) kernels with bias and no normalisation layer,
    so the model is DP-SGD compatible as is. Weights are initialised as the ResNets are
    (Kaiming fan-out convolutions, zero linear biases).

    Deviation from the paper: the paper flattens the second block's output straight into the
    dense layer, so the dense layer's size depends on an image size it does not state. Here an
    adaptive average pool to a fixed ``pool`` grid (4x4 or 4x4x4 by default) comes first, so
    the dense layer, and the state-dict shapes, are the same for every input size. On inputs
    of side ``4 * pool`` (16 by default) the pool is the identity and the model is exactly
    the paper's.

    Args:
        spatial_dims: 2 (inputs ``(B, C, H, W)``) or 3 (inputs ``(B, C, D, H, W)``). Default 2.
        in_channels: Number of input channels. Default 1.
        num_classes: Number of output logits. Default 2.
        filters: Channels ``(f1, f2)`` of the two conv blocks. Default ``(32, 64)``.
        dense: Units of the dense layer; also :attr:`embed_dim`. Default 128.
        dropout: Dropout probability after the dense layer's ReLU, in ``[0, 1)``; 0 (default)
            means no dropout layer.
        pool: Side of the adaptive average-pool grid. Default 4.

    Attributes:
        feature_channels: ``[f1, f2]``.
        embed_dim: ``dense``.
        head: ``nn.Linear(dense, num_classes)``.

    Raises:
        ValueError: If an argument is out of range; the message names the argument.
    """

    head_prefix: str = "head."

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        num_classes: int = 2,
        filters: Sequence[int] = (32, 64),
        dense: int = 128,
        dropout: float = 0.0,
        pool: int = 4,
    ) -> None:
        super().__init__()
        _check_io(spatial_dims, in_channels, num_classes)
        f1, f2 = _check_filters(filters)
        _check_int("dense", dense)
        p = _check_dropout(dropout)
        _check_int("pool", pool)
        self.spatial_dims, self.in_channels, self.num_classes = spatial_dims, in_channels, num_classes
        self.filters = (f1, f2)
        self.dense = dense
        self.dropout = p
        self.pool = pool

        conv_type = _CONV[spatial_dims]
        pool_type = _MAX_POOL[spatial_dims]
        avgp_type = _ADAPTIVE_AVG_POOL[spatial_dims]

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                conv_type(cin, cout, kernel_size=3, padding=1),
                nn.ReLU(),
                pool_type(kernel_size=2, stride=2),
            )

        self.layer1 = block(in_channels, f1)
        self.layer2 = block(f1, f2)
        self.avgpool = avgp_type(pool)
        self.fc = nn.Linear(f2 * pool**spatial_dims, dense)
        self.act = nn.ReLU()
        self.drop: nn.Module = nn.Dropout(p) if p > 0 else nn.Identity()
        self.feature_channels: list[int] = [f1, f2]
        self.embed_dim: int = dense
        self.head = nn.Linear(dense, num_classes)
        _init_weights(self)

    def _embed_from(self, f2: Tensor) -> Tensor:
        """The dense layer's output after ReLU and dropout (:meth:`embed`), shape ``(B, embed_dim)``."""
        return self.drop(self.act(self.fc(torch.flatten(self.avgpool(f2), 1))))

    def extra_repr(self) -> str:
        return (
            f"spatial_dims={self.spatial_dims}, filters={self.filters}, dense={self.dense}, "
            f"dropout={self.dropout}, pool={self.pool}"
        )


class WeightedEnsemble(nn.Module):
    """Weighted sum of the logits of several registered models.

    The members are built with :func:`medfl.models.registry.build_model` from their specs and
    held in the :class:`nn.ModuleList` ``members``; the weights are a plain attribute (Python
    floats), so ``state_dict()`` holds only the members' tensors, under ``members.<i>.``, and a
    state dict round-trips between two builds of the same spec. This is not a
    :class:`~medfl.models.resnet.FeatureModel`: it has no single head or embedding.

    Args:
        member_specs: Model specs ``{"name": ..., **kwargs}``, already complete.
        weights: Non-negative weights, one per member, summing to 1.

    Attributes:
        member_specs: The specs (copies) the members were built from.
        weights: The weights, as Python floats.
    """

    def __init__(self, member_specs: list[dict[str, Any]], weights: list[float]) -> None:
        super().__init__()
        self.member_specs = [dict(s) for s in member_specs]
        self.weights = [float(w) for w in weights]
        self.members = nn.ModuleList(build_model(s) for s in self.member_specs)

    def forward(self, x: Tensor) -> Tensor:
        """``sum_i weights[i] * members[i](x)``, shape ``(B, num_classes)``."""
        out: Tensor | None = None
        for w, m in zip(self.weights, self.members):
            term = w * m(x)
            out = term if out is None else out + term
        assert out is not None
        return out

    def extra_repr(self) -> str:
        return f"weights={[round(w, 6) for w in self.weights]}"


class InputWeighted(_KeysMixin, nn.Module):
    """A :class:`~medfl.models.resnet.FeatureModel` that sees its input multiplied, feature by
    feature, by fixed weights (a buffer, so they travel in the state dict).

    PFedCDP's per-feature reading of eq. 19 (``feature_shap="input"``): the weights come from
    the teachers' mean SHAP importance map (:func:`medfl.shapley.importance_weights`, mean 1),
    so the student learns from, and is evaluated on, inputs in which the features the teachers
    rely on are emphasised and the others damped. ``inner`` is any registered FeatureModel.

    Args:
        inner: the wrapped model.
        shape: the per-sample input shape ``(C, H, W[, D])`` of the weights (initially ones).
    """

    def __init__(self, inner: nn.Module, shape: Sequence[int]) -> None:
        super().__init__()
        for attr in ("embed", "head", "forward_features"):
            if not hasattr(inner, attr):
                raise ValueError(f"input_weighted: the inner model {type(inner).__name__} has no {attr}()")
        self.inner = inner
        self.register_buffer("feature_weights", torch.ones(tuple(int(v) for v in shape)))
        self.head_prefix = "inner." + getattr(inner, "head_prefix", "head.")
        self.embed_dim = getattr(inner, "embed_dim", None)

    @property
    def head(self) -> nn.Module:
        """The inner model's head."""
        return self.inner.head

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The inner model's logits and stage outputs on the weighted input."""
        return self.inner.forward_features(x * self.feature_weights)

    def embed(self, x: Tensor) -> Tensor:
        """The inner model's embedding of the weighted input."""
        return self.inner.embed(x * self.feature_weights)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of the weighted input."""
        return self.inner(x * self.feature_weights)


# --------------------------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------------------------


def two_block_cnn(
    *,
    spatial_dims: int = 2,
    in_channels: int = 1,
    num_classes: int = 2,
    filters: Sequence[int] = (32, 64),
    dense: int = 128,
    dropout: float = 0.0,
    pool: int = 4,
) -> TwoBlockCNN:
    """A :class:`TwoBlockCNN` of any widths (defaults: PFedCDP's model A)."""
    return TwoBlockCNN(spatial_dims, in_channels, num_classes, filters, dense, dropout, pool)


def pfedcdp_a(
    *, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2, pool: int = 4
) -> TwoBlockCNN:
    """PFedCDP's model A (high-capability cluster): filters 32/64, dense 128, no dropout."""
    return TwoBlockCNN(spatial_dims, in_channels, num_classes, (32, 64), 128, 0.0, pool)


def pfedcdp_b(
    *, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2, pool: int = 4
) -> TwoBlockCNN:
    """PFedCDP's model B (medium-capability cluster): filters 16/32, dense 64, dropout 0.5.

    The paper says model B "includes dropout regularization" without a rate; 0.5
    (:data:`PFEDCDP_B_DROPOUT`, the student's rate) is our choice.
    """
    return TwoBlockCNN(
        spatial_dims, in_channels, num_classes, (16, 32), 64, PFEDCDP_B_DROPOUT, pool
    )


def pfedcdp_c(
    *, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2, pool: int = 4
) -> TwoBlockCNN:
    """PFedCDP's model C (low-capability cluster): filters 8/16, dense 32, no dropout."""
    return TwoBlockCNN(spatial_dims, in_channels, num_classes, (8, 16), 32, 0.0, pool)


def pfedcdp_student(
    *, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2, pool: int = 4
) -> TwoBlockCNN:
    """PFedCDP's post-hoc student (server side): filters 16/32, dense 64, dropout 0.5."""
    return TwoBlockCNN(spatial_dims, in_channels, num_classes, (16, 32), 64, 0.5, pool)


def weighted_ensemble(
    *,
    members: list[dict[str, Any]],
    weights: list[float] | None = None,
    spatial_dims: int = 2,
    in_channels: int = 1,
    num_classes: int = 2,
) -> WeightedEnsemble:
    """A :class:`WeightedEnsemble` of registered models, e.g. the cluster teachers.

    Each member spec gets ``spatial_dims``, ``in_channels`` and ``num_classes`` filled in when
    absent; the spec (this factory's arguments) is JSON-serialisable when the member specs are.

    Args:
        members: Non-empty list of model specs ``{"name": ..., **kwargs}``.
        weights: One non-negative, finite weight per member, not all zero; normalised to sum
            to 1. Default: uniform.
        spatial_dims: Filled into member specs that lack it. Default 2.
        in_channels: Filled into member specs that lack it. Default 1.
        num_classes: Filled into member specs that lack it. Default 2.

    Returns:
        The ensemble; ``forward(x)`` is ``sum_i w_i * member_i(x)`` with normalised weights.

    Raises:
        ValueError: Bad ``members`` or ``weights`` (named, with the index), or a member spec
            whose ``spatial_dims`` / ``in_channels`` / ``num_classes`` differs from the
            ensemble's. Errors from :func:`~medfl.models.registry.build_model` propagate
            (unknown model name, unknown argument).
    """
    _check_io(spatial_dims, in_channels, num_classes)
    if isinstance(members, (str, bytes, dict)) or not isinstance(members, Sequence) or not members:
        raise ValueError(f"members must be a non-empty list of model specs, got {members!r}")
    filled = {"spatial_dims": spatial_dims, "in_channels": in_channels, "num_classes": num_classes}
    specs: list[dict[str, Any]] = []
    for i, spec in enumerate(members):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"members[{i}] must be a model spec with a 'name', got {spec!r}")
        spec = dict(spec)
        for key, want in filled.items():
            if spec.setdefault(key, want) != want:
                raise ValueError(f"members[{i}].{key} is {spec[key]!r} but the ensemble's {key} is {want!r}")
        specs.append(spec)
    if weights is None:
        norm = [1.0 / len(specs)] * len(specs)
    else:
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise ValueError(f"weights must be a list of numbers, got {weights!r}")
        if len(weights) != len(specs):
            raise ValueError(
                f"weights has {len(weights)} entries but there are {len(specs)} members"
            )
        for i, w in enumerate(weights):
            number = not isinstance(w, bool) and isinstance(w, (int, float))
            if not number or not math.isfinite(w) or w < 0:
                raise ValueError(f"weights[{i}] must be a finite number >= 0, got {w!r}")
        total = float(sum(weights))
        if total <= 0:
            raise ValueError(f"weights must not all be zero, got {list(weights)!r}")
        norm = [float(w) / total for w in weights]
    return WeightedEnsemble(specs, norm)


def input_weighted(
    *,
    inner: dict[str, Any],
    shape: Sequence[int],
    spatial_dims: int = 2,
    in_channels: int = 1,
    num_classes: int = 2,
) -> InputWeighted:
    """An :class:`InputWeighted` around the registered model ``inner`` (a spec; its
    ``spatial_dims``, ``in_channels`` and ``num_classes`` default to these), with weights of
    per-sample ``shape`` (all ones until a state dict sets them)."""
    full = {"spatial_dims": spatial_dims, "in_channels": in_channels, "num_classes": num_classes, **dict(inner)}
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)) or len(shape) != spatial_dims + 1:
        raise ValueError(f"input_weighted: shape must be (C, H, W[, D]) with {spatial_dims} spatial dims, "
                         f"got {shape!r}")
    return InputWeighted(build_model(full), shape)
