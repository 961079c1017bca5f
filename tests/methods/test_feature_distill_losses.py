"""FedTPF's distillation-model terms by hand on small tensors: prototypes (eq. 5), the
prototype pull (eq. 6), the VAE loss, WGAN-GP's penalty and losses, the decay weights of
eqs. 8-9 over a scripted accuracy sequence (eq. 8 as printed and as its prose reads), and the
stop condition's criteria by code."""

from __future__ import annotations

import math

import pytest
import torch

from medfl.losses.feature_distill import (
    STOP_CRITERIA, class_prototypes, critic_loss, decay_weights, distillation_converged, generator_adversarial_loss,
    gradient_penalty, performance_change, prototype_loss, residual_cosine, stop_condition_check, vae_loss,
)

__all__: list[str] = []


def test_prototypes_are_class_means_and_absent_classes_are_masked() -> None:
    emb = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    protos, present = class_prototypes(emb, torch.tensor([0, 0, 2]), 3)
    assert torch.equal(protos, torch.tensor([[2.0, 1.0], [0.0, 0.0], [0.0, 4.0]]))
    assert present.tolist() == [True, False, True]


def test_prototype_loss_is_the_mean_squared_distance_to_the_own_class_prototype() -> None:
    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    z = torch.tensor([[1.0, 2.0], [1.0, 1.0], [3.0, 3.0]], requires_grad=True)
    loss = prototype_loss(z, torch.tensor([0, 1, 1]), protos)
    assert loss.item() == pytest.approx((5 + 0 + 8) / 3)
    loss.backward()
    assert torch.allclose(z.grad, 2 * torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, 2.0]]) / 3)
    masked = prototype_loss(z, torch.tensor([0, 1, 1]), protos, torch.tensor([True, False]))
    assert masked.item() == pytest.approx(5.0)  # class 1 has no prototype at this client
    assert prototype_loss(z, torch.tensor([1, 1, 1]), protos, torch.tensor([True, False])).item() == 0.0


def test_vae_loss_is_reconstruction_plus_kl() -> None:
    x = torch.zeros(2, 1, 2, 2)
    x_hat = torch.ones(2, 1, 2, 2) * 0.5          # recon 4 * 0.25 = 1 per sample
    mu = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    logvar = torch.tensor([[0.0, 0.0], [math.log(2.0), 0.0]])
    kl = torch.tensor([0.5 * 1.0, -0.5 * (1 + math.log(2.0) - 2.0)])  # per sample
    assert vae_loss(x, x_hat, mu, logvar).item() == pytest.approx(1.0 + kl.mean().item())
    assert vae_loss(x, x_hat, mu, logvar, beta=0.0).item() == pytest.approx(1.0)


