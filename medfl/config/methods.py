"""A method entry of ``fl.methods``: its label, its preset, the method it builds, the
local-training settings it runs with, and the check of all of them together with its filters;
and what a run with differential privacy may send in the clear, only with an opt-in
(:data:`~medfl.config.sections.UNDER_DP`): every client's evaluation model for ``cross_test``
and the reply entries beside a noised model that no mechanism covers."""

from __future__ import annotations

import copy
from typing import Any

from medfl.config.defaults import DEFAULTS, TRAIN_OPTIONAL
from medfl.config.sections import check_dp_sgd, check_train
from medfl.config_values import ConfigError, check_keys
from medfl.filters import FilterConfigError, configured_filters
from medfl.messages import RELEASE_FLAG, Instruction
from medfl.method import Method, MethodConfigError
from medfl.plugins import lookup
from medfl.privacy.accounting import PrivacyConfigError

__all__ = ["ENTRY_KEYS", "method_label", "method_preset", "method_params", "build_method", "preset_record",
           "preset_origin", "preset_counts", "method_train", "check_entry", "CROSS_TEST_IN_CLEAR",
           "cross_test_in_clear", "uncovered_keys", "uncovered_in_clear"]


#: Keys of a method entry that are not the method's parameters: its run-directory name, its
#: own filter chain (replaces ``fl.filters``), overrides of ``fl.train`` for this method and
#: the name of one of the method's presets (:attr:`medfl.method.Method.presets`).
ENTRY_KEYS = ("name", "label", "filters", "train", "preset")


def method_label(spec: dict[str, Any]) -> str:
    """The run-directory name of a method entry (``label`` if given, else its name without a
    ``dist:`` qualifier: ``other:fedsdc`` runs in ``fedsdc/``)."""
    return str(spec.get("label") or str(spec["name"]).rsplit(":", 1)[-1])


def method_preset(spec: dict[str, Any]) -> Any:
    """The :class:`~medfl.method.Preset` a method entry names with ``preset`` (``None``: none).

    Raises:
        PluginError: no method of the entry's name is registered.
        MethodConfigError: the method has no preset of that name (the message lists its presets).
    """
    name = spec.get("preset")
    if name is None:
        return None
    cls = lookup("method", spec["name"])
    presets = getattr(cls, "presets", {}) or {}
    if not isinstance(name, str) or name not in presets:
        raise MethodConfigError(f"method {cls.name!r} has no preset {name!r}; its presets: "
                                f"{', '.join(sorted(presets)) or '(none)'}")
    return presets[name]


def method_params(spec: dict[str, Any]) -> dict[str, Any]:
    """The method parameters of an entry: its preset's values (``preset``) under the entry's
    own keys (``ENTRY_KEYS`` aside)."""
    preset = method_preset(spec)
    own = {k: copy.deepcopy(v) for k, v in spec.items() if k not in ENTRY_KEYS}
    return {**copy.deepcopy(preset.values), **own} if preset is not None else own


def build_method(spec: dict[str, Any]) -> Any:
    """A new :class:`~medfl.method.Method` of a method entry: the registered class of its
    ``name`` built from its other keys (``label`` aside) over its preset's values.

    Raises:
        PluginError: no method of that name is registered.
        ValueError: the class takes no parameter of some key, or has no such preset.
    """
    cls = lookup("method", spec["name"])
    return cls.from_config(method_params(spec))


