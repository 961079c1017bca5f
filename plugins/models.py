"""Built-in models: ResNets, small CNNs, PFedCDP's CNNs and a weighted ensemble.

MONAI ResNet-10/18/34/50 (2D/3D, width knob), ``small_cnn``, PFedCDP's two-block CNNs
(``two_block_cnn``, ``pfedcdp_a/b/c``, ``pfedcdp_student``) and ``weighted_ensemble``.
"""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.models.cnn import (input_weighted, pfedcdp_a, pfedcdp_b, pfedcdp_c, pfedcdp_student, two_block_cnn,
                              weighted_ensemble)
from medfl.models.resnet import resnet10, resnet18, resnet34, resnet50, small_cnn

__all__ = ["register_models"]


@hookimpl
def register_models(register: Callable[..., None]) -> None:
    """Register ``resnet10``, ``resnet18``, ``resnet34``, ``resnet50``, ``small_cnn``,
    ``two_block_cnn``, ``pfedcdp_a``, ``pfedcdp_b``, ``pfedcdp_c``, ``pfedcdp_student``,
    ``weighted_ensemble`` and ``input_weighted``."""
    for factory in (resnet10, resnet18, resnet34, resnet50, small_cnn, two_block_cnn, pfedcdp_a, pfedcdp_b, pfedcdp_c,
                    pfedcdp_student, weighted_ensemble, input_weighted):
        register(factory, name=factory.__name__)