def test_gradient_penalty_of_a_linear_critic_by_hand() -> None:
    w = torch.tensor([3.0, 4.0])                   # ||grad|| = 5 everywhere
    critic = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        critic.weight.copy_(w.unsqueeze(0))
    real, fake = torch.randn(4, 2), torch.randn(4, 2)
    gp = gradient_penalty(critic, real, fake, torch.Generator().manual_seed(0))
    assert gp.item() == pytest.approx((5 - 1) ** 2)
    gp.backward()                                   # d/dw (||w|| - 1)^2 = 2 (||w|| - 1) w / ||w||
    assert torch.allclose(critic.weight.grad, 2 * 4 * w.unsqueeze(0) / 5)
    critic.zero_grad()
    loss = critic_loss(critic, real, fake, gp_weight=10.0, generator=torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx((critic(fake).mean() - critic(real).mean()).item() + 160.0, rel=1e-5)
    assert generator_adversarial_loss(critic, fake).item() == pytest.approx(-critic(fake).mean().item())


def test_decay_weights_over_a_scripted_accuracy_sequence() -> None:
    # clients a and b stop distilling at rounds 2 and 4; c keeps distilling
    stopped = {"a": 2, "b": 4, "c": None}
    acc = {1: {"b": 0.50, "c": 0.40}, 2: {"b": 0.60, "c": 0.46}, 3: {"b": 0.62, "c": 0.50}, 4: {"c": 0.49}}
    lam = 5.0
    expected = {2: {"a": math.exp(-lam * 0.08), "b": 1.0, "c": 1.0},   # delta = mean(0.10, 0.06)
                3: {"a": math.exp(-lam * 0.03), "b": 1.0, "c": 1.0},   # delta = mean(0.02, 0.04)
                4: {"a": 1.0, "b": 1.0, "c": 1.0}}                      # delta = -0.01 -> max(0, .) = 0
    for t in (2, 3, 4):
        distilling = [k for k, s in stopped.items() if s is None or t <= s]
        delta = performance_change(acc[t], acc[t - 1], [k for k in distilling if k != "a"])
        got = decay_weights(stopped, t, delta, lam)
        assert got == pytest.approx(expected[t]), t
    assert performance_change({"a": float("nan")}, {"a": 0.1}, ["a"]) == 0.0


def test_decay_weights_as_the_prose_reads_accumulate_from_the_stop_round() -> None:
    """Prose: alpha_k(t) = exp(-lam * sum_{tau = t_s..t} (1 - min(1, |Delta(tau)|))): a large
    change slows the decay, a stable accuracy speeds it up, and it accumulates."""
    stopped = {"a": 2, "b": 4, "c": None}
    history = {1: 0.3, 2: 0.08, 3: -0.5, 4: 0.0, 5: 1.7}
    lam = 2.0
    by_hand = {
        1: {"a": 1.0, "b": 1.0, "c": 1.0},
        2: {"a": math.exp(-2.0 * 0.92), "b": 1.0, "c": 1.0},                       # 1 - 0.08
        3: {"a": math.exp(-2.0 * (0.92 + 0.5)), "b": 1.0, "c": 1.0},               # |-0.5| counts as a change
        4: {"a": math.exp(-2.0 * (0.92 + 0.5 + 1.0)), "b": math.exp(-2.0 * 1.0), "c": 1.0},   # no change: full rate
        5: {"a": math.exp(-2.0 * 2.42), "b": math.exp(-2.0 * 1.0), "c": 1.0},      # |1.7| >= 1: no decay that round
    }
    for t, want in by_hand.items():
        got = decay_weights(stopped, t, history.get(t, 0.0), lam, reading="prose", history=history)
        assert got == pytest.approx(want), t
    # the printed form at the same rounds: exp(-lam * max(0, Delta(t))), not cumulative
    assert decay_weights(stopped, 4, history[4], lam) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert decay_weights(stopped, 2, history[2], lam)["a"] == pytest.approx(math.exp(-2.0 * 0.08))
    assert decay_weights(stopped, 3, history[3], lam)["a"] == 1.0
    # a round missing from the history adds nothing
    got = decay_weights({"a": 1}, 3, 0.0, 1.0, reading="prose", history={3: 0.5})
    assert got == {"a": pytest.approx(math.exp(-0.5))}
    with pytest.raises(ValueError, match="reading must be one of printed, prose, got 'both'"):
        decay_weights(stopped, 2, 0.1, 1.0, reading="both")


def test_residual_cosine_by_hand() -> None:
    x_r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    x_s = torch.tensor([[0.0, 2.0], [2.0, 2.0]])
    assert residual_cosine(x_r, x_s) == pytest.approx(0.5)  # (0 + 1) / 2


@pytest.mark.parametrize("accuracy, cosine, expected", [
    ([0.91, 0.90, 0.92], [0.10, 0.12, 0.11], (True, "met")),
    ([0.91, 0.92], [0.1, 0.1], (False, "fewer than 3 evaluations")),
    ([0.5, 0.91, 0.87, 0.90], [0.1, 0.1, 0.1, 0.1], (False, "residual accuracy 0.870 < 0.880")),
    ([0.90, 0.91, 0.92], [0.10, 0.15, 0.10], (False, "|cosine(x_r, x_s)| 0.150 >= 0.15")),
    ([0.88, 0.99, 0.95], [0.1, 0.1, 0.1], (False, "accuracy moved 0.110 > 0.05 over 3 evaluations")),
    ([0.9, 0.9, 0.9], [0.01, 0.14, 0.05], (False, "cosine moved 0.130 > 0.05 over 3 evaluations")),
])
def test_stop_condition_names_the_criterion_not_met(accuracy, cosine, expected) -> None:
    assert distillation_converged(accuracy, cosine) == expected
    assert distillation_converged([0.7] * 3, [0.1] * 3, target=0.7)[0]  # configurable


@pytest.mark.parametrize("accuracy, cosine, code", [
    ([0.91, 0.90, 0.92], [0.10, 0.12, 0.11], 0), ([0.91, 0.92], [0.1, 0.1], 1),
    ([0.5, 0.91, 0.87, 0.90], [0.1] * 4, 2), ([0.90, 0.91, 0.92], [0.10, 0.15, 0.10], 3),
    ([0.88, 0.99, 0.95], [0.1] * 3, 4), ([0.9, 0.9, 0.9], [0.01, 0.14, 0.05], 5),
])
def test_stop_condition_check_codes_the_first_criterion_not_met(accuracy, cosine, code) -> None:
    got, reason = stop_condition_check(accuracy, cosine)
    assert got == code and (reason == "met") == (code == 0)
    assert STOP_CRITERIA[0] == "met" and len(STOP_CRITERIA) == 6
