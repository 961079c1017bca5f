"""Resolving a bundle's ``fl`` section (:func:`resolve_config`): merged over the defaults,
every key, plugin spec and plugin name checked, each name recorded as the plugin it resolved to."""

from __future__ import annotations

import copy
import inspect
import math
from numbers import Real
from pathlib import Path
from typing import Any, Callable

from medfl.config.defaults import DEFAULTS, FL_OPTIONAL, TRAIN_OPTIONAL
from medfl.config.methods import ENTRY_KEYS, build_method, check_entry, method_label
from medfl.config.sections import (check_absences, check_backend, check_device, check_dp_sgd, check_early_stopping,
                                   check_min_sites, check_secure_aggregation, check_tracking, check_train,
                                   check_under_dp)
from medfl.config.threads import check_threads
from medfl.config_values import ConfigError, check_keys, named, read_bool, read_plugin_values
from medfl.plugins import KINDS, PluginError, lookup, pinned_names, qualified_name, registry

__all__ = ["PUBLIC_KEYS", "PUBLIC_TEST_FRACTION", "check_public_dataset", "check_parameters", "check_plugin_names",
           "plugin_names", "resolve_config"]


_NAMED = ("dataset", "partition", "model")


#: Keys of ``public_dataset`` that are not the dataset plugin's parameters.
PUBLIC_KEYS = ("test_fraction", "use_official_split", "group_column")

#: Default ``public_dataset.test_fraction``.
PUBLIC_TEST_FRACTION = 0.15


def check_public_dataset(value: Any, run: dict[str, Any] | None = None,
                         where: str = "fl.public_dataset") -> dict[str, Any] | None:
    """Check a ``public_dataset`` section on its own and fill its reserved keys.

    Args:
        value: ``None`` (no public dataset), a dataset plugin name, or
            ``{"name": <dataset plugin>, **plugin parameters}`` with optional reserved keys
            (:data:`PUBLIC_KEYS`): ``test_fraction`` (a number in (0, 1), default
            :data:`PUBLIC_TEST_FRACTION`), ``use_official_split`` (a bool) and
            ``group_column`` (a column name, or ``None``: every row its own group).
        run: the ``fl`` config whose ``use_official_split`` and ``group_column`` are the
            defaults (default: those of :data:`DEFAULTS`).
        where: the key named in error messages.

    Returns:
        ``None`` when there is no public dataset, else a new dict with ``name``, the plugin
        parameters and every reserved key.

    Raises:
        ConfigError: not a named spec, an unknown dataset plugin, or a bad reserved value;
            the message names ``<where>.<key>``.
    """
    if value is None or value is False:
        return None
    spec = named(value, where)
    try:
        lookup("dataset", spec["name"])
    except PluginError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    run = run or {}
    f = spec.get("test_fraction", PUBLIC_TEST_FRACTION)
    if not isinstance(f, Real) or isinstance(f, bool) or not math.isfinite(f) or not 0 < f < 1:
        raise ConfigError(f"{where}.test_fraction: expected a number in (0, 1) (the share of the public "
                          f"dataset held out as its test split), got {f!r}")
    spec["test_fraction"] = float(f)
    spec["use_official_split"] = read_bool(spec.get("use_official_split", run.get(
        "use_official_split", DEFAULTS["use_official_split"])), f"{where}.use_official_split")
    check_parameters("dataset", spec, where, skip=PUBLIC_KEYS)
    group = spec.get("group_column", run.get("group_column", DEFAULTS["group_column"]))
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigError(f"{where}.group_column: expected a column name or null (every row its own group), "
                          f"got {group!r}")
    spec["group_column"] = group
    return spec


def check_parameters(kind: str, spec: dict[str, Any], where: str, skip: tuple[str, ...] = (),
                     name: str | None = None) -> None:
    """Refuse a plugin spec (``{"name": ..., **parameters}``) whose parameters its plugin does
    not take, before anything is written, as method parameters are checked, and read its
    booleans and sizes (:func:`read_plugin_values`, in place). ``name``: the plugin, where the
    spec does not name it (a ``client_models`` override of the run's model).

    Raises:
        PluginError: no plugin of that name.
        ConfigError: naming the unknown parameters and the valid ones, or a bad value.
    """
    name = name or spec["name"]
    obj = lookup(kind, name)
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):   # a callable without a readable signature: its own checks
        return
    unknown = sorted(k for k in spec if k != "name" and k not in skip and k not in params)
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"{where}: {kind} {name!r} takes no parameter(s) {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(p for p in params if p not in ('self',))}")
    read_plugin_values(params, spec, where, skip)


