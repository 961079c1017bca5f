"""Differential-privacy accounting: thin, checked wrappers over Opacus's accountants.

No epsilon formula is written here: :func:`epsilon_spent` and :func:`noise_for_epsilon` hand
the ``(noise_multiplier, sample_rate, steps)`` history to a fresh Opacus accountant
(``opacus.accountants.create_accountant``) and return what it says. This module only checks
the settings first, so a wrong value fails early with a message naming where it came from,
and turns the accountants' failures into :class:`PrivacyConfigError`.

Accountants (Opacus's ``mechanism`` names):

* ``"rdp"``: Rényi-DP of the subsampled Gaussian mechanism; an upper bound, the default.
* ``"prv"``: privacy random variables (numerical composition); tighter than ``rdp``.
* ``"gdp"``: Gaussian DP through the central limit theorem. Opacus marks it experimental: it
  is an approximation for small sample rates and many steps and can *underestimate* epsilon
  there. At ``sample_rate = 1.0`` its formula ``mu = sqrt(steps * (exp(1/sigma^2) - 1))`` is
  above the exact ``mu = sqrt(steps) / sigma``, so it over-states epsilon (safe, but loose:
  25.6 instead of 17.9 for sigma=1, 10 steps, delta=1e-5). It keeps one
  ``(noise_multiplier, sample_rate)`` pair only, so :func:`epsilon_spent` refuses a ``gdp``
  history that mixes several.

``sample_rate = 1.0`` (client-level DP: every release seen by the coordinator) is handled by
all three: ``rdp`` and ``prv`` give upper bounds close to the exact Gaussian-mechanism value
(``prv`` within about 0.01 of it).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import numpy as np

__all__ = [
    "ACCOUNTANTS",
    "PrivacyConfigError",
    "check_accountant",
    "check_budget",
    "check_delta",
    "check_positive",
    "epsilon_spent",
    "noise_for_epsilon",
]

ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv", "gdp")
"""The accountants Opacus's ``create_accountant`` builds (its ``mechanism`` argument)."""

# Opacus's accountants fail in several ways on extreme settings (a budget too low, a noise
# multiplier so small that PRV's discretisation or GDP's root finding breaks down).
_ACCOUNTANT_FAILURES = (ValueError, RuntimeError, OverflowError, ZeroDivisionError,
                        FloatingPointError)


class PrivacyConfigError(ValueError):
    """A privacy setting is invalid (epsilon, delta, clip, bits, accountant...)."""


def _is_number(value: Any) -> bool:
    """True for real numbers (Python or NumPy), False for bools and everything else."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    """True for integers (Python or NumPy), False for bools and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_accountant(name: str, where: str) -> str:
    """Check that ``name`` is an Opacus accountant this module can drive.

    Args:
        name: the accountant's mechanism name, one of :data:`ACCOUNTANTS`.
        where: a readable location for the error message, e.g. ``"fl.filters[0]"``.

    Returns:
        ``name``, unchanged.

    Raises:
        PrivacyConfigError: ``name`` is not one of ``rdp``, ``prv``, ``gdp``.
    """
    if not isinstance(name, str) or name not in ACCOUNTANTS:
        raise PrivacyConfigError(
            f"{where}: accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}"
        )
    return name


