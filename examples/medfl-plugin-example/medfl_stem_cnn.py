"""A medfl model plugin: ``stem_cnn``, a learned 1x1 input stem in front of a registered model.

The stem (1x1 convolution -> BatchNorm -> ReLU) maps the ``in_channels`` input channels to
``stem_channels`` learned ones (a per-pixel intensity or colour mapping); the inner model, any
registered :class:`medfl.models.FeatureModel` (default ``small_cnn``), sees those channels.
Config: ``"model": {"name": "stem_cnn", "stem_channels": 3, "inner": {"name": "small_cnn",
"width": 8}}``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from medfl import hookimpl
from medfl.models import FeatureModel
from medfl.models.registry import ModelConfigError, build_model

__all__ = ["StemCNN", "stem_cnn", "register_models", "requires_medfl_api"]

requires_medfl_api = ">=1.0,<2"

_CONV = {2: nn.Conv2d, 3: nn.Conv3d}
_NORM = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class StemCNN(nn.Module):
    """A 1x1 stem, then ``inner``; follows the :class:`medfl.models.FeatureModel` protocol.

    The head is the inner model's (state-dict keys under ``head_prefix``, ``"inner.head."``
    for the built-ins), so body/head methods (FedSDC, PFedCDP, FedSKD's frozen head) split
    this model as they split the inner one. The stages are the stem's output, then the inner
    model's. No state-dict key depends on ``stem_channels``, so clients may differ in it.

    Args:
        inner: the wrapped model, built for ``stem_channels`` input channels.
        spatial_dims: 2 or 3.
        in_channels: channels of the input.
        stem_channels: channels the stem makes (the inner model's ``in_channels``).
    """

    def __init__(self, inner: nn.Module, spatial_dims: int, in_channels: int,
                 stem_channels: int) -> None:
        super().__init__()
        needed = ("embed", "embed_dim", "forward_features", "head_keys")
        missing = [a for a in needed if not hasattr(inner, a)]
        if not isinstance(inner, FeatureModel) or missing:
            what = ", ".join(missing) or "head or head_prefix"
            raise ModelConfigError(f"stem_cnn: the inner model {type(inner).__name__} is not a "
                             f"FeatureModel (missing {what})")
        conv = _CONV[spatial_dims](in_channels, stem_channels, kernel_size=1, bias=False)
        self.stem = nn.Sequential(conv, _NORM[spatial_dims](stem_channels), nn.ReLU(inplace=True))
        self.inner = inner
        self.head_prefix = "inner." + inner.head_prefix
        self.embed_dim = int(inner.embed_dim)

    @property
    def head(self) -> nn.Module:
        """The inner model's classifier (registered once, under ``inner``)."""
        return self.inner.head

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` of an input ``(B, in_channels, H, W[, D])``."""
        return self.inner(self.stem(x))

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and the stages: the stem's output ``(B, stem_channels, H, W[, D])``, then
        the inner model's stage outputs."""
        s = self.stem(x)
        logits, feats = self.inner.forward_features(s)
        return logits, [s, *feats]

    def embed(self, x: Tensor) -> Tensor:
        """The inner model's pooled features ``(B, embed_dim)``, the head's input."""
        return self.inner.embed(self.stem(x))

    def body_keys(self) -> list[str]:
        """State-dict keys outside the head."""
        return [k for k in self.state_dict() if not k.startswith(self.head_prefix)]

    def head_keys(self) -> list[str]:
        """State-dict keys of the head (all start with ``head_prefix``)."""
        return [k for k in self.state_dict() if k.startswith(self.head_prefix)]


def stem_cnn(*, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2,
             stem_channels: int = 4, inner: dict[str, Any] | None = None) -> StemCNN:
    """A :class:`StemCNN`: ``stem_channels`` learned input channels (default 4), then the
    registered model ``inner`` (a spec, default ``{"name": "small_cnn"}``), which is built
    with this model's ``spatial_dims`` and ``num_classes`` and ``in_channels=stem_channels``."""
    if spatial_dims not in _CONV:
        raise ModelConfigError(f"stem_cnn: spatial_dims must be 2 or 3, got {spatial_dims!r}")
    if isinstance(stem_channels, bool) or not isinstance(stem_channels, int) or stem_channels < 1:
        raise ModelConfigError(f"stem_cnn: stem_channels must be an integer >= 1, got {stem_channels!r}")
    spec = {"name": "small_cnn"} if inner is None else inner
    set_here = {"spatial_dims", "in_channels", "num_classes"}
    if not isinstance(spec, dict) or "name" not in spec or set_here & set(spec):
        raise ModelConfigError(f"stem_cnn: inner must be a model spec {{'name': ..., options}} without "
                         f"spatial_dims, in_channels or num_classes (stem_cnn sets them), got "
                         f"{spec!r}")
    spec = {**spec, "spatial_dims": spatial_dims, "in_channels": stem_channels,
            "num_classes": num_classes}
    return StemCNN(build_model(spec), spatial_dims, in_channels, stem_channels)


@hookimpl
def register_models(register):
    """Register ``stem_cnn``."""
    register(stem_cnn, name="stem_cnn")