def check_plugin_names(value: Any, where: str = "fl.plugin_names") -> dict[str, dict[str, str]]:
    """Read ``fl.plugin_names`` (what a resolved config records: ``{kind: {name: "dist:name"}}``).

    Raises:
        ConfigError: not that shape, naming the entry.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected {{kind: {{name: \"dist:name\"}}}} (medfl writes it), got {value!r}")
    out: dict[str, dict[str, str]] = {}
    for kind, names in value.items():
        if kind not in KINDS:
            raise ConfigError(f"{where}: unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) and ":" in v
                                                  for k, v in names.items()):
            raise ConfigError(f"{where}.{kind}: expected {{name: \"dist:name\"}}, got {names!r}")
        out[kind] = dict(names)
    return out


def _used_names(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """``(kind, name)`` of every plugin a resolved config names."""
    used = [("dataset", cfg["dataset"]["name"]), ("partitioner", cfg["partition"]["name"]),
            ("model", cfg["model"]["name"]), ("backend", cfg["backend"]["name"])]
    used += [("model", o["name"]) for o in cfg["client_models"].values() if "name" in o]
    if cfg.get("public_dataset"):
        used.append(("dataset", cfg["public_dataset"]["name"]))
    for chain in [cfg["filters"]] + [m.get("filters") or [] for m in cfg["methods"]]:
        used += [("filter", f if isinstance(f, str) else f["name"]) for f in chain
                 if isinstance(f, str) or (isinstance(f, dict) and isinstance(f.get("name"), str))]
    used += [("method", m["name"]) for m in cfg["methods"]]
    return used


def plugin_names(cfg: dict[str, Any]) -> dict[str, dict[str, str]]:
    """``{kind: {name: "dist:name"}}``: the qualified name each plugin name of a resolved
    config resolves to now (what ``config.json`` records as ``fl.plugin_names``, so that a
    resumed run uses the same plugins whatever is installed since).

    Raises:
        PluginError: a name is unknown or ambiguous.
    """
    out: dict[str, dict[str, str]] = {}
    for kind, name in _used_names(cfg):
        out.setdefault(kind, {})[name] = qualified_name(kind, name)
    return out


def resolve_config(fl: dict[str, Any]) -> dict[str, Any]:
    """Merge ``fl`` over :data:`DEFAULTS`, check every key and every plugin name.

    Plugin names are bare (``fedavg``) or qualified (``medfl:fedavg``); a bare name two
    plugins register is refused, naming both. The result records in ``plugin_names`` the
    qualified name each resolved to; a config that already records them (a saved run's)
    resolves its names to those, whatever has been installed since.

    Returns:
        The resolved config (a new dict), with ``methods`` as a list of dicts.

    Raises:
        ConfigError: unknown key, bad value, or unknown dataset/partitioner/model/method name
            (``public_dataset`` included); the message lists the valid choices.
    """
    if not isinstance(fl, dict):
        raise ConfigError(f"fl: expected a dict, got {type(fl).__name__}")
    check_keys(fl, {**DEFAULTS, **FL_OPTIONAL}, "fl")
    pins = check_plugin_names(fl.get("plugin_names"))
    with pinned_names(pins):
        cfg = _resolve_config(fl)
        try:
            cfg["plugin_names"] = plugin_names(cfg)
        except PluginError as exc:
            raise ConfigError(str(exc)) from exc
    return cfg


def _resolve_config(fl: dict[str, Any]) -> dict[str, Any]:
    """:func:`resolve_config`'s checks (``fl``: a dict of known keys), in the order they refuse."""
    cfg = _merged(fl)
    _check_counts(cfg)
    check_train(cfg["train"], "fl.train")
    check_device(cfg["device"])
    cfg["backend"] = check_backend(cfg["backend"])
    if not (0 < float(cfg["fraction"]) <= 1):
        raise ConfigError(f"fl.fraction: expected a number in (0, 1], got {cfg['fraction']!r}")
    check_min_sites(cfg)
    per_class = cfg["global_test_per_class"]
    if per_class is not None and (not isinstance(per_class, int) or isinstance(per_class, bool) or per_class < 1):
        raise ConfigError(f"fl.global_test_per_class: expected null or a positive integer (rows held out per "
                          f"class), got {per_class!r}")
    stop = cfg["stop_after_round"]
    if stop is not None and (not isinstance(stop, int) or stop < 1):
        raise ConfigError(f"fl.stop_after_round: expected null or a positive integer, got {stop!r}")
    _check_splits(cfg)
    _check_plugin_specs(cfg)
    _check_sections(cfg)
    for i, m in enumerate(cfg["methods"]):
        check_entry(cfg, m, f"fl.methods[{i}] ({method_label(m)})")
    _check_client_models(cfg)
    metrics = registry()["metric"]  # also makes sure every plugin loaded cleanly
    if cfg["cv"]["folds"] and cfg["cv"]["metric"] not in metrics:
        raise ConfigError(f"fl.cv.metric: unknown metric {cfg['cv']['metric']!r}; valid: {', '.join(sorted(metrics))}")
    cfg["early_stopping"] = check_early_stopping(cfg["early_stopping"], list(cfg["eval_splits"]))
    if cfg["early_stopping"] is not None and cfg["eval_every"] == 0:
        raise ConfigError("fl.early_stopping: decides on rounds evaluated along the way, but fl.eval_every is 0 "
                          "(only the last round is evaluated); set fl.eval_every (e.g. 1) or fl.early_stopping null")
    return cfg


def _merged(fl: dict[str, Any]) -> dict[str, Any]:
    """``fl`` over :data:`DEFAULTS` (a new dict; ``train``, ``cv`` key by key), its plugin specs
    and method entries as ``{"name": ...}`` dicts, its booleans read."""
    cfg = copy.deepcopy(DEFAULTS)
    for key, value in fl.items():
        if key in ("train", "cv"):
            if not isinstance(value, dict):
                like = "" if key == "train" else " like {'folds': 5}"
                raise ConfigError(f"fl.{key}: expected a dict{like}, got {value!r}")
            check_keys(value, {**DEFAULTS[key], **(TRAIN_OPTIONAL if key == "train" else {})}, f"fl.{key}")
            cfg[key].update(value)
        elif key in _NAMED:
            cfg[key] = named(value, f"fl.{key}")
        else:
            cfg[key] = copy.deepcopy(value)
    for key, default in {**DEFAULTS, **FL_OPTIONAL}.items():
        if isinstance(default, bool) and key in cfg:   # plots, progress, overwrite, use_official_split
            cfg[key] = read_bool(cfg[key], f"fl.{key}")
    methods = cfg["methods"]
    if isinstance(methods, (str, dict)):
        methods = [methods]
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"fl.methods: expected a non-empty list of methods, got {methods!r}")
    cfg["methods"] = [named(m, f"fl.methods[{i}]") for i, m in enumerate(methods)]
    labels = [method_label(m) for m in cfg["methods"]]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"fl.methods: two entries share a name {labels}; give one a 'label'")
    return cfg