def check_budget(
    epsilon: float | None,
    delta: float,
    population: int,
    where: str,
    *,
    population_name: str = "samples",
) -> None:
    """Check a privacy budget ``(epsilon, delta)`` for ``population`` protected units.

    ``delta`` must be below ``1 / population``: a mechanism that publishes one unit's data
    outright with probability ``1 / population`` is ``(0, 1/population)``-DP, so a larger
    delta promises nothing.

    Args:
        epsilon: the target epsilon, or ``None`` when no epsilon is targeted (only reported).
            Otherwise a finite number > 0.
        delta: the target delta, a number with ``0 < delta < 1`` and ``delta < 1/population``.
        population: how many units are protected: a client's training samples for DP-SGD,
            the number of clients for client-level DP. An int >= 1.
        where: a readable location for the error messages, e.g.
            ``"fl.filters[0] (dp_gaussian)"``.
        population_name: what the units are called in messages (default ``"samples"``).

    Raises:
        PrivacyConfigError: one problem per error, naming ``where``, the value and what was
            expected.
    """
    if epsilon is not None:
        if not _is_number(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
            raise PrivacyConfigError(
                f"{where}: epsilon={epsilon!r} must be a finite number > 0 (or None for no "
                f"target)"
            )
    if not _is_int(population) or population < 1:
        raise PrivacyConfigError(
            f"{where}: the number of {population_name} protected must be an int >= 1, "
            f"got {population!r}"
        )
    if not _is_number(delta) or not math.isfinite(delta):
        raise PrivacyConfigError(f"{where}: delta={delta!r} must be a number with 0 < delta < 1")
    if not 0 < delta < 1:
        raise PrivacyConfigError(f"{where}: delta={delta!r} must satisfy 0 < delta < 1")
    if delta >= 1 / population:
        raise PrivacyConfigError(
            f"{where}: delta={delta!r} must be below 1/N = {1 / population:.6g} "
            f"(N = {population} {population_name})"
        )


def check_positive(value: Any, name: str, where: str) -> float:
    """Check that a setting (a clip norm, ``max_grad_norm``...) is a finite number > 0.

    Args:
        value: the setting.
        name: its name, for the message (e.g. ``"clip"``).
        where: a readable location for the message.

    Returns:
        ``value`` as a Python float.

    Raises:
        PrivacyConfigError: ``value`` is not a number (bools refused), not finite, or <= 0.
    """
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise PrivacyConfigError(f"{where}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_history(
    history: list[tuple[float, float, int]], where: str
) -> list[tuple[float, float, int]]:
    """Validate history entries; return them as ``(float, float, int)`` tuples."""
    if not isinstance(history, (list, tuple)):
        raise PrivacyConfigError(
            f"{where}: history must be a list of (noise_multiplier, sample_rate, steps), "
            f"got {type(history).__name__}"
        )
    entries = []
    for i, entry in enumerate(history):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise PrivacyConfigError(
                f"{where}: history[{i}] must be (noise_multiplier, sample_rate, steps), "
                f"got {entry!r}"
            )
        sigma, rate, steps = entry
        if not _is_number(sigma) or not math.isfinite(sigma) or sigma < 0:
            raise PrivacyConfigError(
                f"{where}: history[{i}] noise_multiplier must be a finite number >= 0, "
                f"got {sigma!r}"
            )
        if not _is_number(rate) or not 0 < rate <= 1:
            raise PrivacyConfigError(
                f"{where}: history[{i}] sample_rate must be a number with 0 < q <= 1, "
                f"got {rate!r}"
            )
        if not _is_int(steps) or steps < 0:
            raise PrivacyConfigError(
                f"{where}: history[{i}] steps must be an int >= 0, got {steps!r}"
            )
        entries.append((float(sigma), float(rate), int(steps)))
    return entries


def check_delta(delta: Any, where: str) -> float:
    """``delta`` as a float when it is a number with ``0 < delta < 1``.

    Raises:
        PrivacyConfigError: naming ``where`` and the value.
    """
    if not _is_number(delta) or not 0 < delta < 1:
        raise PrivacyConfigError(f"{where}: delta={delta!r} must be a number with 0 < delta < 1")
    return float(delta)


def _opacus_epsilon(entries: list[tuple[float, float, int]], delta: float, accountant: str
                    ) -> float:
    """Epsilon from a fresh Opacus accountant whose history is exactly ``entries``."""
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = list(entries)
    # At sample_rate 1.0 the PRV accountant takes log(1 - q) = -inf on purpose; NumPy's
    # divide-by-zero warning about it is noise, the result is right.
    with np.errstate(divide="ignore"):
        return float(acc.get_epsilon(delta))


def epsilon_spent(
    history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp"
) -> float:
    """The epsilon spent by a sequence of subsampled Gaussian releases, from Opacus.

    What it is for: reporting (and checking against a target) the privacy spent so far by
    DP-SGD steps or by noised client updates.

    Args:
        history: Opacus's format, a list of ``(noise_multiplier, sample_rate, steps)``:
            ``steps`` releases, each of a sum with sensitivity 1 plus Gaussian noise of std
            ``noise_multiplier``, on a Poisson sample of rate ``sample_rate`` (``1.0`` when
            every unit takes part, as in client-level DP). Entries are given to the
            accountant as they are (nothing is merged), except that entries with 0 steps are
            dropped and, for ``gdp`` only, equal ``(noise_multiplier, sample_rate)`` entries
            are summed into one (what Opacus's own ``GaussianAccountant.step`` records).
        delta: the target delta, ``0 < delta < 1``.
        accountant: ``"rdp"`` (default), ``"prv"`` or ``"gdp"``.

    Returns:
        The epsilon Opacus's accountant gives for this history at ``delta``, as a float;
        ``0.0`` when the history is empty or all its steps are 0; ``math.inf`` when an entry
        has ``noise_multiplier == 0`` and steps > 0 (no noise: no guarantee).

    Raises:
        PrivacyConfigError: an unknown accountant; a malformed entry (noise multiplier not a
            finite number >= 0, sample rate outside ``(0, 1]``, steps not an int >= 0);
            ``delta`` outside ``(0, 1)``; a ``gdp`` history with several different
            ``(noise_multiplier, sample_rate)`` pairs (Opacus's GDP accountant would read the
            last one only); or the accountant failing on these values.
    """
    where = "epsilon_spent"
    check_accountant(accountant, where)
    entries = [e for e in _check_history(history, where) if e[2] > 0]
    delta = check_delta(delta, where)
    if not entries:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in entries):
        return math.inf
    if accountant == "gdp":
        pairs = {(sigma, rate) for sigma, rate, _ in entries}
        if len(pairs) > 1:
            raise PrivacyConfigError(
                f"{where}: the gdp accountant supports one (noise_multiplier, sample_rate) "
                f"pair only (Opacus's GaussianAccountant reads the last entry and would ignore "
                f"the others); got {sorted(pairs)}; use accountant 'rdp' or 'prv'"
            )
        sigma, rate = pairs.pop()
        entries = [(sigma, rate, sum(steps for _, _, steps in entries))]
    try:
        eps = _opacus_epsilon(entries, delta, accountant)
    except _ACCOUNTANT_FAILURES as exc:
        raise PrivacyConfigError(
            f"{where}: Opacus's {accountant} accountant could not compute epsilon for "
            f"history {entries} at delta={delta!r}: {exc}"
        ) from exc
    if math.isnan(eps) or eps < 0:
        raise PrivacyConfigError(
            f"{where}: Opacus's {accountant} accountant returned epsilon={eps!r} for "
            f"history {entries} at delta={delta!r}"
        )
    return eps


