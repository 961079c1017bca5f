"""Engines: the in-process runner, client contexts and state, training helpers."""

from __future__ import annotations

from typing import Any

from medfl.engine.client import ClientContext, ClientStore, run_client_evaluate, run_client_update
from medfl.hub import HubAndSpoke, norm_keys
from medfl.engine.runner import Run, RunError
from medfl.training import get_state, make_optimizer, predict_proba, train_epochs, weighted_average

__all__ = [
    "ClientContext", "ClientStore", "run_client_update", "run_client_evaluate",
    "HubAndSpoke", "norm_keys", "Run", "RunError",
    "get_state", "make_optimizer", "predict_proba", "train_epochs", "weighted_average",
]


def __getattr__(name: str) -> Any:
    """``resume`` and ``run_experiment``, now :mod:`medfl.experiment`'s: imported from there on
    first use, with a ``DeprecationWarning`` (the engine never imports the experiment level)."""
    if name in ("resume", "run_experiment"):
        import importlib
        import warnings

        warnings.warn(f"medfl.engine.{name} is deprecated: import it from medfl.experiment (the old path goes away "
                      "in a later release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("medfl.experiment"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
