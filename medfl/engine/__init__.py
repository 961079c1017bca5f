"""Engines: the in-process runner, client contexts and state, training helpers."""

from __future__ import annotations

from medfl.engine.client import ClientContext, ClientStore, run_client_evaluate, run_client_update
from medfl.hub import HubAndSpoke, norm_keys
from medfl.engine.runner import Run, RunError
from medfl.training import get_state, make_optimizer, predict_proba, train_epochs, weighted_average

__all__ = [
    "ClientContext", "ClientStore", "run_client_update", "run_client_evaluate",
    "HubAndSpoke", "norm_keys", "Run", "RunError",
    "get_state", "make_optimizer", "predict_proba", "train_epochs", "weighted_average",
]