def noise_for_epsilon(
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
) -> float:
    """The noise multiplier that spends at most ``epsilon`` over ``steps`` releases.

    A bisection by Opacus (``opacus.accountants.utils.get_noise_multiplier``). What it is for:
    choosing DP-SGD's or a client-level mechanism's noise from a target budget.

    Guarantee: with ``sigma`` the result, ``e = epsilon_spent([(sigma, sample_rate, steps)],
    delta, accountant)`` satisfies ``e <= epsilon`` and ``epsilon - e <= tolerance``.

    Args:
        epsilon: the target epsilon, a finite number > 0.
        delta: the target delta, ``0 < delta < 1``.
        sample_rate: the Poisson sampling rate of each release, ``0 < q <= 1`` (``1.0`` for
            client-level DP).
        steps: how many releases, an int >= 0.
        accountant: ``"rdp"`` (default), ``"prv"`` or ``"gdp"``.
        tolerance: how far below ``epsilon`` the bisection may stop (default 0.01), > 0.

    Returns:
        The noise multiplier (noise std / sensitivity); ``0.0`` when ``steps == 0`` (nothing
        is released, no noise needed).

    Raises:
        PrivacyConfigError: an invalid argument, or no noise multiplier (below Opacus's
            limit of 1e6) reaches the budget, or the accountant failing on these values.
    """
    where = "noise_for_epsilon"
    check_accountant(accountant, where)
    check_positive(epsilon, "epsilon", where)
    delta = check_delta(delta, where)
    if not _is_number(sample_rate) or not 0 < sample_rate <= 1:
        raise PrivacyConfigError(
            f"{where}: sample_rate must be a number with 0 < q <= 1, got {sample_rate!r}"
        )
    if not _is_int(steps) or steps < 0:
        raise PrivacyConfigError(f"{where}: steps must be an int >= 0, got {steps!r}")
    check_positive(tolerance, "tolerance", where)
    if steps == 0:
        return 0.0
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with np.errstate(divide="ignore"), warnings.catch_warnings():
            # The bisection's first probes (sigma = 20, 40...) make Opacus's RDP accountant
            # warn that its largest order was optimal; those probes are not the answer.
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            sigma = get_noise_multiplier(
                target_epsilon=float(epsilon),
                target_delta=delta,
                sample_rate=float(sample_rate),
                steps=int(steps),
                accountant=accountant,
                epsilon_tolerance=float(tolerance),
            )
    except _ACCOUNTANT_FAILURES as exc:
        reason = str(exc)
        if "budget is too low" in reason:
            reason = "the budget is too low: even a noise multiplier of 1e6 spends more"
        raise PrivacyConfigError(
            f"{where}: no noise multiplier reaches epsilon={epsilon!r} at delta={delta!r} "
            f"over steps={steps} with sample_rate={sample_rate!r} ({accountant} accountant): "
            f"{reason}"
        ) from exc
    return float(sigma)
