"""Aggregations of the baseline methods against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from medfl.training import weighted_average
from medfl.messages import Reply
from medfl_plugins.baselines import FedAdam, FedAvg, FedAvgM


def _prepare(method, old):
    method.param_keys = ["w"]
    method.global_state = {"w": torch.tensor(old), "n": torch.tensor(4)}
    return method


def test_weighted_average_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1, 2])
    assert torch.allclose(out["w"], torch.tensor([3.0, 6.0]))  # (1*1 + 2*4)/3, (2 + 16)/3
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4  # round((2 + 10) / 3)


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average([{"w": torch.zeros(1)}], [0.0])


def test_fedavg_weights_by_examples():
    m = _prepare(FedAvg(), [0.0])
    replies = {"0": Reply({"model": {"w": torch.tensor([1.0]), "n": torch.tensor(1)}}, num_examples=10),
               "1": Reply({"model": {"w": torch.tensor([4.0]), "n": torch.tensor(1)}}, num_examples=30)}
    m.server_update(1, replies)
    assert m.global_state["w"].item() == pytest.approx(3.25)  # (10*1 + 30*4) / 40


def test_fedavgm_momentum_hand_computed():
    m = _prepare(FedAvgM(beta=0.5, server_lr=1.0), [1.0])
    rep = {"0": Reply({"model": {"w": torch.tensor([0.0]), "n": torch.tensor(1)}}, num_examples=1)}
    m.server_update(1, rep)  # delta = 1 - 0 = 1; v = 1; w = 1 - 1 = 0
    assert m.global_state["w"].item() == pytest.approx(0.0)
    rep = {"0": Reply({"model": {"w": torch.tensor([-1.0]), "n": torch.tensor(1)}}, num_examples=1)}
    m.server_update(2, rep)  # delta = 0 - (-1) = 1; v = 0.5 + 1 = 1.5; w = 0 - 1.5
    assert m.global_state["w"].item() == pytest.approx(-1.5)


def test_fedadam_hand_computed():
    m = _prepare(FedAdam(eta=0.1, beta1=0.9, beta2=0.99, tau=0.01), [0.0])
    rep = {"0": Reply({"model": {"w": torch.tensor([2.0]), "n": torch.tensor(1)}}, num_examples=1)}
    m.server_update(1, rep)
    # delta = 2; m = 0.2; v = 0.01 * 4 = 0.04; w = 0 + 0.1 * 0.2 / (0.2 + 0.01)
    assert m.global_state["w"].item() == pytest.approx(0.1 * 0.2 / 0.21, rel=1e-6)
    # buffers take the plain average
    assert int(m.global_state["n"]) == 1