def preset_record(spec: dict[str, Any], method: Any) -> dict[str, Any] | None:
    """What ``config.json`` records of an entry's preset: its name and source, and for every
    hyperparameter and ``train`` setting the preset or the entry touches, the value the run
    uses and where it came from (:func:`preset_origin`), plus medfl's defaults of the other
    hyperparameters and the source's experiment settings (not applied). ``None`` without a
    preset."""
    preset = method_preset(spec)
    if preset is None:
        return None
    hp = method.hparams()
    own = {k for k in spec if k not in ENTRY_KEYS}
    own_train = set(spec.get("train") or {})
    values: dict[str, Any] = {}
    for key in sorted(set(preset.values) | own):
        values[key] = {"value": hp.get(key, spec.get(key)), **preset_origin(preset, key, key in own)}
    train: dict[str, Any] = {}
    for key in sorted(set(preset.train) | own_train):
        train[key] = {"value": (spec.get("train") or {}).get(key, preset.train.get(key)),
                      **preset_origin(preset, f"train.{key}", key in own_train)}
    defaults = sorted(k for k in hp if k not in values)
    return {"name": spec["preset"], "source": preset.source, "description": preset.description,
            "values": values, "train": train, "medfl_defaults": {k: hp[k] for k in defaults},
            "experiment": copy.deepcopy(preset.experiment)}


def preset_origin(preset: Any, key: str, overridden: bool) -> dict[str, str]:
    """Where one entry of a run's preset record came from: ``{"from": "config"}`` where the
    method entry sets it itself; else ``{"from": kind, "source": citation}`` of the preset's
    :meth:`~medfl.method.Preset.source_of` (a kind of :data:`~medfl.method.SOURCE_KINDS`), or
    ``{"from": "unstated", ...}`` where the preset cites none (or one that is not
    ``"<kind>: <citation>"``)."""
    return {"from": "config"} if overridden else preset.origin(key)


#: How :func:`preset_counts` names each ``"from"`` of a preset record.
_ORIGIN_PHRASES = (("paper", "from the paper"), ("authors_code", "from the authors' code"), ("reading", "readings"),
                   ("open", "medfl's choices"), ("config", "from this config"), ("unstated", "without a source"))


def preset_counts(entries: Any) -> str:
    """One phrase counting a preset record's entries (dicts with ``"from"``) by where they came
    from: ``"5 from the paper, 0 from the authors' code, 1 readings, 2 medfl's choices, 1 from
    this config"``, with ``", N without a source"`` only where some entry has none."""
    origins = [e["from"] for e in entries]
    parts = [f"{origins.count(kind)} {phrase}" for kind, phrase in _ORIGIN_PHRASES
             if kind != "unstated" or "unstated" in origins]
    return ", ".join(parts)


def method_train(cfg: dict[str, Any], spec: dict[str, Any], method: Any = None) -> dict[str, Any]:
    """The local-training settings of one method entry: ``fl.train`` with the entry's
    preset's ``train`` settings and the entry's own ``train`` overrides, in that order.

    With ``method`` (its class or an instance), ``fl.train.dp`` is dropped for a method that
    cannot train with DP-SGD and sends no model state (``local``: nothing it trains leaves
    the client, so there is nothing to protect); the run says so. DP-SGD named in the
    entry's own ``train`` always stays (and is refused for such a method)."""
    preset = method_preset(spec)
    train = {**cfg["train"], **(preset.train if preset is not None else {}), **(spec.get("train") or {})}
    cls = method if isinstance(method, type) or method is None else type(method)
    if (cls is not None and train.get("dp") is not None and "dp" not in (spec.get("train") or {})
            and not cls.supports_dp_sgd and not cls.reply_state):
        train["dp"] = None
    return train


