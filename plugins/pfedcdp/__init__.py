"""PFedCDP (paper 000), the method :class:`PFedCDP` (``docs/pfedcdp.md``: the algorithm, the
choices, the deviations). Its reusable pieces are medfl's: :mod:`medfl.capability` (eqs. 1-2),
:mod:`medfl.losses.distill`, :mod:`medfl.shapley`, :mod:`medfl.models.cnn` (models A / B / C)."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl_plugins.pfedcdp.mechanisms import personal_observables, quantization_error
from medfl_plugins.pfedcdp.method import PFedCDP
from medfl_plugins.pfedcdp.models import fisher_information, fisher_masks, mix_extractor, recalibrate_norms
from medfl_plugins.pfedcdp.presets import PRESETS
from medfl_plugins.pfedcdp.release import WEIGHT_DP, authors_quantize, clip_noise_tensors
from medfl_plugins.pfedcdp.settings import (AUTHORS_NOISE_MULTIPLIER, AUTHORS_TEACHER_WEIGHTS,
                                            AUTHORS_V17_NOISE_MULTIPLIER, DEFAULT_CLUSTER_MODELS, DP_MODES)

__all__ = ["PFedCDP", "AUTHORS_NOISE_MULTIPLIER", "AUTHORS_TEACHER_WEIGHTS", "AUTHORS_V17_NOISE_MULTIPLIER",
           "DEFAULT_CLUSTER_MODELS", "DP_MODES", "PRESETS", "WEIGHT_DP", "authors_quantize", "clip_noise_tensors",
           "fisher_information", "fisher_masks", "mix_extractor", "personal_observables", "quantization_error",
           "recalibrate_norms", "register_methods"]


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register PFedCDP."""
    register(PFedCDP)