def _check_counts(cfg: dict[str, Any]) -> None:
    """Check the counts of ``fl`` (rounds, clients, seed, checkpoints...), ``update_norm_factor``
    and ``output_dir``."""
    for key in ("rounds", "num_clients", "seed", "keep_checkpoints", "eval_every", "max_reply_failures"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 0:
            raise ConfigError(f"fl.{key}: expected a non-negative integer, got {cfg[key]!r}")
    if cfg["rounds"] < 1:
        raise ConfigError(f"fl.rounds: expected at least 1, got {cfg['rounds']}")
    factor = cfg["update_norm_factor"]
    if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor)
            or not (factor == 0 or factor >= 2)):
        raise ConfigError(f"fl.update_norm_factor: expected 0 (off) or a number >= 2 (a bound on each update's norm "
                          f"as a multiple of the step's median update norm), got {factor!r}")
    if cfg["keep_checkpoints"] < 1:
        raise ConfigError(f"fl.keep_checkpoints: expected at least 1 (a run keeps its latest checkpoint to resume "
                          f"from), got {cfg['keep_checkpoints']}")
    out_dir = Path(str(cfg["output_dir"])).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"fl.output_dir: {str(out_dir)!r} is a file; expected a directory (or a path to create)")
    if cfg["num_clients"] < 1:
        raise ConfigError(f"fl.num_clients: expected at least 1, got {cfg['num_clients']}")


