"""Models following the :class:`FeatureModel` protocol (ResNets on MONAI blocks, a small CNN)."""

from __future__ import annotations

from medfl.models.outputs import ProbabilityModel, as_probabilities, returns_probabilities
from medfl.models.resnet import (
    RESNET_DEPTHS,
    FeatureModel,
    FeatureResNet,
    SmallCNN,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
    small_cnn,
    split_state_dict,
)

__all__ = [
    "RESNET_DEPTHS",
    "FeatureModel",
    "FeatureResNet",
    "ProbabilityModel",
    "SmallCNN",
    "as_probabilities",
    "returns_probabilities",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "small_cnn",
    "split_state_dict",
]
