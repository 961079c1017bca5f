"""Built-in models: MONAI ResNet-10/18/34/50 (2D/3D, width knob) and a small CNN."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.models.resnet import resnet10, resnet18, resnet34, resnet50, small_cnn

__all__ = ["register_models"]


@hookimpl
def register_models(register: Callable[..., None]) -> None:
    """Register ``resnet10``, ``resnet18``, ``resnet34``, ``resnet50`` and ``small_cnn``."""
    for factory in (resnet10, resnet18, resnet34, resnet50, small_cnn):
        register(factory, name=factory.__name__)