def check_entry(cfg: dict[str, Any], m: dict[str, Any], where: str) -> None:
    """Check a method entry's ``train`` overrides, its DP-SGD support and its filter chain
    (the method's own default filters in front of the configured ones)."""
    if "train" in m:
        if not isinstance(m["train"], dict):
            raise ConfigError(f"{where}.train: expected a dict of fl.train overrides, got {m['train']!r}")
        check_keys(m["train"], {**DEFAULTS["train"], **TRAIN_OPTIONAL}, f"{where}.train")
        check_train(m["train"], f"{where}.train")
        if "dp" in m["train"]:
            m["train"]["dp"] = check_dp_sgd(m["train"]["dp"], f"{where}.train.dp")
    method = build_method(m)
    cls = type(method)
    preset = method_preset(m)
    if preset is not None and preset.train:
        check_keys(preset.train, {**DEFAULTS["train"], **TRAIN_OPTIONAL}, f"{where}: preset {m['preset']!r}'s train")
    train = method_train(cfg, m, cls)
    if "train" in m or (preset is not None and preset.train):
        check_train(train, f"{where}.train")
    if train["dp"] is not None and not cls.supports_dp_sgd:
        raise ConfigError(f"{where}: method {cls.name!r} does not support DP-SGD (train.dp): its local training "
                          "is not plain per-sample-loss SGD that Opacus can privatise (see its docstring); use a "
                          "reply filter such as dp_gaussian, or an entry's own \"train\": {\"dp\": null}")
    if train["dp"] is not None and train.get("amp"):
        raise ConfigError(f"{where}: train.amp with DP-SGD (train.dp): Opacus clips per-sample gradients in full "
                          "precision and medfl does not mix the two; drop one of them")
    try:
        chain, _ = configured_filters(cfg, m, method)
    except (FilterConfigError, PrivacyConfigError) as exc:
        raise ConfigError(str(exc)) from None
    if cfg.get("secure_aggregation"):
        if not method.secure_aggregation:
            raise ConfigError(f"{where}: method {cls.name!r} cannot take fl.secure_aggregation: its coordinator "
                              "needs each client's own reply (it weighs, selects, scores or relays individual "
                              "replies), and secure aggregation shows it only the weighted mean; only methods "
                              "that declare secure_aggregation = True (fedavg with aggregation 'mean', fedprox, "
                              "fedavgm, fedadam, fedyogi, fedadagrad, fedbn) can, docs/plugins.md")
        if chain:
            raise ConfigError(f"{where}: fl.secure_aggregation with reply filters ({', '.join(f.name for f in chain.filters)}) is "
                              "not supported: SecAgg+ quantizes the update itself and sums it masked, which a "
                              "filter's encoding or its per-reply undo at the coordinator cannot pass through; "
                              "drop the filters (or set the entry's \"filters\": [])")
    model_dp = bool(chain.releases()) or train["dp"] is not None or cls.own_dp is not Method.own_dp
    private = model_dp or method.release_plan() is not None
    cross_test_in_clear(cfg, private, where)
    if model_dp:   # entries beside the noised model, as the method declares a plain reply's keys
        keys = uncovered_keys(method, Instruction(payload={}, config={}))
        if keys:
            uncovered_in_clear(cfg, keys, method, where)


#: What a private run with the opt-in sends in the clear (``sent_in_clear`` and ``not_covered``
#: in ``config.json``'s and ``summary.json``'s privacy blocks).
CROSS_TEST_IN_CLEAR = "cross_test: every site's personalised model, sent in the clear"


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


def uncovered_in_clear(cfg: dict[str, Any], keys: list[str], method: Any, where: str) -> str:
    """What a run whose model is noised sends in the clear beside it: the ``keys`` that ``method``
    (an instance) replies (:func:`uncovered_keys`) as one ``sent_in_clear`` line, only with the
    opt-in ``fl.uncovered_entries: {"under_dp": "send_in_clear"}``.

    Raises:
        ConfigError: without the opt-in, naming the method, the keys and the option.
    """
    name, state = method.name, sorted(type(method).reply_state)
    if (cfg.get("uncovered_entries") or {}).get("under_dp") == "send_in_clear":
        return f"reply entries {keys} of method {name!r}: beside its noised model, in the clear (no DP covers them)"
    raise ConfigError(
        f"{where}: method {name!r} replies {keys} beside its model state {state} under "
        "differential privacy, and no mechanism covers them: the noise is on the model only, so they would leave the "
        "sites in the clear while the run records an epsilon. Declare them in the method's reply_state (a DP filter "
        "then clips and noises them with the model), drop them from the reply under DP, or opt in with "
        "fl.uncovered_entries {\"under_dp\": \"send_in_clear\"} (the run's privacy record then says it is not "
        "private)")
