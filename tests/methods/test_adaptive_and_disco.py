"""FedYogi and FedAdagrad (Reddi et al. 2021, Algorithm 2: FedAdam's code with another second
moment) and FedDisco (Ye et al. 2023, eq. 5) against hand-computed values, and what FedDisco's
clients send (the model and one scalar)."""

from __future__ import annotations

import math

import pytest
import torch

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.messages import Reply
from medfl_plugins.baselines import FedAdagrad, FedAdam, FedDisco, FedYogi, disco_discrepancy, disco_weights


def _steps(method, deltas: list[float]) -> list[float]:
    """Server steps of ``method`` on a one-parameter model, the aggregate moving the global
    weight by ``delta`` from where it is each round."""
    method.param_keys = ["w"]
    w = torch.tensor([1.0])
    out = []
    for r, d in enumerate(deltas, start=1):
        w = method.server_step(r, {"w": w}, {"w": w + d})["w"]
        out.append(float(w))
    return out


def test_server_optimizers_by_hand():
    eta, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    # round 1, delta 0.5: m = 0.05 for all three; v: Adam and Yogi 0.0025, Adagrad 0.25
    m1 = (1 - b1) * 0.5
    adam1 = 1.0 + eta * m1 / (math.sqrt(0.0025) + tau)
    adagrad1 = 1.0 + eta * m1 / (math.sqrt(0.25) + tau)
    # round 2, delta 0.1: m = 0.9 * 0.05 + 0.01 = 0.055
    m2 = b1 * m1 + (1 - b1) * 0.1
    v_adam = b2 * 0.0025 + (1 - b2) * 0.01                      # 0.002575
    v_yogi = 0.0025 + (1 - b2) * 0.01       # v - (1 - b2) d^2 sign(v - d^2), sign(0.0025 - 0.01) = -1
    v_adagrad = 0.25 + 0.01
    got_adam = _steps(FedAdam(eta, b1, b2, tau), [0.5, 0.1])
    got_yogi = _steps(FedYogi(eta, b1, b2, tau), [0.5, 0.1])
    got_adagrad = _steps(FedAdagrad(eta, b1, b2, tau), [0.5, 0.1])
    assert got_adam[0] == pytest.approx(adam1, rel=1e-6) and got_yogi[0] == pytest.approx(adam1, rel=1e-6)
    assert got_adagrad[0] == pytest.approx(adagrad1, rel=1e-6)
    assert got_adam[1] == pytest.approx(adam1 + eta * m2 / (math.sqrt(v_adam) + tau), rel=1e-6)
    assert got_yogi[1] == pytest.approx(adam1 + eta * m2 / (math.sqrt(v_yogi) + tau), rel=1e-6)
    assert got_adagrad[1] == pytest.approx(adagrad1 + eta * m2 / (math.sqrt(v_adagrad) + tau), rel=1e-6)
    # Yogi shrinks v additively when updates get small: v = 0.0025 - 0.01 * 1e-4 * sign(0.0025 - 1e-4)
    yogi = FedYogi(eta, b1, b2, tau)
    _steps(yogi, [0.5, 0.01])
    assert float(yogi.v["w"]) == pytest.approx(0.0025 - (1 - b2) * 1e-4, rel=1e-6)


def test_disco_discrepancy_and_weights_by_hand():
    assert disco_discrepancy([3, 1]) == pytest.approx(math.sqrt(2 * 0.25**2))
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert disco_discrepancy([3, 1], "kl") == pytest.approx(kl)
    assert disco_discrepancy([5, 5, 5]) == pytest.approx(0.0) and disco_discrepancy([0, 0]) == 0.0
    # shares 0.75 / 0.25; ReLU(0.75 - 0 + 0.1) = 0.85, ReLU(0.25 - 0.25 + 0.1) = 0.1
    assert disco_weights([30, 10], [0.0, 0.5]) == pytest.approx([0.85 / 0.95, 0.1 / 0.95])
    assert disco_weights([30, 10], [0.0, 2.0]) == pytest.approx([1.0, 0.0])   # ReLU cuts a skewed client
    assert disco_weights([30, 10], [9.0, 9.0]) == pytest.approx([0.75, 0.25])  # all cut: FedAvg's shares
    with pytest.raises(ValueError, match="metric"):
        disco_discrepancy([1, 2], "l1")
    m = FedDisco(a=0.5, b=0.1)
    replies = {"0": Reply(payload={"discrepancy": 0.0}, num_examples=30),
               "1": Reply(payload={"discrepancy": 0.5}, num_examples=10)}
    assert m.client_weights(replies) == pytest.approx([0.85 / 0.95, 0.1 / 0.95])


@pytest.mark.parametrize("method", ["fedyogi", "fedadagrad", "feddisco"])
def test_runs(tiny_fl, method):
    tiny_fl["methods"] = [{"name": method}]
    out = run_experiment(resolve_config(tiny_fl))
    s = out["summaries"][method]
    assert s["rounds"] == 2 and s["final"]["global_test"]["accuracy"]["mean"] >= 0
    if method == "feddisco":   # the histogram never leaves: one scalar beside the model
        assert s["privacy"]["private"] is False
