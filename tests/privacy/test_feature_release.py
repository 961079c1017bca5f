"""The DP release of per-sample features (FedTPF's shared set): clipping, the noise the
accountant gives, the recorded epsilon, Laplace's scale, bad budgets refused, and the
noise-to-signal comparison of x_s against x."""

from __future__ import annotations

import math

import pytest
import torch

from medfl.privacy.accounting import PrivacyConfigError, epsilon_spent, noise_for_epsilon
from medfl.privacy.feature_release import (
    noise_comparison, norm_quantile, perturb_features, release_features, release_noise, release_with_variance,
    variance_scale,
)

__all__: list[str] = []


def test_gaussian_release_clips_each_sample_and_records_the_accountants_epsilon() -> None:
    x_s = torch.zeros(4000, 2, 3, 3)
    x_s[:, 0, 0, 0] = 10.0                                  # norm 10, clipped to 2
    x_p, rel = release_features(x_s, epsilon=3.0, clip=2.0, delta=1e-5, generator=torch.Generator().manual_seed(0))
    z = noise_for_epsilon(3.0, 1e-5, 1.0, 1)
    assert rel.noise_multiplier == pytest.approx(z) and rel.noise_std == pytest.approx(2.0 * z)
    assert rel.epsilon == pytest.approx(epsilon_spent([(z, 1.0, 1)], 1e-5)) and rel.epsilon <= 3.0
    assert rel.clipped_fraction == 1.0 and rel.samples == 4000 and rel.unit == "sample"
    assert x_p.shape == x_s.shape
    assert x_p[:, 0, 0, 0].mean().item() == pytest.approx(2.0, abs=4 * rel.noise_std / math.sqrt(4000))
    assert x_p[:, 1].std().item() == pytest.approx(rel.noise_std, rel=0.05)
    again, _ = release_features(x_s, epsilon=3.0, clip=2.0, delta=1e-5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x_p, again)                            # seeded noise


def test_laplace_release_is_pure_dp_with_scale_clip_over_epsilon() -> None:
    x_s = torch.full((20000, 4), 0.1)                        # L1 norm 0.4 < clip: not clipped
    x_p, rel = release_features(x_s, epsilon=2.0, clip=1.0, mechanism="laplace",
                                generator=torch.Generator().manual_seed(1))
    assert rel.delta == 0.0 and rel.epsilon == 2.0 and rel.clipped_fraction == 0.0 and rel.accountant is None
    noise = (x_p - x_s).flatten()
    assert noise.abs().mean().item() == pytest.approx(0.5, rel=0.03)  # E|Laplace(b)| = b = clip / epsilon
    assert rel.noise_std == pytest.approx(0.5 * math.sqrt(2))


@pytest.mark.parametrize("kwargs, message", [
    ({"epsilon": 0}, "epsilon"), ({"epsilon": math.inf}, "epsilon must be a finite number > 0"), ({"clip": -1}, "clip"),
    ({"mechanism": "uniform"}, "mechanism must be one of gaussian, laplace"), ({"delta": 1.5}, "delta"),
])
def test_bad_budgets_release_nothing(kwargs, message) -> None:
    args = {"epsilon": 1.0, "clip": 1.0, **kwargs}
    with pytest.raises(PrivacyConfigError, match=message):
        release_features(torch.ones(3, 4), **args)
    with pytest.raises(PrivacyConfigError, match="NaN or infinite"):
        release_features(torch.tensor([[float("nan"), 1.0]]), epsilon=1.0, clip=1.0)


def test_noise_comparison_smaller_features_need_less_noise_for_the_same_budget() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200, 1, 8, 8, generator=g)
    x_s = 0.1 * (x - 0.5)
    out = noise_comparison(x, x_s, epsilon=5.0)
    assert out["x_s_noise_std"] < out["x_noise_std"] and out["x_s_clip"] < out["x_clip"]
    assert out["x_noise_std"] == pytest.approx(out["noise_multiplier"] * out["x_clip"])
    # the noise needed scales with the clip norm, so relative to its own signal it is alike
    assert out["x_s_noise_to_signal"] == pytest.approx(out["x_noise_to_signal"], rel=0.5)


