"""What a run with differential privacy may send in the clear, only with an opt-in: every
client's evaluation model for ``cross_test`` (``fl.cross_test``) and the reply entries beside
a noised model that no mechanism covers (``fl.uncovered_entries``)."""

from __future__ import annotations

from typing import Any

from medfl.config_values import ConfigError, optional_section
from medfl.messages import RELEASE_FLAG
from medfl.plugins import PluginError, lookup

__all__ = ["CROSS_TEST_DEFAULTS", "CROSS_TEST_UNDER_DP", "CROSS_TEST_IN_CLEAR", "check_cross_test",
           "cross_test_in_clear", "UNCOVERED_DEFAULTS", "UNCOVERED_UNDER_DP", "check_uncovered_entries",
           "uncovered_keys", "uncovered_in_clear"]


#: The keys of ``fl.cross_test`` and their defaults (:func:`check_cross_test`).
CROSS_TEST_DEFAULTS: dict[str, Any] = {"under_dp": "refuse"}

#: The values of ``fl.cross_test.under_dp``: ``"refuse"`` (the default: a run with differential
#: privacy and ``cross_test`` is refused before round 1) or ``"send_models"`` (every client's
#: evaluation model is sent in the clear for cross-site scoring, and the run's privacy record
#: says it is not private).
CROSS_TEST_UNDER_DP = ("refuse", "send_models")

#: What a private run with the opt-in sends in the clear (``sent_in_clear`` and ``not_covered``
#: in ``config.json``'s and ``summary.json``'s privacy blocks).
CROSS_TEST_IN_CLEAR = "cross_test: every site's personalised model, sent in the clear"


def check_cross_test(value: Any, where: str = "fl.cross_test") -> dict[str, Any] | None:
    """Check a ``cross_test`` section: ``None``, or a dict of :data:`CROSS_TEST_DEFAULTS`' keys.

    Raises:
        ConfigError: not a dict, an unknown key, or ``under_dp`` not one of :data:`CROSS_TEST_UNDER_DP`.
    """
    return _under_dp_section(value, CROSS_TEST_DEFAULTS, CROSS_TEST_UNDER_DP, where)


def _under_dp_section(value: Any, defaults: dict[str, Any], choices: tuple[str, ...], where: str
                      ) -> dict[str, Any] | None:
    """An opt-in section ``{"under_dp": CHOICE}`` (``None``: off), its ``under_dp`` one of ``choices``.

    Raises:
        ConfigError: not a dict, an unknown key, or ``under_dp`` not one of ``choices``.
    """
    out = optional_section(value, defaults, where, f'{{"under_dp": "{choices[-1]}"}}')
    if out is not None and out["under_dp"] not in choices:
        raise ConfigError(f"{where}.under_dp: expected one of {', '.join(map(repr, choices))}, got {out['under_dp']!r}")
    return out


def cross_test_in_clear(cfg: dict[str, Any], private: bool, where: str, refuse: bool = True) -> bool:
    """Whether a run of ``cfg`` sends its clients' evaluation models in the clear for
    ``cross_test`` while its privacy plan is ``private`` (a DP filter, DP-SGD or a method's
    own release): only with the opt-in ``fl.cross_test: {"under_dp": "send_models"}``.

    ``cross_test`` scores each client's evaluation model (its personalised model, private
    keys included) on every other client's test split, so every model leaves its site
    unfiltered; no epsilon covers it. ``refuse=False`` (a run reopened from its saved
    config: a resume, ``medfl predict``) says whether the models are sent, opt-in or not (a
    run from before the refusal sent them too).

    Raises:
        ConfigError: a private run with ``cross_test`` and no opt-in, naming ``where`` and the option.
    """
    if not private or "cross_test" not in cfg["eval_splits"]:
        return False
    if not refuse or (cfg.get("cross_test") or {}).get("under_dp") == "send_models":
        return True
    raise ConfigError(
        f"{where}: fl.eval_splits has cross_test, which sends every client's evaluation model (its personalised "
        "model, private keys included) to the coordinator and the other sites in the clear, outside this run's "
        "differential privacy; drop cross_test from fl.eval_splits, or opt in with "
        "fl.cross_test {\"under_dp\": \"send_models\"} (the run's privacy record then says it is not private)")


#: The keys of ``fl.uncovered_entries`` and their defaults (:func:`check_uncovered_entries`).
UNCOVERED_DEFAULTS: dict[str, Any] = {"under_dp": "refuse"}

#: The values of ``fl.uncovered_entries.under_dp``: ``"refuse"`` (the default: a run whose model
#: is noised, by a DP filter, DP-SGD or the method's own DP, and whose replies carry entries
#: beside the model that no mechanism covers is refused before anything is sent) or
#: ``"send_in_clear"`` (the entries are sent, and the run's privacy record says it is not private).
UNCOVERED_UNDER_DP = ("refuse", "send_in_clear")


def check_uncovered_entries(value: Any, where: str = "fl.uncovered_entries") -> dict[str, Any] | None:
    """Check an ``uncovered_entries`` section: ``None``, or a dict of :data:`UNCOVERED_DEFAULTS`' keys.

    Raises:
        ConfigError: not a dict, an unknown key, or ``under_dp`` not one of :data:`UNCOVERED_UNDER_DP`.
    """
    return _under_dp_section(value, UNCOVERED_DEFAULTS, UNCOVERED_UNDER_DP, where)


def uncovered_keys(method: Any, instruction: Any) -> list[str]:
    """The keys of a reply to ``instruction`` (``Method.reply_keys``, the method's own
    declaration) beside its model state (``reply_state``), which a DP filter, DP-SGD or the
    method's own DP on the model does not cover; none for a per-sample release (its labels
    are the release's declared clear part). An instruction the method cannot answer from its
    settings alone (``reply_keys`` raises) counts as the model state's keys."""
    if instruction.config.get(RELEASE_FLAG) is True:
        return []
    try:
        keys = set(method.reply_keys(instruction))
    except (KeyError, TypeError, ValueError, AttributeError):
        return []
    return sorted(keys - set(type(method).reply_state))


def uncovered_in_clear(cfg: dict[str, Any], keys: list[str], method: str, where: str) -> str:
    """What a run whose model is noised sends in the clear beside it: ``keys`` (from
    :func:`uncovered_keys`) as one ``sent_in_clear`` line, only with the opt-in
    ``fl.uncovered_entries: {"under_dp": "send_in_clear"}``.

    Raises:
        ConfigError: without the opt-in, naming the method, the keys and the option.
    """
    if (cfg.get("uncovered_entries") or {}).get("under_dp") == "send_in_clear":
        return f"reply entries {keys} of method {method!r}: beside its noised model, in the clear (no DP covers them)"
    raise ConfigError(
        f"{where}: method {method!r} replies {keys} beside its model state {sorted(_reply_state_of(method))} under "
        "differential privacy, and no mechanism covers them: the noise is on the model only, so they would leave the "
        "sites in the clear while the run records an epsilon. Declare them in the method's reply_state (a DP filter "
        "then clips and noises them with the model), drop them from the reply under DP, or opt in with "
        "fl.uncovered_entries {\"under_dp\": \"send_in_clear\"} (the run's privacy record then says it is not "
        "private)")


def _reply_state_of(method: str) -> list[str]:
    try:
        return list(lookup("method", method).reply_state)
    except PluginError:   # only for the message
        return []
