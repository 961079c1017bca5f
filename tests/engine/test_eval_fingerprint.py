"""The evaluation cache's model fingerprint (issue 50: a round's own work on a GPU).

A client's evaluation hashed its whole model every time, one copy off the device per tensor,
to share the global test split's scores between identical models. It is now hashed only when
the global test split is scored, in one copy, and the hash is the one it always was.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

import medfl.training
from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.models.registry import build_model
from medfl.training import state_fingerprint


def test_the_fingerprint_is_the_per_tensor_hash_it_always_was() -> None:
    """Keys and raw bytes of each tensor in order (float, integer and boolean buffers)."""
    model = build_model({"name": "resnet10", "width": 8, "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
    model.register_buffer("mask", torch.tensor([True, False, True]))
    h = hashlib.sha1()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    assert state_fingerprint(model) == h.hexdigest()
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    assert state_fingerprint(model) != h.hexdigest()


@pytest.mark.parametrize("splits", [["test"], ["test", "global_test"]])
def test_a_model_is_hashed_only_to_share_the_global_test_splits_scores(
        tiny_fl: dict[str, Any], splits: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a global test split no evaluation hashes its model; with one, each hash is
    for that split's shared scores."""
    calls: list[int] = []
    real = medfl.training.state_fingerprint

    def counted(model: torch.nn.Module) -> str:
        calls.append(1)
        return real(model)

    monkeypatch.setattr(medfl.training, "state_fingerprint", counted)
    run_experiment(resolve_config({**tiny_fl, "eval_splits": splits}))
    assert (len(calls) > 0) == ("global_test" in splits)
