"""medfl.privacy.noise: every Gaussian and Laplace draw is finite by construction, with the
right distribution, seeded; and every noise-drawing path of medfl uses it (issue 48, item 5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from medfl.models import small_cnn
from medfl.privacy import dp_sgd, noise
from medfl.privacy.feature_release import perturb_features, release_features
from medfl.privacy.gaussian import add_noise, noise_generator
from medfl.privacy.noise import GAUSSIAN_BOUND, LAPLACE_BOUND, gaussian, laplace

N = 10 ** 7


def _moments(x: torch.Tensor) -> tuple[float, float, float]:
    x = x.double()
    return float(x.mean()), float(x.var()), float(x.abs().mean())


def test_ten_million_gaussian_draws_are_finite_with_mean_zero_and_variance_std_squared() -> None:
    std = 2.5
    x = gaussian((N,), std, torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32 and x.shape == (N,)
    assert bool(torch.isfinite(x).all())
    assert float(x.abs().max()) <= GAUSSIAN_BOUND * std * (1 + 1e-6)
    mean, var, mean_abs = _moments(x)
    se = std / math.sqrt(N)                        # standard error of the mean
    assert abs(mean) < 5 * se
    assert var == pytest.approx(std ** 2, rel=5 * math.sqrt(2 / N))   # var of the sample variance: 2 s^4 / N
    assert mean_abs == pytest.approx(std * math.sqrt(2 / math.pi), rel=1e-3)
    # the tails: P(|x| > 3 std) = 0.0027 (binomial standard error 1.6e-5)
    assert float((x.abs() > 3 * std).double().mean()) == pytest.approx(0.0026998, abs=1e-4)


def test_ten_million_laplace_draws_are_finite_with_mean_zero_and_variance_two_b_squared() -> None:
    b = 0.7
    x = laplace((N,), b, torch.Generator().manual_seed(1))
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert float(x.abs().max()) <= LAPLACE_BOUND * b * (1 + 1e-6)
    mean, var, mean_abs = _moments(x)
    assert abs(mean) < 5 * b * math.sqrt(2 / N)
    assert var == pytest.approx(2 * b ** 2, rel=5 * math.sqrt(5 / N))   # Laplace kurtosis 6: var(s^2) = 5 s^4 / N
    assert mean_abs == pytest.approx(b, rel=5 / math.sqrt(N))           # E|x| = b, sd(|x|) = b
    # P(|x| > 3 b) = exp(-3)
    assert float((x.abs() > 3 * b).double().mean()) == pytest.approx(math.exp(-3), abs=2e-4)


@pytest.mark.parametrize("draw", [gaussian, laplace])
def test_same_seed_same_draws_and_shape_dtype_device(draw) -> None:
    a = draw((3, 4), 1.0, torch.Generator().manual_seed(5), dtype=torch.float64)
    b = draw((3, 4), 1.0, torch.Generator().manual_seed(5), dtype=torch.float64)
    c = draw((3, 4), 1.0, torch.Generator().manual_seed(6), dtype=torch.float64)
    assert a.shape == (3, 4) and a.dtype == torch.float64
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(draw((2,), 0.0, None), torch.zeros(2))
    assert draw((0, 3), 1.0, None).shape == (0, 3)


@pytest.mark.parametrize("draw", [gaussian, laplace])
def test_bad_scale_or_dtype_is_one_clear_error(draw) -> None:
    for bad in (-1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            draw((2,), bad, None)
    with pytest.raises(ValueError, match="floating-point dtype"):
        draw((2,), 1.0, None, dtype=torch.int64)
    with pytest.raises(ValueError, match="largest torch.float16"):
        draw((2,), 1e4, None, dtype=torch.float16)


@pytest.fixture
def extreme_uniforms(monkeypatch):
    """``torch.rand`` returning the ends of its range, 0 and the largest float below 1 (and
    1 itself, which it must never return): the draws that make an inverse-CDF Laplace (and a
    Box-Muller from ``log(u)``) infinite."""
    real = torch.rand

    def rand(*size, generator=None, dtype=None, device=None, **kw):
        out = real(*size, generator=generator, dtype=dtype, device=device, **kw)
        ends = torch.tensor([0.0, 1.0 - 2.0 ** -53, 1.0], dtype=torch.float64)
        return ends.to(out.dtype)[torch.arange(out.numel()) % 3].reshape(out.shape).to(out.device)

    monkeypatch.setattr(torch, "rand", rand)


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_per_sample_releases_stay_finite_when_rand_returns_its_extremes(extreme_uniforms, mechanism) -> None:
    # before issue 48: -inf (Laplace, rand() == 0 -> log1p(-1)) in FedTPF's distillation and
    # in every Laplace release
    x_s = torch.ones(6, 1, 2, 2)
    out = perturb_features(x_s, clip=1.0, noise=0.5, mechanism=mechanism, generator=torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(out).all())
    x_p, _ = release_features(x_s, epsilon=1.0, clip=1.0, mechanism=mechanism, generator=torch.Generator())
    assert bool(torch.isfinite(x_p).all())


def test_reply_filter_noise_stays_finite_when_rand_returns_its_extremes(extreme_uniforms) -> None:
    out = add_noise({"w": torch.zeros(30)}, 1.0, ["w"], noise_generator(3))
    assert bool(torch.isfinite(out["w"]).all())
    assert float(out["w"].abs().max()) <= GAUSSIAN_BOUND


def test_dp_sgd_draws_its_noise_from_medfl(monkeypatch) -> None:
    # Opacus draws with torch.normal; medfl's optimizer replaces that draw with noise.gaussian
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return noise.gaussian(*args, **kwargs)

    monkeypatch.setattr(dp_sgd, "gaussian", counted)
    monkeypatch.setattr(torch, "normal", None)   # Opacus's own draw would now fail
    torch.manual_seed(0)
    model = dp_sgd.make_private_model(small_cnn(width=4))[0]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4, 1, 16, 16, generator=g), torch.randint(0, 2, (4,), generator=g))
    dp_sgd.train_epochs_dp(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 1, batch_size=4,
                           noise_multiplier=1.5, max_grad_norm=0.5, seed=1)
    assert calls and all(std == pytest.approx(0.75) for std in calls)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
