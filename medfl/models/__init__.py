"""Models following the :class:`FeatureModel` protocol (ResNets on MONAI blocks, small CNNs,
PFedCDP's two-block CNNs) and a weighted ensemble of registered models."""

from __future__ import annotations

from medfl.models import cnn, outputs, resnet
from medfl.models.cnn import (
    PFEDCDP_B_DROPOUT, InputWeighted, TwoBlockCNN, WeightedEnsemble, input_weighted, pfedcdp_a, pfedcdp_b, pfedcdp_c,
    pfedcdp_student, two_block_cnn, weighted_ensemble,
)
from medfl.models.outputs import ProbabilityModel, as_probabilities, returns_probabilities
from medfl.models.resnet import (
    RESNET_DEPTHS, FeatureModel, FeatureResNet, SmallCNN, resnet10, resnet18, resnet34, resnet50, small_cnn,
    split_state_dict,
)

__all__ = sorted({*cnn.__all__, *outputs.__all__, *resnet.__all__})
