"""medfl.privacy.accounting: checked wrappers over Opacus's accountants."""

from __future__ import annotations

import math
import warnings

import pytest
from opacus.accountants import create_accountant
from scipy.optimize import brentq
from scipy.stats import norm

from medfl.privacy.accounting import (
    ACCOUNTANTS,
    PrivacyConfigError,
    check_accountant,
    check_budget,
    check_positive,
    epsilon_spent,
    noise_for_epsilon,
)

pytestmark = pytest.mark.filterwarnings("ignore:GDP accounting is experimental:UserWarning")

DELTA = 1e-5


def _opacus(history: list[tuple[float, float, int]], accountant: str) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        acc = create_accountant(mechanism=accountant)
        acc.history = list(history)
        return float(acc.get_epsilon(DELTA))


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Tight epsilon of a mu-GDP mechanism (Dong, Roth & Su, Cor. 2.13); test reference only."""
    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
    return brentq(excess, 0.0, 500.0)


# --- check_accountant -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ACCOUNTANTS)
def test_check_accountant_accepts_opacus_mechanisms(name):
    assert check_accountant(name, "here") == name


@pytest.mark.parametrize("name", ["moments", "RDP", "", None, 1])
def test_check_accountant_refuses_others(name):
    with pytest.raises(PrivacyConfigError) as err:
        check_accountant(name, "fl.dp")
    assert str(err.value) == f"fl.dp: accountant must be one of rdp, prv, gdp, got {name!r}"


def test_privacy_config_error_is_a_value_error():
    assert issubclass(PrivacyConfigError, ValueError)


# --- check_budget -----------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon", [None, 0.5, 8, 1e3])
def test_check_budget_accepts_valid(epsilon):
    assert check_budget(epsilon, 1e-5, 1000, "here") is None


def test_check_budget_message_names_population():
    with pytest.raises(PrivacyConfigError) as err:
        check_budget(1.0, 0.5, 4, "fl.filters[0] (dp_gaussian)", population_name="clients")
    assert str(err.value) == (
        "fl.filters[0] (dp_gaussian): delta=0.5 must be below 1/N = 0.25 (N = 4 clients)"
    )


@pytest.mark.parametrize("delta,population", [(0.01, 100), (0.02, 100), (1e-3, 1000)])
def test_check_budget_delta_must_be_below_one_over_n(delta, population):
    with pytest.raises(PrivacyConfigError, match=r"must be below 1/N .*samples\)"):
        check_budget(None, delta, population, "w")
    check_budget(None, 0.99 / population, population, "w")


@pytest.mark.parametrize("epsilon", [0, -1.0, math.inf, math.nan, True, "1"])
def test_check_budget_refuses_bad_epsilon(epsilon):
    with pytest.raises(PrivacyConfigError, match=r"^w: epsilon=.* must be a finite number > 0"):
        check_budget(epsilon, 1e-5, 10, "w")


@pytest.mark.parametrize("delta", [0, 0.0, 1, 1.5, -1e-5, math.nan, math.inf, True, None, "1e-5"])
def test_check_budget_refuses_bad_delta(delta):
    with pytest.raises(PrivacyConfigError, match=r"^w: delta=.* 0 < delta < 1"):
        check_budget(1.0, delta, 10, "w")


@pytest.mark.parametrize("population", [0, -3, 2.5, True])
def test_check_budget_refuses_bad_population(population):
    with pytest.raises(PrivacyConfigError, match="clients protected must be an int >= 1"):
        check_budget(1.0, 1e-5, population, "w", population_name="clients")


# --- check_positive ---------------------------------------------------------------------------

def test_check_positive_returns_float():
    value = check_positive(3, "clip", "w")
    assert value == 3.0 and isinstance(value, float)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "1", None])
def test_check_positive_refuses(value):
    with pytest.raises(PrivacyConfigError) as err:
        check_positive(value, "clip", "fl.dp")
    assert str(err.value) == f"fl.dp: clip must be a finite number > 0, got {value!r}"


# --- epsilon_spent ----------------------------------------------------------------------------

@pytest.mark.parametrize("accountant,history", [
    ("rdp", [(1.1, 0.01, 50), (0.8, 0.02, 20), (2.0, 1.0, 3)]),
    ("prv", [(1.1, 0.01, 50), (0.8, 0.02, 20), (2.0, 1.0, 3)]),
    ("rdp", [(1.0, 1.0, 10)]),
    ("prv", [(1.0, 1.0, 10)]),
    ("gdp", [(1.0, 0.01, 100)]),
    ("gdp", [(1.0, 1.0, 10)]),
])
def test_epsilon_spent_equals_opacus(accountant, history):
    eps = epsilon_spent(history, DELTA, accountant)
    assert isinstance(eps, float)
    assert eps == _opacus(history, accountant)
    assert 0 < eps < math.inf


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_epsilon_spent_nothing_released_is_zero(accountant):
    assert epsilon_spent([], DELTA, accountant) == 0.0
    assert epsilon_spent([(1.0, 0.1, 0), (0.0, 1.0, 0)], DELTA, accountant) == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_spent_ignores_zero_step_entries(accountant):
    history = [(1.2, 0.05, 30)]
    padded = [(0.0, 0.5, 0), (1.2, 0.05, 30), (3.0, 1.0, 0)]
    assert epsilon_spent(padded, DELTA, accountant) == epsilon_spent(history, DELTA, accountant)


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_epsilon_spent_without_noise_is_infinite(accountant):
    assert epsilon_spent([(1.0, 0.1, 5), (0.0, 0.1, 1)], DELTA, accountant) == math.inf


def test_epsilon_spent_is_monotone():
    base = epsilon_spent([(1.0, 0.1, 20)], DELTA)
    assert epsilon_spent([(1.0, 0.1, 40)], DELTA) > base  # more steps
    assert epsilon_spent([(2.0, 0.1, 20)], DELTA) < base  # more noise
    assert epsilon_spent([(1.0, 0.2, 20)], DELTA) > base  # larger sample rate
    assert epsilon_spent([(1.0, 0.1, 20)], 1e-3) < base  # larger delta


def test_epsilon_spent_gdp_merges_equal_entries_only():
    assert epsilon_spent([(1.0, 0.01, 60), (1.0, 0.01, 40)], DELTA, "gdp") == \
        _opacus([(1.0, 0.01, 100)], "gdp")
    with pytest.raises(PrivacyConfigError, match="gdp accountant supports one"):
        epsilon_spent([(1.0, 0.01, 60), (2.0, 0.01, 40)], DELTA, "gdp")


@pytest.mark.parametrize("steps,sigma", [(10, 1.0), (1, 0.8), (100, 2.0)])
def test_epsilon_spent_at_sample_rate_one_bounds_the_exact_gaussian(steps, sigma):
    # q = 1: `steps` Gaussian releases of sensitivity 1 are exactly mu-GDP, mu = sqrt(T)/sigma.
    exact = _exact_gaussian_epsilon(math.sqrt(steps) / sigma, DELTA)
    rdp = epsilon_spent([(sigma, 1.0, steps)], DELTA, "rdp")
    prv = epsilon_spent([(sigma, 1.0, steps)], DELTA, "prv")
    gdp = epsilon_spent([(sigma, 1.0, steps)], DELTA, "gdp")
    assert exact <= prv <= exact + 0.05  # PRV: numerically tight
    assert exact <= rdp <= exact * 1.2  # RDP: an upper bound, a little loose
    assert gdp >= exact  # GDP's CLT formula over-states mu at q = 1


def test_epsilon_spent_sample_rate_one_reference_numbers():
    history = [(1.0, 1.0, 10)]
    assert epsilon_spent(history, DELTA, "rdp") == pytest.approx(19.0536, abs=1e-3)
    assert epsilon_spent(history, DELTA, "prv") == pytest.approx(17.867, abs=1e-2)
    assert epsilon_spent(history, DELTA, "gdp") == pytest.approx(25.585, abs=1e-2)


def test_epsilon_spent_prv_at_sample_rate_one_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert math.isfinite(epsilon_spent([(1.0, 1.0, 10)], DELTA, "prv"))


@pytest.mark.parametrize("history,match", [
    ([(1.0, 0.1)], r"history\[0\] must be"),
    ([(-1.0, 0.1, 3)], "noise_multiplier must be a finite number >= 0"),
    ([(math.nan, 0.1, 3)], "noise_multiplier must be a finite number >= 0"),
    ([(1.0, 0.0, 3)], "sample_rate must be a number with 0 < q <= 1"),
    ([(1.0, 1.5, 3)], "sample_rate must be a number with 0 < q <= 1"),
    ([(1.0, 0.1, 2.5)], "steps must be an int >= 0"),
    ([(1.0, 0.1, -1)], "steps must be an int >= 0"),
    ([(1.0, 0.1, True)], "steps must be an int >= 0"),
    ("abc", "history must be a list"),
])
def test_epsilon_spent_refuses_bad_history(history, match):
    with pytest.raises(PrivacyConfigError, match=match):
        epsilon_spent(history, DELTA)


@pytest.mark.parametrize("delta", [0, 1, -0.1, math.nan, None])
def test_epsilon_spent_refuses_bad_delta(delta):
    with pytest.raises(PrivacyConfigError, match="delta"):
        epsilon_spent([(1.0, 0.1, 3)], delta)


def test_epsilon_spent_refuses_bad_accountant():
    with pytest.raises(PrivacyConfigError, match="accountant must be one of"):
        epsilon_spent([(1.0, 0.1, 3)], DELTA, "moments")


# --- noise_for_epsilon ------------------------------------------------------------------------

@pytest.mark.parametrize("accountant,epsilon,sample_rate,steps", [
    ("rdp", 5.0, 1.0, 10),
    ("prv", 5.0, 1.0, 10),
    ("rdp", 2.0, 1.0, 3),
    ("prv", 8.0, 1.0, 50),
    ("rdp", 3.0, 0.05, 100),
    ("gdp", 3.0, 1.0, 10),
])
def test_noise_for_epsilon_meets_the_target(accountant, epsilon, sample_rate, steps):
    sigma = noise_for_epsilon(epsilon, DELTA, sample_rate, steps, accountant)
    spent = epsilon_spent([(sigma, sample_rate, steps)], DELTA, accountant)
    assert sigma > 0
    assert spent <= epsilon
    assert epsilon - spent <= 0.01


def test_noise_for_epsilon_tolerance_is_honoured():
    sigma = noise_for_epsilon(4.0, DELTA, 1.0, 10, tolerance=0.5)
    spent = epsilon_spent([(sigma, 1.0, 10)], DELTA)
    assert 3.5 <= spent <= 4.0


def test_noise_for_epsilon_smaller_budget_needs_more_noise():
    assert noise_for_epsilon(2.0, DELTA, 1.0, 10) > noise_for_epsilon(8.0, DELTA, 1.0, 10)


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_noise_for_epsilon_zero_steps_needs_no_noise(accountant):
    assert noise_for_epsilon(1.0, DELTA, 0.1, 0, accountant) == 0.0


def test_noise_for_epsilon_budget_too_low_is_a_config_error():
    with pytest.raises(PrivacyConfigError) as err:
        noise_for_epsilon(0.001, DELTA, 0.01, 100)
    msg = str(err.value)
    for part in ("epsilon=0.001", "delta=1e-05", "steps=100", "sample_rate=0.01", "too low"):
        assert part in msg


@pytest.mark.parametrize("kwargs,match", [
    ({"epsilon": 0}, "epsilon must be a finite number > 0"),
    ({"epsilon": math.inf}, "epsilon must be a finite number > 0"),
    ({"delta": 1.0}, "delta"),
    ({"sample_rate": 0.0}, "sample_rate"),
    ({"sample_rate": 1.01}, "sample_rate"),
    ({"steps": -1}, "steps must be an int >= 0"),
    ({"steps": 2.0}, "steps must be an int >= 0"),
    ({"accountant": "moments"}, "accountant must be one of"),
    ({"tolerance": 0}, "tolerance must be a finite number > 0"),
])
def test_noise_for_epsilon_refuses_bad_arguments(kwargs, match):
    args = {"epsilon": 1.0, "delta": DELTA, "sample_rate": 0.1, "steps": 10} | kwargs
    with pytest.raises(PrivacyConfigError, match=match):
        noise_for_epsilon(**args)