def test_training_perturbation_matches_the_release_and_passes_gradients() -> None:
    """``perturb_features`` clips and noises as ``release_features`` does (the classifier is
    trained on what will be released), differentiably; ``release_noise`` is the release's
    per-coordinate noise (0 with the noise off)."""
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]], requires_grad=True)        # norms 5 and 0.5
    clipped = perturb_features(x, clip=1.0, noise=0.0)
    torch.testing.assert_close(clipped.detach(), torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    clipped.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    z = noise_for_epsilon(2.0, 1e-5, 1.0, 1, "rdp")
    assert release_noise(epsilon=2.0, clip=3.0, delta=1e-5) == pytest.approx(z * 3.0)
    assert release_noise(epsilon=2.0, clip=3.0, mechanism="laplace") == pytest.approx(1.5)
    assert release_noise(epsilon=None, clip=3.0) == 0.0
    big = torch.zeros(4000, 1)
    g = torch.Generator().manual_seed(0)
    noisy = perturb_features(big, clip=1.0, noise=0.5, generator=g)
    assert float(noisy.std()) == pytest.approx(0.5, rel=0.05)
    lap = perturb_features(big, clip=1.0, noise=0.5, mechanism="laplace", generator=g)
    assert float(lap.abs().mean()) == pytest.approx(0.5, rel=0.08)                  # E|Laplace(b)| = b


def test_the_papers_variance_noise_is_added_to_unclipped_features_and_has_no_epsilon() -> None:
    x_s = torch.zeros(5000, 2, 2)
    x_s[:, 0, 0] = 30.0                                                  # norm 30: no clip touches it
    x_p, rec = release_with_variance(x_s, variance=0.15, generator=torch.Generator().manual_seed(0))
    noise = (x_p - x_s).flatten(1)
    assert float(noise.var()) == pytest.approx(0.15, rel=0.03)
    assert float(x_p[:, 0, 0].mean()) == pytest.approx(30, abs=0.02)
    assert math.isinf(rec.epsilon) and math.isinf(rec.clip) and rec.noise_multiplier == 0.0
    assert rec.clipped_fraction == 0.0 and rec.noise_std == pytest.approx(math.sqrt(0.15))
    # the record's norms are those of the released tensors, measured independently here
    assert rec.signal_norm == pytest.approx(30.0)
    assert rec.noise_norm == pytest.approx(float(noise.norm(dim=1).mean()), rel=1e-6)
    assert rec.noise_to_signal == pytest.approx(rec.noise_norm / 30.0)
    lap, lrec = release_with_variance(x_s, variance=0.5, mechanism="laplace",
                                      generator=torch.Generator().manual_seed(1))
    assert float((lap - x_s).var()) == pytest.approx(0.5, rel=0.05) and lrec.mechanism == "laplace"
    assert variance_scale(0.5, "laplace") == pytest.approx(0.5) and variance_scale(0.16) == pytest.approx(0.4)
    with pytest.raises(PrivacyConfigError, match="variance must be a finite number > 0"):
        release_with_variance(x_s, variance=0.0)
    # the training perturbation without a clip: the same unclipped signal, noise of that variance
    again = perturb_features(x_s, clip=None, noise=math.sqrt(0.15), generator=torch.Generator().manual_seed(0))
    assert float(again[:, 0, 0].mean()) == pytest.approx(30, abs=0.02)
    assert float((again - x_s).var()) == pytest.approx(0.15, rel=0.03)


def test_a_dp_release_records_the_norms_of_its_clipped_signal_and_noise() -> None:
    x_s = torch.tensor([[3.0, 4.0], [0.3, 0.4]])                        # norms 5 and 0.5; clip 1 -> 1 and 0.5
    x_p, rec = release_features(x_s, epsilon=2.0, clip=1.0, generator=torch.Generator().manual_seed(3))
    clipped = torch.tensor([[0.6, 0.8], [0.3, 0.4]])
    assert rec.signal_norm == pytest.approx(0.75)
    assert rec.noise_norm == pytest.approx(float((x_p - clipped).norm(dim=1).mean()), rel=1e-5)
    assert rec.clipped_fraction == 0.5


def test_norm_quantile_is_a_clip_that_fits_the_features() -> None:
    norms = torch.tensor([1.0, 2.0, 3.0, 10.0])
    assert norm_quantile(norms, 0.5) == pytest.approx(2.5)               # between the 2nd and 3rd
    assert norm_quantile(norms, 1.0) == 10.0 and norm_quantile(norms, 0.25) == pytest.approx(1.75)
    with pytest.raises(PrivacyConfigError, match="quantile must be in"):
        norm_quantile(norms, 0.0)
    with pytest.raises(PrivacyConfigError, match="not a usable clip"):
        norm_quantile(torch.zeros(3), 0.5)
    with pytest.raises(PrivacyConfigError, match="no sample"):
        norm_quantile(torch.zeros(0), 0.5)
