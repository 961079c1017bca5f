"""Built-in metrics: accuracy, precision, recall, sensitivity, specificity, F1, micro-F1, AUC."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.metrics.classification import METRICS

__all__ = ["register_metrics"]


@hookimpl
def register_metrics(register: Callable[..., None]) -> None:
    """Register every metric of :data:`medfl.metrics.classification.METRICS`."""
    for name, func in METRICS.items():
        register(func, name=name)
