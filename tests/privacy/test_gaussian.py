"""medfl.privacy.gaussian: clipping (eq. 12) and Gaussian noise (eq. 13) of a model update."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2
from scipy.stats import norm as normal

from medfl.privacy.accounting import PrivacyConfigError
from medfl.privacy.gaussian import add_noise, clip_update, global_norm, noise_generator
from medfl.privacy.noise import gaussian

KEYS = ["conv.weight", "conv.bias", "fc.weight"]
TAIL = 1e-6  # two-sided probability of a false failure of each statistical check


def _update(scale: float = 1.0, dtype: torch.dtype = torch.float32, seed: int = 0
            ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": (torch.randn(8, 3, 3, 3, generator=g) * scale).to(dtype),
        "conv.bias": (torch.randn(8, generator=g) * scale).to(dtype),
        "fc.weight": (torch.randn(10, 72, generator=g) * scale).to(dtype),
        "bn.num_batches_tracked": torch.tensor(7),
        "bn.running_mean": torch.randn(8, generator=g),
    }


def _flat(update: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([update[k].reshape(-1).double() for k in keys])


# --- global_norm ------------------------------------------------------------------------------

def test_global_norm_is_the_norm_of_the_concatenation():
    update = _update()
    assert global_norm(update, KEYS) == pytest.approx(float(_flat(update, KEYS).norm()), rel=1e-12)


def test_global_norm_accumulates_in_float64():
    # 300^2 * 4 overflows float16 (max 65504); the float64 accumulation does not.
    update = {"w": torch.full((4,), 300.0, dtype=torch.float16)}
    assert global_norm(update, ["w"]) == 600.0


def test_global_norm_of_nothing_is_zero():
    assert global_norm(_update(), []) == 0.0
    assert global_norm({"w": torch.empty(0, 3)}, ["w"]) == 0.0


def test_global_norm_refuses_bad_keys():
    update = _update()
    with pytest.raises(KeyError, match="missing"):
        global_norm(update, ["missing"])
    with pytest.raises(ValueError, match="floating-point"):
        global_norm(update, ["bn.num_batches_tracked"])
    with pytest.raises(ValueError, match="repeat"):
        global_norm(update, ["conv.bias", "conv.bias"])


# --- clip_update ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [1e-3, 0.5, 2.0, 30.0])
def test_clip_bounds_the_norm(dtype, clip):
    update = _update(scale=10.0, dtype=dtype)
    norm_before = global_norm(update, KEYS)
    assert norm_before > clip
    clipped, reported = clip_update(update, clip, KEYS)
    assert reported == norm_before
    after = global_norm(clipped, KEYS)
    assert after <= clip * (1 + 1e-6)
    assert after == pytest.approx(clip, rel=1e-6)
    for key in KEYS:
        assert clipped[key].dtype == dtype and clipped[key].shape == update[key].shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clip_keeps_low_precision_dtypes(dtype):
    update = _update(scale=10.0, dtype=dtype)
    clipped, _ = clip_update(update, 1.0, KEYS)
    eps = torch.finfo(dtype).eps
    assert global_norm(clipped, KEYS) == pytest.approx(1.0, rel=eps)
    assert all(clipped[k].dtype == dtype for k in KEYS)


def test_clip_keeps_the_direction():
    update = _update(scale=5.0, dtype=torch.float64)
    norm_before = global_norm(update, KEYS)
    clipped, _ = clip_update(update, 1.0, KEYS)
    before, after = _flat(update, KEYS), _flat(clipped, KEYS)
    torch.testing.assert_close(after, before / norm_before, rtol=1e-12, atol=0)
    assert float(torch.nn.functional.cosine_similarity(before, after, dim=0)) == \
        pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_clip_leaves_small_updates_equal(dtype):
    update = _update(scale=0.01, dtype=dtype)
    norm_before = global_norm(update, KEYS)
    clipped, reported = clip_update(update, norm_before * 1.5, KEYS)
    assert reported == norm_before
    for key in KEYS:
        assert torch.equal(clipped[key], update[key])
        assert clipped[key] is not update[key]
    # exactly at the bound: still unchanged
    at_bound, _ = clip_update(update, norm_before, KEYS)
    assert all(torch.equal(at_bound[k], update[k]) for k in KEYS)


def test_clip_passes_other_keys_through_and_never_modifies_input():
    update = _update(scale=10.0)
    snapshot = {k: v.clone() for k, v in update.items()}
    clipped, _ = clip_update(update, 1.0, KEYS)
    assert clipped["bn.num_batches_tracked"] is update["bn.num_batches_tracked"]
    assert clipped["bn.running_mean"] is update["bn.running_mean"]
    assert set(clipped) == set(update)
    for key, value in snapshot.items():
        assert torch.equal(update[key], value)
    assert not torch.equal(clipped["fc.weight"], update["fc.weight"])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clip_refuses_a_non_finite_update(bad):
    update = _update()
    update["conv.bias"][3] = bad
    with pytest.raises(ValueError, match="norm .* is (nan|inf)"):
        clip_update(update, 1.0, KEYS)


@pytest.mark.parametrize("clip", [0, -1.0, math.nan, math.inf, True, None])
def test_clip_refuses_a_bad_bound(clip):
    with pytest.raises(PrivacyConfigError, match="clip must be a finite number > 0"):
        clip_update(_update(), clip, KEYS)


# --- add_noise --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,std", [(torch.float32, 0.7), (torch.float64, 2.5),
                                       (torch.float32, 1e-3)])
def test_noise_has_the_stated_distribution(dtype, std):
    shapes = {"a": (400, 300), "b": (100_000,), "c": (5, 7, 11)}
    base = {k: torch.linspace(-3, 3, math.prod(s), dtype=dtype).reshape(s)
            for k, s in shapes.items()}
    noised = add_noise(base, std, list(shapes), noise_generator(20240917))
    noise = torch.cat([(noised[k].double() - base[k].double()).reshape(-1) for k in shapes])
    n = noise.numel()
    assert n >= 200_000
    # known mean 0: n * s^2 / std^2 ~ chi2(n)
    stat = float((noise**2).sum()) / std**2
    lo, hi = chi2.ppf(TAIL / 2, n), chi2.ppf(1 - TAIL / 2, n)
    assert lo <= stat <= hi, (stat / n, lo / n, hi / n)
    z = normal.ppf(1 - TAIL / 2)
    assert abs(float(noise.mean())) <= z * std / math.sqrt(n)


def test_noise_is_the_documented_draw_sequence():
    # The cross-process contract: medfl.privacy.noise.gaussian of each listed tensor, in key
    # order, from a generator seeded with seed % 2**63, cast to float32 (float64 for float64
    # tensors). (Until issue 48 it was torch.randn: the draws changed, the contract did not.)
    update = {"x": torch.zeros(3, 4), "y": torch.zeros(5, dtype=torch.float64),
              "z": torch.zeros(2, 2)}
    seed, std = 77, 0.3
    noised = add_noise(update, std, ["z", "x", "y"], noise_generator(seed))
    g = torch.Generator().manual_seed(seed)
    expected_z = gaussian((2, 2), std, g)
    expected_x = gaussian((3, 4), std, g)
    expected_y = gaussian((5,), std, g, dtype=torch.float64)
    assert torch.equal(noised["z"], expected_z)
    assert torch.equal(noised["x"], expected_x)
    assert torch.equal(noised["y"], expected_y)


def test_same_seed_same_noise_different_seed_different_noise():
    update = _update()
    first = add_noise(update, 0.5, KEYS, noise_generator(3))
    again = add_noise(update, 0.5, KEYS, noise_generator(3))
    other = add_noise(update, 0.5, KEYS, noise_generator(4))
    for key in KEYS:
        assert torch.equal(first[key], again[key])
        assert not torch.equal(first[key], other[key])
        assert not torch.equal(first[key], update[key])


def test_noise_depends_on_key_order():
    update = {"a": torch.zeros(10), "b": torch.zeros(10)}
    ab = add_noise(update, 1.0, ["a", "b"], noise_generator(9))
    ba = add_noise(update, 1.0, ["b", "a"], noise_generator(9))
    assert torch.equal(ab["a"], ba["b"]) and torch.equal(ab["b"], ba["a"])
    assert not torch.equal(ab["a"], ba["a"])


def test_noise_passes_other_keys_through_and_never_modifies_input():
    update = _update()
    snapshot = {k: v.clone() for k, v in update.items()}
    noised = add_noise(update, 1.0, KEYS, noise_generator(0))
    assert noised["bn.num_batches_tracked"] is update["bn.num_batches_tracked"]
    assert noised["bn.running_mean"] is update["bn.running_mean"]
    for key, value in snapshot.items():
        assert torch.equal(update[key], value)


def test_zero_noise_returns_equal_copies():
    update = _update()
    noised = add_noise(update, 0.0, KEYS, noise_generator(0))
    for key in KEYS:
        assert torch.equal(noised[key], update[key])
        assert noised[key] is not update[key]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_noise_keeps_low_precision_dtypes(dtype):
    update = {"w": torch.zeros(1000, dtype=dtype)}
    noised = add_noise(update, 1.0, ["w"], noise_generator(1))
    assert noised["w"].dtype == dtype
    assert 0.8 < float(noised["w"].double().std()) < 1.2


@pytest.mark.parametrize("std", [-0.1, math.nan, math.inf, True, None])
def test_noise_refuses_a_bad_std(std):
    with pytest.raises(ValueError, match="std must be a finite number >= 0"):
        add_noise(_update(), std, KEYS, noise_generator(0))


def test_noise_refuses_integer_tensors():
    with pytest.raises(ValueError, match="floating-point"):
        add_noise(_update(), 1.0, ["bn.num_batches_tracked"], noise_generator(0))


# --- noise_generator --------------------------------------------------------------------------

def test_noise_generator_reduces_the_seed_modulo_2_63():
    for seed in (5, -5, 2**70 + 11):
        a = torch.randn(8, generator=noise_generator(seed))
        b = torch.randn(8, generator=noise_generator(seed % 2**63))
        assert torch.equal(a, b)
    assert not torch.equal(torch.randn(8, generator=noise_generator(5)),
                           torch.randn(8, generator=noise_generator(-5)))
    assert noise_generator(1).device.type == "cpu"


@pytest.mark.parametrize("seed", [True, 1.0, "1", None])
def test_noise_generator_refuses_non_int_seeds(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        noise_generator(seed)