def _check_splits(cfg: dict[str, Any]) -> None:
    """Check ``cv``, ``seeds``, ``client_split`` and ``eval_splits`` and that they fit together."""
    cv = cfg["cv"]
    folds = cv["folds"]
    if not isinstance(folds, int) or isinstance(folds, bool) or folds < 0 or folds == 1:
        raise ConfigError(f"fl.cv.folds: expected 0 (no cross-validation) or at least 2, got {folds!r}")
    if cv["column"] is not None and not isinstance(cv["column"], str):
        raise ConfigError(f"fl.cv.column: expected null or a column name, got {cv['column']!r}")
    if not isinstance(cv["metric"], str):
        raise ConfigError(f"fl.cv.metric: expected a metric name, got {cv['metric']!r}")
    seeds = cfg["seeds"]
    if seeds is not None:
        if (not isinstance(seeds, list) or not seeds
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in seeds)):
            raise ConfigError(f"fl.seeds: expected null or a non-empty list of non-negative integers like "
                              f"[0, 1, 2, 3, 4], got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"fl.seeds: a seed is listed twice in {seeds}")
        if folds:
            raise ConfigError("fl.seeds and fl.cv.folds: repeat over seeds or cross-validate, not both "
                              "(set one of them null/0)")
    split = cfg["client_split"]
    if not isinstance(split, dict) or "train" not in split or abs(sum(split.values()) - 1) > 1e-6:
        raise ConfigError(f"fl.client_split: expected fractions with 'train' summing to 1, got {split!r}")
    for i, s in enumerate(cfg["eval_splits"]):
        if s not in ("global_test", "cross_test") and s not in split:
            raise ConfigError(f"fl.eval_splits[{i}]: unknown split {s!r}; valid: global_test, cross_test, "
                              f"{', '.join(split)}")
        if s == "cross_test" and "test" not in split:
            raise ConfigError("fl.eval_splits: cross_test scores every client's 'test' split; "
                              "client_split has no 'test'")
    if folds and "test" not in split:
        raise ConfigError("fl.cv: cross-validation makes each fold a client's 'test' split; "
                          "client_split has no 'test'")


def _check_plugin_specs(cfg: dict[str, Any]) -> None:
    """Check the dataset, partitioner and model specs' parameters, and build each method entry's
    method once (its parameter names and values) before any work."""
    try:
        for kind, key in (("dataset", "dataset"), ("partitioner", "partition"), ("model", "model")):
            check_parameters(kind, cfg[key], f"fl.{key}", skip=("dp_compatible",) if kind == "model" else ())
        for i, m in enumerate(cfg["methods"]):
            read_plugin_values(inspect.signature(lookup("method", m["name"]).__init__).parameters, m,
                               f"fl.methods[{i}]", skip=ENTRY_KEYS, sizes=False)
            build_method(m)  # checks parameter names now, before any work
    except (PluginError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def _check_sections(cfg: dict[str, Any]) -> None:
    """Check, in place, the sections read on their own: ``public_dataset``, ``train.dp``,
    ``filters`` and the optional keys that are set."""
    cfg["public_dataset"] = check_public_dataset(cfg["public_dataset"], cfg)
    cfg["train"]["dp"] = check_dp_sgd(cfg["train"]["dp"], "fl.train.dp")
    if not isinstance(cfg["filters"], list):
        raise ConfigError(f"fl.filters: expected a list of filters like [{{\"name\": \"quantize\", \"bits\": 8}}], "
                          f"got {cfg['filters']!r}")
    optional: dict[str, Callable[[Any], Any]] = {
        "secure_aggregation": lambda v: check_secure_aggregation(v, cfg["num_clients"]),
        "cross_test": lambda v: check_under_dp("cross_test", v),
        "uncovered_entries": lambda v: check_under_dp("uncovered_entries", v),
        "absences": lambda v: check_absences(v, cfg["rounds"]), "threads": check_threads, "tracking": check_tracking}
    for key, check in optional.items():   # in this order
        if key in cfg:
            cfg[key] = check(cfg[key])


def _check_client_models(cfg: dict[str, Any]) -> None:
    """Check ``client_models`` (a list becomes ``{client id: override}``, in place) against the
    model's parameters, and read each model spec's ``dp_compatible``."""
    cm = cfg["client_models"]
    if isinstance(cm, list):  # one override dict per client, in client-id order "0", "1", ...
        if len(cm) != cfg["num_clients"] or not all(isinstance(d, dict) for d in cm):
            raise ConfigError(f"fl.client_models: a list needs one dict per client ({cfg['num_clients']}), "
                              f"got {cm!r}")
        cfg["client_models"] = cm = {str(i): dict(d) for i, d in enumerate(cm)}
    if not isinstance(cm, dict) or not all(isinstance(v, dict) for v in cm.values()):
        raise ConfigError("fl.client_models: expected {client_id: {model kwarg: value}} or a list of "
                          "one {model kwarg: value} per client")
    try:
        for cid, override in cm.items():
            check_parameters("model", override, f"fl.client_models.{cid}", skip=("dp_compatible",),
                             name=override.get("name", cfg["model"]["name"]))
    except PluginError as exc:
        raise ConfigError(str(exc)) from exc
    for where, spec in (("fl.model", cfg["model"]), *((f"fl.client_models.{c}", o) for c, o in cm.items())):
        if "dp_compatible" in spec:   # the engine's own key of a model spec (medfl.models.registry)
            spec["dp_compatible"] = read_bool(spec["dp_compatible"], f"{where}.dp_compatible")
