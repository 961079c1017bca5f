"""The ``fl`` section of a bundle config: defaults, validation and resolution.

A bundle's ``train.json`` holds the experiment under the key ``fl``; every key can be
overridden from MONAI's command line (``--fl#rounds 3``, ``--fl#methods#0#name fedprox``).
Unknown keys and unknown plugin names fail with an error listing the valid ones.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import math
from numbers import Real
from pathlib import Path
from typing import Any

from medfl.plugins import KINDS, PluginError, lookup, pinned_names, qualified_name, registry

__all__ = ["ConfigError", "DEFAULTS", "ENTRY_KEYS", "DP_SGD_DEFAULTS", "PUBLIC_KEYS", "PUBLIC_TEST_FRACTION",
           "OPTIMIZERS", "resolve_config", "method_label", "build_method", "method_params", "method_preset",
           "preset_record", "preset_origin", "preset_counts", "method_train", "check_dp_sgd",
           "check_public_dataset", "check_train", "check_device",
           "check_backend", "check_tracking", "check_min_sites", "BACKEND_DEFAULTS", "TRAIN_OPTIONAL", "FL_OPTIONAL",
           "EARLY_STOPPING_DEFAULTS", "TEST_SPLITS", "check_early_stopping", "ABSENCE_PHASES", "check_absences",
           "SECURE_AGGREGATION_DEFAULTS", "check_secure_aggregation", "CROSS_TEST_DEFAULTS", "CROSS_TEST_UNDER_DP",
           "check_cross_test", "cross_test_in_clear", "CROSS_TEST_IN_CLEAR", "check_uncovered_entries",
           "uncovered_keys", "uncovered_in_clear", "UNCOVERED_DEFAULTS", "UNCOVERED_UNDER_DP", "BOOL_WORDS", "read_bool",
           "read_plugin_values", "check_plugin_names", "plugin_names"]


class ConfigError(ValueError):
    """The ``fl`` config has an unknown key, a wrong type or an unknown plugin name."""


#: Every valid key of the ``fl`` section with its default. ``dataset``, ``partition``,
#: ``model`` and each entry of ``methods`` are ``{"name": ..., **plugin parameters}``.
DEFAULTS: dict[str, Any] = {
    "name": "run",                  # experiment name: the run directory is output_dir/name
    "output_dir": "runs",
    "seed": 0,
    "rounds": 5,
    "stop_after_round": None,       # stop early (as if killed); `medfl resume` continues
    "num_clients": 4,
    "fraction": 1.0,                # fraction of clients sampled each round
    "device": "cpu",
    "dataset": {"name": "synthetic2d"},
    "global_test_fraction": 0.2,    # held-out global test when the data has no `split` column
    "global_test_per_class": None,  # or k: hold out k rows of every class instead (FedSDC's NIID-1: 30)
    "use_official_split": True,     # False: ignore the dataset's `split` column (its test rows join the pool)
    # rows sharing it (one patient's images) go to one client (every built-in partitioner deals
    # whole groups) and never straddle the global test or a client's train/val/test splits;
    # null: rows one by one (partition_report.json counts the subjects that then straddle)
    "group_column": "subject_id",
    # a dataset only the coordinator reads (never a client), e.g. MIAS as the public/proxy set
    # that knowledge-distillation methods distil into: null, or {"name": <dataset plugin>,
    # **its parameters} plus the reserved keys "test_fraction" (0.15: the test share drawn by
    # group when there is no official split), "use_official_split" and "group_column" (both
    # default to the run's); see medfl.public
    "public_dataset": None,
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 10},
    "client_split": {"train": 0.7, "val": 0.15, "test": 0.15},
    # k-fold cross-validation: folds > 1 runs every method once per fold (fold_<k>/), each
    # client's test split being its k-th fold (from `column` when the dataset has one) and
    # the rest split train:val in client_split's ratio; `metric` is the one cv_table reports
    "cv": {"folds": 0, "column": None, "metric": "auc"},
    # repeat the whole experiment once per seed (seed_<s>/: split, initialisation and
    # training order all follow the seed) and report mean ± std over seeds: e.g. [0, 1, 2, 3, 4]
    "seeds": None,
    "model": {"name": "resnet10", "width": 16},
    "client_models": {},            # per-client model overrides {client_id: {kwarg: value}}, or a list in id order
    "train": {
        "epochs": 1,
        "batch_size": 16,
        "eval_batch_size": 64,
        "lr": 0.01,
        "optimizer": "sgd",
        "momentum": 0.9,
        "weight_decay": 0.0,
        "num_workers": 0,
        # DP-SGD in local training (Opacus): {"epsilon": 3 | "noise_multiplier": 1.1,
        # "max_grad_norm": 1.0, "delta": 1e-5, "accountant": "rdp"}; null: off
        "dp": None,
    },
    # reply filters applied to every method's model state (a method entry's own "filters"
    # replaces this list): e.g. [{"name": "dp_gaussian", "epsilon": 3, "clip": 1.0},
    # {"name": "quantize", "bits": 8}]; `medfl plugins` lists them
    "filters": [],
    "methods": [{"name": "fedavg"}],
    "eval_splits": ["test", "global_test"],  # + "cross_test": each model on every client's test split
    "eval_every": 1,                # evaluate every k rounds (the last round always; 0: last only)
    # early stopping and best-round selection for every method: null (off: every round runs
    # and the last round's models are final), or {"metric": "val/micro_f1", "patience": 5,
    # "min_delta": 0.0, "mode": null, "min_rounds": 0} (EARLY_STOPPING_DEFAULTS): after each
    # evaluated round the mean over clients of <split>/<metric> (a split of eval_splits, a
    # column of metrics.csv); a round that beats the best by more than min_delta becomes the
    # best round, and the run stops once `patience` evaluated rounds (eval_every) in a row did
    # not (and at least min_rounds ran); the best round's models are final (summary.json,
    # final_models, predict). mode null: "min" for a lower-is-better metric, else "max".
    # Selecting on a test split is allowed but is test-set leakage (warned, recorded)
    "early_stopping": None,
    "keep_checkpoints": 2,
    "max_reply_failures": 3,        # a client whose replies fail the coordinator's checks this often is excluded (0: never)
    # a reply whose update (model state minus the state sent) is longer than this many times
    # the median update norm of its training step is dropped (reply_events.csv, counted toward
    # max_reply_failures), as robust aggregators bound updates; >= 2, or 0: off
    "update_norm_factor": 10.0,
    # the fewest sites whose answers a round's training and evaluation need (as Flower's
    # min_available_clients): the larger of min_sites and min_fraction (null: unused) of the
    # sites a round addresses, never more than it addresses. Over Flower a round with fewer
    # sites available waits up to site_wait_s seconds for them (lost sites are asked for
    # their hello again); a round with fewer answers fails the run (status "failed", resumable)
    "min_sites": 1,
    "min_fraction": None,
    "site_wait_s": 300.0,
    "progress": True,
    # where the clients run: "inprocess" (one after another in this process) or "ray"
    # (Flower's simulation runtime: clients in parallel Ray actors, through the same
    # ServerApp/ClientApp code as a deployment; needs `pip install "medfl[simulation]"`),
    # e.g. {"name": "ray", "client_cpus": 1, "client_gpus": 0.5} (see BACKEND_DEFAULTS)
    "backend": "inprocess",
    "overwrite": False,             # False: a new directory name-2, name-3... if name exists
}

#: Keys of ``train`` that are valid but absent unless set (they change how a client computes,
#: not what it learns, so configs without them send the same messages as before):
#: ``amp`` mixed precision ("bf16" or "fp16", with a gradient scaler; :mod:`medfl.training`),
#: ``channels_last`` (channels-last memory format for 2D/3D convolutions), ``pin_memory``
#: (page-locked batches; null: on for CUDA devices), ``clip_grad_norm`` (the global gradient
#: norm each step is clipped to, :func:`check_train`; null: no clipping).
TRAIN_OPTIONAL: dict[str, Any] = {"amp": None, "channels_last": False, "pin_memory": None, "clip_grad_norm": None}

#: Top-level keys that are valid but absent unless set: ``plots`` (``false``: no PNG plots at the
#: end of runs and experiments, the CSV/JSON results are written all the same and ``medfl
#: report RUN_DIR`` draws the plots later; the environment variable ``MEDFL_NO_PLOTS=1`` does
#: the same for every run of a process and its children, :func:`medfl.plotting.plots_wanted`).
#: ``secure_aggregation`` (Flower's SecAgg+ for the replies of the FedAvg family, over Flower
#: only: ``true`` or a dict of :data:`SECURE_AGGREGATION_DEFAULTS` keys; :func:`check_secure_aggregation`).
#: ``cross_test`` (:data:`CROSS_TEST_DEFAULTS`, :func:`check_cross_test`): what the Global Test may
#: do in a run with differential privacy, which it leaves by sending every client's evaluation
#: model in the clear; absent, a private run with ``cross_test`` in ``eval_splits`` is refused.
#: ``uncovered_entries`` (:data:`UNCOVERED_DEFAULTS`, :func:`check_uncovered_entries`): what a run
#: whose model is noised does with reply entries beside the model that no DP covers; absent, it
#: is refused (:func:`uncovered_in_clear`).
#: ``absences`` (:func:`check_absences`): a scripted schedule of clients left out of given
#: rounds' exchanges, as if they had dropped out (replaying a deployment's dropouts in process).
#: ``tracking`` (:func:`check_tracking`): the experiment trackers, e.g. ``[{"name": "mlflow",
#: "uri": "http://127.0.0.1:5000"}, {"name": "tensorboard"}]`` (:mod:`medfl.tracking`).
#: ``threads`` (:func:`check_threads`): torch's intra-op threads in each process that trains, a
#: positive integer or ``"auto"`` (the cores this process may use shared among the processes that
#: train beside it, :func:`auto_threads`); ``--threads N`` (``MEDFL_THREADS``) overrides it.
FL_OPTIONAL: dict[str, Any] = {"plots": True, "secure_aggregation": None, "cross_test": None, "absences": None,
                               "threads": "auto", "tracking": None, "uncovered_entries": None,
                               # written by medfl: {kind: {name as written: "dist:name" it resolved to}}
                               "plugin_names": None}

#: The exchanges of a round a client can be scheduled absent from (``fl.absences``).
ABSENCE_PHASES = ("train", "validate", "evaluate")

#: The keys of ``fl.secure_aggregation`` and their defaults (:mod:`medfl.flower.secagg`).
SECURE_AGGREGATION_DEFAULTS: dict[str, Any] = {
    # how many clients hold a share of each client's secrets, counting itself: an integer >= 3,
    # or a fraction of the round's clients (1.0: every client, SecAgg; less: SecAgg+'s sparse graph)
    "num_shares": 1.0,
    # how many of those shares rebuild a secret: an integer >= 2 or a fraction of num_shares;
    # fewer than this many colluding parties (the coordinator counts as one) learn nothing of
    # a client's update, and a round needs this many online neighbours of every client
    "reconstruction_threshold": 0.67,
    # each coordinate of a client's weighted update is clipped to [-clipping_range, clipping_range] ...
    "clipping_range": 8.0,
    # ... and stochastically rounded to one of quantization_range integer levels
    "quantization_range": 2 ** 22,
}
#: the modulus of SecAgg+'s masks (Flower's default; the sum of the quantized updates must stay below it)
SECURE_AGGREGATION_MODULUS = 2 ** 32
AMP_DTYPES = ("bf16", "fp16")

_NAMED = ("dataset", "partition", "model")


def _check_keys(section: dict[str, Any], valid: dict[str, Any], where: str) -> None:
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
            f"{', '.join(sorted(valid))}"
        )


#: How a boolean may be spelled in a config or on the command line (any case): MONAI's bundle
#: CLI hands over ``--fl#plots false`` as the word, ``medfl``'s own reads ``yes`` as a word too.
BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def read_bool(value: Any, where: str, *, nullable: bool = False) -> bool | None:
    """A boolean setting read one way wherever it comes from (a config file, ``--fl#key value``
    through medfl's or MONAI's command line, a plugin parameter): ``true``/``false``, the
    integers 1/0, or a word of :data:`BOOL_WORDS` in any case; ``None`` too where ``nullable``.

    Raises:
        ConfigError: anything else, naming ``where`` and the value.
    """
    if isinstance(value, bool) or (value is None and nullable):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise ConfigError(f"{where}: expected true or false (or yes/no, 1/0){', or null' if nullable else ''}, "
                      f"got {value!r}")


def _annotation(p: inspect.Parameter) -> str:
    """A parameter's annotation as written (``"bool | None"``), whether a string or a type."""
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return (a if isinstance(a, str) else getattr(a, "__name__", str(a))).replace("typing.", "").replace(" ", "")


def _size_like(name: str) -> bool:
    """Whether a plugin parameter is a size or count by its name (``image_size``,
    ``spatial_size``, ``num_classes``, ``width``; not ``min_size``/``max_size``, whose 0 may mean
    something)."""
    if name.startswith(("min_", "max_")):
        return False
    return name.endswith("_size") or name.startswith("num_") or name == "width"


def read_plugin_values(params: Any, spec: dict[str, Any], where: str, skip: tuple[str, ...] = (),
                       sizes: bool = True) -> dict[str, Any]:
    """Read a plugin spec's values against its parameters (``inspect`` parameters by name), in
    place: a parameter annotated ``bool`` (or with a ``True``/``False`` default) through
    :func:`read_bool`; with ``sizes`` (dataset, partitioner and model plugins; a method checks
    its own hyperparameters), a size or count (:func:`_size_like`: ``image_size``,
    ``spatial_size``, ``num_*``, ``width``) must be a positive integer, or a non-empty list of
    them where the annotation is a sequence, or ``None`` where the parameter allows it. So
    ``image_size=0`` is refused here, not by a convolution after the run directory was made.

    Returns:
        ``spec``.

    Raises:
        ConfigError: naming ``<where>.<key>``, the value and what was expected.
    """
    for key, value in spec.items():
        p = params.get(key)
        if key == "name" or key in skip or p is None:
            continue
        kind = _annotation(p)
        nullable = "None" in kind.split("|") or kind.startswith("Optional[") or p.default is None
        if kind.removeprefix("Optional[").removesuffix("]") in ("bool", "bool|None", "None|bool") or (
                not kind and isinstance(p.default, bool)):
            spec[key] = read_bool(value, f"{where}.{key}", nullable=nullable)
        elif sizes and _size_like(key) and not (value is None and nullable):
            sequence = kind.startswith(("Sequence[", "list[", "tuple["))
            items = value if sequence and isinstance(value, (list, tuple)) else [value]
            if not items or (sequence and not isinstance(value, (list, tuple))) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
                what = "a non-empty list of positive integers" if sequence else "a positive integer"
                raise ConfigError(f"{where}.{key}: expected {what}{' or null' if nullable else ''} (a size or "
                                  f"count), got {value!r}")
    return spec


def _optional_section(value: Any, defaults: dict[str, Any], where: str, example: str) -> dict[str, Any] | None:
    """A section that is off when ``None`` (or false), else a dict of ``defaults``' keys:
    ``None``, or a new dict of ``value`` over ``defaults``.

    Raises:
        ConfigError: not a dict (the message shows ``example``), or an unknown key.
    """
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected null or a dict like {example}, got {value!r}")
    _check_keys(value, defaults, where)
    return {**defaults, **value}


def _named(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ConfigError(f"{where}: expected a name or a dict with a 'name' key, got {value!r}")
    return dict(value)


#: Keys of a method entry that are not the method's parameters: its run-directory name, its
#: own filter chain (replaces ``fl.filters``), overrides of ``fl.train`` for this method and
#: the name of one of the method's presets (:attr:`medfl.method.Method.presets`).
ENTRY_KEYS = ("name", "label", "filters", "train", "preset")

#: Keys of ``train.dp`` (DP-SGD) and their defaults; ``epsilon`` or ``noise_multiplier``.
DP_SGD_DEFAULTS: dict[str, Any] = {"epsilon": None, "noise_multiplier": None, "max_grad_norm": 1.0,
                                   "delta": 1e-5, "accountant": "rdp"}


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
    spec = _named(value, where)
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
    _check_parameters("dataset", spec, where, skip=PUBLIC_KEYS)
    group = spec.get("group_column", run.get("group_column", DEFAULTS["group_column"]))
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigError(f"{where}.group_column: expected a column name or null (every row its own group), "
                          f"got {group!r}")
    spec["group_column"] = group
    return spec


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
    from medfl.method import MethodConfigError

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


def check_dp_sgd(dp: Any, where: str) -> dict[str, Any] | None:
    """Check a ``train.dp`` section (DP-SGD) on its own and fill its defaults.

    Returns:
        ``None`` when DP-SGD is off, else the section with every key of
        :data:`DP_SGD_DEFAULTS`.

    Raises:
        ConfigError: unknown key, neither or both of ``epsilon`` and ``noise_multiplier``,
            epsilon <= 0, delta outside (0, 1), max_grad_norm <= 0, an unknown accountant.
    """
    from medfl.privacy.accounting import PrivacyConfigError, check_accountant, check_delta, check_positive

    out = _optional_section(dp, DP_SGD_DEFAULTS, where, '{"epsilon": 3, "max_grad_norm": 1.0}')
    if out is None:
        return None
    try:
        if (out["epsilon"] is None) == (out["noise_multiplier"] is None):
            raise ConfigError(f"{where}: give exactly one of epsilon (a target, the noise is derived) and "
                              f"noise_multiplier; got epsilon={out['epsilon']!r}, "
                              f"noise_multiplier={out['noise_multiplier']!r}")
        if out["epsilon"] is not None:
            out["epsilon"] = check_positive(out["epsilon"], "epsilon", where)
        else:
            out["noise_multiplier"] = check_positive(out["noise_multiplier"], "noise_multiplier", where)
        out["max_grad_norm"] = check_positive(out["max_grad_norm"], "max_grad_norm", where)
        out["delta"] = check_delta(out["delta"], where)
        out["accountant"] = check_accountant(out["accountant"], where)
    except PrivacyConfigError as exc:
        raise ConfigError(str(exc)) from None
    return out


#: local optimizers :func:`medfl.training.make_optimizer` builds
OPTIMIZERS = ("sgd", "adam", "adamw")


def check_train(train: dict[str, Any], where: str) -> None:
    """Check local-training settings before anything is written: ``epochs``, ``batch_size``,
    ``eval_batch_size`` positive integers, ``num_workers`` a non-negative one, ``lr`` a finite
    positive number, ``momentum`` in [0, 1), ``weight_decay`` finite and >= 0, ``optimizer``
    one of :data:`OPTIMIZERS`, ``clip_grad_norm`` null or positive, ``amp`` null, ``bf16`` or
    ``fp16``, ``channels_last`` and ``pin_memory`` booleans (null: the default; read in place
    with :func:`read_bool`, so ``"false"`` from a command line is ``False``).

    Raises:
        ConfigError: naming ``where``'s key, the value and what was expected.
    """
    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: expected a finite number, got {value!r}")
        return float(value)

    for key, low in (("epochs", 1), ("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
        if key in train:
            v = train[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{where}.{key}: expected an integer >= {low}, got {v!r}")
    if "lr" in train and number("lr", train["lr"]) <= 0:
        raise ConfigError(f"{where}.lr: expected a positive learning rate, got {train['lr']!r}")
    if "momentum" in train and not 0 <= number("momentum", train["momentum"]) < 1:
        raise ConfigError(f"{where}.momentum: expected a number in [0, 1), got {train['momentum']!r}")
    if "weight_decay" in train and number("weight_decay", train["weight_decay"]) < 0:
        raise ConfigError(f"{where}.weight_decay: expected a number >= 0, got {train['weight_decay']!r}")
    if "optimizer" in train and str(train["optimizer"]).lower() not in OPTIMIZERS:
        raise ConfigError(f"{where}.optimizer: unknown optimizer {train['optimizer']!r}; valid: {', '.join(OPTIMIZERS)}")
    clip = train.get("clip_grad_norm")
    if clip is not None and number("clip_grad_norm", clip) <= 0:
        raise ConfigError(f"{where}.clip_grad_norm: expected null or a positive number, got {clip!r}")
    if train.get("amp") is not None and train["amp"] not in AMP_DTYPES:
        raise ConfigError(f"{where}.amp: expected null (full precision), 'bf16' or 'fp16', got {train['amp']!r}")
    for key in ("channels_last", "pin_memory"):
        if key in train:
            train[key] = read_bool(train[key], f"{where}.{key}", nullable=True)


#: The keys of a ``backend`` entry and their defaults.
BACKEND_DEFAULTS: dict[str, Any] = {
    "name": "inprocess",
    "client_cpus": 1,         # CPU cores each simulated client holds (its torch threads)
    "client_gpus": 0.0,       # GPUs (or a share, 0.25: four clients per GPU) each client holds
    "num_cpus": None,         # cores Ray may use in all (null: every core of the machine)
    "num_gpus": None,         # GPUs Ray may use in all (null: every GPU)
    "connect_timeout": 600.0,  # seconds every simulated node has to answer its hello (its actor starting)
}
#: The built-in backends (:mod:`medfl_plugins.backends`); a plugin may register more (``register_backends``).
BACKENDS = ("inprocess", "ray", "flower")


def check_backend(value: Any, where: str = "fl.backend") -> dict[str, Any]:
    """Check a ``backend`` entry (a name, or ``{"name": ..., **BACKEND_DEFAULTS keys}``)
    and return it with every key filled in. The name is one of the registered backends
    (:func:`medfl.plugins.registry`, kind ``backend``).

    Raises:
        ConfigError: unknown backend or key, a resource count that is not a
            non-negative number (``client_cpus`` at least 1), or a ``connect_timeout``
            that is not a positive number of seconds.
    """
    entry = {"name": value} if isinstance(value, str) else value
    names = list(registry()["backend"])
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ConfigError(f"{where}: expected one of {', '.join(map(repr, names))} or "
                          f"{{\"name\": \"ray\", \"client_cpus\": 1, \"client_gpus\": 0}}, got {value!r}")
    try:
        registry().resolve("backend", entry["name"])   # bare or qualified (dist:name)
    except PluginError as exc:
        if not str(exc).startswith("unknown"):   # ambiguous, or its plugin was refused
            raise ConfigError(f"{where}: {exc}") from exc
        raise ConfigError(f"{where}: expected one of {', '.join(map(repr, names))} or "
                          f"{{\"name\": \"ray\", \"client_cpus\": 1, \"client_gpus\": 0}}, got {value!r}") from exc
    _check_keys(entry, BACKEND_DEFAULTS, where)
    out = {**BACKEND_DEFAULTS, **entry}
    for key in ("client_cpus", "client_gpus", "num_cpus", "num_gpus"):
        v = out[key]
        if v is None and key.startswith("num_"):
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v:
            raise ConfigError(f"{where}.{key}: expected a non-negative number, got {v!r}")
    if out["client_cpus"] < 1 or out["client_cpus"] != int(out["client_cpus"]):
        raise ConfigError(f"{where}.client_cpus: expected a whole number of cores >= 1, got {out['client_cpus']!r}")
    out["client_cpus"] = int(out["client_cpus"])
    wait = out["connect_timeout"]
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 < wait < float("inf"):
        raise ConfigError(f"{where}.connect_timeout: expected the seconds every simulated node has to answer its "
                          f"hello, a positive number, got {wait!r}")
    out["connect_timeout"] = float(wait)
    return out


def check_secure_aggregation(value: Any, num_clients: int, where: str = "fl.secure_aggregation"
                             ) -> dict[str, Any] | None:
    """Check ``fl.secure_aggregation`` (``false``/``null``: off, ``true``: the defaults, or a dict
    of :data:`SECURE_AGGREGATION_DEFAULTS` keys) and return it with every key filled in
    (``None`` when off).

    Raises:
        ConfigError: an unknown key or a value out of range, naming it and what is expected.
    """
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        value = read_bool(value, where)   # "--fl#secure_aggregation true" through MONAI's CLI
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected true, false or a dict like {{\"num_shares\": 1.0, "
                          f"\"reconstruction_threshold\": 0.67}}, got {value!r}")
    _check_keys(value, SECURE_AGGREGATION_DEFAULTS, where)
    out = {**SECURE_AGGREGATION_DEFAULTS, **value}

    def count_or_fraction(key: str, least: int) -> None:
        v = out[key]
        ok = not isinstance(v, bool) and ((isinstance(v, int) and v >= least)
                                          or (isinstance(v, float) and 0 < v <= 1))
        if not ok:
            raise ConfigError(f"{where}.{key}: expected an integer >= {least} or a fraction in (0, 1], got {v!r}")

    count_or_fraction("num_shares", 3)
    count_or_fraction("reconstruction_threshold", 2)
    if (isinstance(out["num_shares"], int) and isinstance(out["reconstruction_threshold"], int)
            and out["reconstruction_threshold"] > out["num_shares"]):
        raise ConfigError(f"{where}: reconstruction_threshold {out['reconstruction_threshold']} is more than "
                          f"num_shares {out['num_shares']} (a secret is split into num_shares shares)")
    clip = out["clipping_range"]
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < float("inf"):
        raise ConfigError(f"{where}.clipping_range: expected a positive number, got {clip!r}")
    out["clipping_range"] = float(clip)
    q = out["quantization_range"]
    if isinstance(q, bool) or not isinstance(q, int) or q < 2:
        raise ConfigError(f"{where}.quantization_range: expected an integer >= 2, got {q!r}")
    if (q + 1) * max(int(num_clients), 1) > SECURE_AGGREGATION_MODULUS:
        raise ConfigError(f"{where}.quantization_range: {q} levels summed over {num_clients} clients overflow "
                          f"SecAgg+'s modulus 2**32; expected at most {SECURE_AGGREGATION_MODULUS // num_clients - 1}")
    return out


#: The keys of ``fl.early_stopping`` and their defaults (:func:`check_early_stopping`).
EARLY_STOPPING_DEFAULTS: dict[str, Any] = {
    "metric": "val/micro_f1",   # <split>/<metric>: a split of eval_splits, a column of metrics.csv
    "patience": 5,              # evaluated rounds without improvement before the run stops
    "min_delta": 0.0,           # an improvement is more than this
    "mode": None,               # "max", "min"; null: "min" for a lower-is-better metric, else "max"
    "min_rounds": 0,            # never stop before this round
}

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
    out = _optional_section(value, defaults, where, f'{{"under_dp": "{choices[-1]}"}}')
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
    from medfl.messages import RELEASE_FLAG

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


def check_absences(value: Any, rounds: int, where: str = "fl.absences") -> dict[str, dict[str, list[str]]] | None:
    """Check a scripted absence schedule: ``None`` (no schedule), or ``{round: clients}``
    where ``round`` is an integer from 1 to ``rounds`` (a JSON key: ``"3"``) and ``clients``
    is a list of client ids absent from every exchange of that round, or a dict
    ``{phase: [client ids]}`` naming the exchanges (:data:`ABSENCE_PHASES`) they miss, e.g.
    ``{"3": ["1"], "7": {"train": ["2"], "evaluate": ["2", "4"]}}``. A client absent from
    an exchange is not asked in it, exactly as a site that dropped out of it over Flower
    (:meth:`medfl.engine.screening.Screening.asked`); which ids exist is checked by the run against
    its partition.

    Returns:
        ``{"<round>": {phase: sorted client ids}}`` with every phase present, or ``None``.

    Raises:
        ConfigError: naming the round, phase or client that is wrong and what was expected.
    """
    if value is None:
        return None
    example = '{"3": ["1"], "7": {"train": ["2"], "evaluate": ["2", "4"]}}'
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected null or {{round: [client ids]}} like {example}, got {value!r:.80}")
    out: dict[str, dict[str, list[str]]] = {}
    for key, clients in value.items():
        text = str(key).strip()
        if isinstance(key, bool) or not text.isdigit() or not 1 <= int(text) <= rounds:
            raise ConfigError(f"{where}: round {key!r}: expected a round number from 1 to fl.rounds ({rounds})")
        here = f"{where}[{text}]"
        if isinstance(clients, list):
            clients = {phase: clients for phase in ABSENCE_PHASES}
        if not isinstance(clients, dict):
            raise ConfigError(f"{here}: expected a list of client ids or {{phase: [client ids]}} with phases "
                              f"{', '.join(ABSENCE_PHASES)}, got {clients!r:.80}")
        unknown = sorted(set(clients) - set(ABSENCE_PHASES))
        if unknown:
            raise ConfigError(f"{here}: unknown exchange(s) {unknown}; valid: {', '.join(ABSENCE_PHASES)}")
        phases: dict[str, list[str]] = {}
        for phase in ABSENCE_PHASES:
            ids = clients.get(phase, [])
            if (not isinstance(ids, list) or any(isinstance(c, bool) or not isinstance(c, (str, int)) for c in ids)):
                raise ConfigError(f"{here}.{phase}: expected a list of client ids like [\"0\", \"2\"], got {ids!r:.80}")
            names = [str(c) for c in ids]
            if len(set(names)) != len(names):
                raise ConfigError(f"{here}.{phase}: a client is listed twice in {names}")
            phases[phase] = sorted(names)
        out[str(int(text))] = phases
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


#: Splits of ``fl.eval_splits`` that are test data: selecting the best round on one of them
#: is test-set leakage (allowed, warned and recorded).
TEST_SPLITS = ("test", "global_test", "cross_test")

#: Columns of ``metrics.csv`` besides the registered metrics that a run can stop on: the
#: evaluation memory's negative flips (lower is better).
_MEMORY_METRICS = ("neg_flips", "neg_flip_rate")


def check_early_stopping(value: Any, eval_splits: list[str], where: str = "fl.early_stopping"
                         ) -> dict[str, Any] | None:
    """Check an ``early_stopping`` section on its own and fill its defaults.

    Args:
        value: ``None`` (no early stopping) or a dict with keys of
            :data:`EARLY_STOPPING_DEFAULTS`: ``metric`` (``"<split>/<metric>"``: a split of
            ``eval_splits`` as it is named there, ``val``, ``test``, ``global_test``...,
            and a registered metric or ``neg_flips``/``neg_flip_rate``), ``patience`` (an
            integer >= 1: evaluated rounds), ``min_delta`` (a finite number >= 0), ``mode``
            (``"max"``, ``"min"`` or ``None``) and ``min_rounds`` (an integer >= 0).
        eval_splits: the run's ``fl.eval_splits``.
        where: the key named in error messages.

    Returns:
        ``None`` when early stopping is off, else a new dict with every key, ``mode``
        resolved (``None``: ``"min"`` for a lower-is-better metric, else ``"max"``).

    Raises:
        ConfigError: an unknown key or a bad value; the message names ``<where>.<key>`` and
            what was expected.
    """
    from medfl.metrics.forgetting import LOWER_IS_BETTER

    out = _optional_section(value, EARLY_STOPPING_DEFAULTS, where, '{"metric": "val/micro_f1", "patience": 5}')
    if out is None:
        return None
    metric = out["metric"]
    split, _, name = metric.partition("/") if isinstance(metric, str) else ("", "", "")
    if not split or not name:
        raise ConfigError(f"{where}.metric: expected \"<split>/<metric>\" like \"val/micro_f1\", got {metric!r}")
    if split not in eval_splits:
        raise ConfigError(f"{where}.metric: {metric!r} selects on split {split!r}, which the run does not evaluate; "
                          f"add {split!r} to fl.eval_splits (now {list(eval_splits)}) or pick one of them "
                          "(splits as eval_splits names them: val, test, global_test, cross_test...)")
    names = sorted(registry()["metric"]) + list(_MEMORY_METRICS)
    if name not in names:
        raise ConfigError(f"{where}.metric: unknown metric {name!r} in {metric!r}; valid: {', '.join(names)}")
    for key, low in (("patience", 1), ("min_rounds", 0)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{where}.{key}: expected an integer >= {low}, got {v!r}")
    d = out["min_delta"]
    if isinstance(d, bool) or not isinstance(d, Real) or not math.isfinite(d) or d < 0:
        raise ConfigError(f"{where}.min_delta: expected a finite number >= 0 (how much better than the best a "
                          f"round must be to count as an improvement), got {d!r}")
    out["min_delta"] = float(d)
    if out["mode"] not in (None, "max", "min"):
        raise ConfigError(f"{where}.mode: expected \"max\" (higher is better), \"min\" or null (from the metric), "
                          f"got {out['mode']!r}")
    if out["mode"] is None:
        out["mode"] = "min" if name in LOWER_IS_BETTER else "max"
    return out


def check_tracking(value: Any, where: str = "fl.tracking") -> list[dict[str, Any]]:
    """Check ``fl.tracking``: a list of tracker names or ``{"name": ..., **options}`` entries.

    Returns:
        The entries as dicts, each with its name (an empty list for ``None``).

    Raises:
        ConfigError: not a list, an entry without a registered tracker name (the registered
            ones are listed), an option the tracker does not have, a ``per_client`` that is
            not true or false (:func:`read_bool`), or a tracker twice.
    """
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list like [{{\"name\": \"mlflow\", \"uri\": null}}, "
                          f"{{\"name\": \"tensorboard\"}}], got {value!r}")
    table = registry()["tracker"]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        entry = {"name": item} if isinstance(item, str) else item
        here = f"{where}[{i}]"
        if not isinstance(entry, dict) or entry.get("name") not in table:
            got = entry.get("name") if isinstance(entry, dict) else item
            raise ConfigError(f"{here}: unknown tracker {got!r}; registered trackers: "
                              f"{', '.join(sorted(table)) or '(none)'}")
        cls = table[entry["name"]].obj
        unknown = sorted(set(entry) - {"name"} - set(getattr(cls, "options", {})))
        if unknown:
            raise ConfigError(f"{here} ({entry['name']}): unknown key(s) {', '.join(map(repr, unknown))}; valid "
                              f"keys: {', '.join(['name', *sorted(getattr(cls, 'options', {}))])}")
        if "per_client" in entry:   # the bundle CLI hands over a JSON true as the word
            entry = {**entry, "per_client": read_bool(entry["per_client"], f"{here} ({entry['name']}).per_client")}
        missing = [pkg for pkg in getattr(cls, "requires", ()) if importlib.util.find_spec(pkg) is None]
        if missing:
            raise ConfigError(f"{here}: the {entry['name']!r} tracker needs {', '.join(map(repr, missing))}, which "
                              "is not installed; install it with: pip install \"medfl[tracking]\"")
        if any(e["name"] == entry["name"] for e in out):
            raise ConfigError(f"{here}: tracker {entry['name']!r} is named twice")
        out.append(dict(entry))
    return out


def check_min_sites(cfg: dict[str, Any]) -> None:
    """Check ``fl.min_sites`` (an integer from 1 to ``num_clients``), ``fl.min_fraction``
    (null or a number in (0, 1]) and ``fl.site_wait_s`` (a number of seconds >= 0): the
    quorum a round needs (:func:`medfl.engine.screening.sites_needed`).

    Raises:
        ConfigError: one of them is out of range, naming it and what is expected.
    """
    n, low = cfg["min_sites"], cfg["num_clients"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= low:
        raise ConfigError(f"fl.min_sites: expected an integer from 1 to fl.num_clients ({low}): the fewest sites "
                          f"whose answers a round needs, got {n!r}")
    f = cfg["min_fraction"]
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
        raise ConfigError(f"fl.min_fraction: expected null or a number in (0, 1]: the share of a round's sites "
                          f"whose answers it needs, got {f!r}")
    w = cfg["site_wait_s"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
        raise ConfigError(f"fl.site_wait_s: expected a number of seconds >= 0: how long a Flower round waits for "
                          f"enough sites, got {w!r}")


def check_device(device: Any, where: str = "fl.device", *, available: bool = False) -> str:
    """Check a torch device name (``cpu``, ``cuda``, ``cuda:N``, ``mps``); with ``available``,
    also that this machine has it (in-process runs check before anything is written).

    Raises:
        ConfigError: a name torch does not parse, or a device this machine lacks.
    """
    import torch

    try:
        dev = torch.device(str(device))
    except (RuntimeError, ValueError):
        raise ConfigError(f"{where}: {device!r} is not a device; expected cpu, cuda, cuda:N or mps") from None
    if available and dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index or 0) >= n:
            raise ConfigError(f"{where}: {device!r} but this machine has {n} CUDA device(s)"
                              + (f" (cuda:0 .. cuda:{n - 1})" if n else "; use cpu"))
    if available and dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{where}: 'mps' but this machine has no MPS device; use cpu")
    return str(device)


def _check_entry(cfg: dict[str, Any], m: dict[str, Any], where: str) -> None:
    """Check a method entry's ``train`` overrides, its DP-SGD support and its filter chain
    (the method's own default filters in front of the configured ones)."""
    from medfl.filters import FilterConfigError, configured_filters
    from medfl.privacy.accounting import PrivacyConfigError

    if "train" in m:
        if not isinstance(m["train"], dict):
            raise ConfigError(f"{where}.train: expected a dict of fl.train overrides, got {m['train']!r}")
        _check_keys(m["train"], {**DEFAULTS["train"], **TRAIN_OPTIONAL}, f"{where}.train")
        check_train(m["train"], f"{where}.train")
        if "dp" in m["train"]:
            m["train"]["dp"] = check_dp_sgd(m["train"]["dp"], f"{where}.train.dp")
    method = build_method(m)
    cls = type(method)
    preset = method_preset(m)
    if preset is not None and preset.train:
        _check_keys(preset.train, {**DEFAULTS["train"], **TRAIN_OPTIONAL}, f"{where}: preset {m['preset']!r}'s train")
    if "train" in m or (preset is not None and preset.train):
        check_train(method_train(cfg, m, cls), f"{where}.train")
    if method_train(cfg, m, cls)["dp"] is not None and not cls.supports_dp_sgd:
        raise ConfigError(f"{where}: method {cls.name!r} does not support DP-SGD (train.dp): its local training "
                          "is not plain per-sample-loss SGD that Opacus can privatise (see its docstring); use a "
                          "reply filter such as dp_gaussian, or an entry's own \"train\": {\"dp\": null}")
    if method_train(cfg, m, cls)["dp"] is not None and method_train(cfg, m, cls).get("amp"):
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
    from medfl.method import Method

    model_dp = (bool(chain.releases()) or method_train(cfg, m, cls)["dp"] is not None
                or cls.own_dp is not Method.own_dp)
    private = model_dp or method.release_plan() is not None
    cross_test_in_clear(cfg, private, where)
    if model_dp:   # entries beside the noised model, as the method declares a plain reply's keys
        from medfl.messages import Instruction

        keys = uncovered_keys(method, Instruction(payload={}, config={}))
        if keys:
            uncovered_in_clear(cfg, keys, cls.name, where)


def _check_parameters(kind: str, spec: dict[str, Any], where: str, skip: tuple[str, ...] = (),
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
    _check_keys(fl, {**DEFAULTS, **FL_OPTIONAL}, "fl")
    pins = check_plugin_names(fl.get("plugin_names"))
    with pinned_names(pins):
        cfg = _resolve_config(fl)
        try:
            cfg["plugin_names"] = plugin_names(cfg)
        except PluginError as exc:
            raise ConfigError(str(exc)) from exc
    return cfg


def _resolve_config(fl: dict[str, Any]) -> dict[str, Any]:
    """:func:`resolve_config`'s checks (``fl``: a dict of known keys)."""
    cfg = copy.deepcopy(DEFAULTS)
    for key, value in fl.items():
        if key == "train":
            if not isinstance(value, dict):
                raise ConfigError(f"fl.train: expected a dict, got {value!r}")
            _check_keys(value, {**DEFAULTS["train"], **TRAIN_OPTIONAL}, "fl.train")
            cfg["train"].update(value)
        elif key == "cv":
            if not isinstance(value, dict):
                raise ConfigError(f"fl.cv: expected a dict like {{'folds': 5}}, got {value!r}")
            _check_keys(value, DEFAULTS["cv"], "fl.cv")
            cfg["cv"].update(value)
        elif key in _NAMED:
            cfg[key] = _named(value, f"fl.{key}")
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
    cfg["methods"] = [_named(m, f"fl.methods[{i}]") for i, m in enumerate(methods)]
    labels = [method_label(m) for m in cfg["methods"]]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"fl.methods: two entries share a name {labels}; give one a 'label'")
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
    try:
        for kind, key in (("dataset", "dataset"), ("partitioner", "partition"), ("model", "model")):
            _check_parameters(kind, cfg[key], f"fl.{key}", skip=("dp_compatible",) if kind == "model" else ())
        for i, m in enumerate(cfg["methods"]):
            read_plugin_values(inspect.signature(lookup("method", m["name"]).__init__).parameters, m,
                               f"fl.methods[{i}]", skip=ENTRY_KEYS, sizes=False)
            build_method(m)  # checks parameter names now, before any work
    except (PluginError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    cfg["public_dataset"] = check_public_dataset(cfg["public_dataset"], cfg)
    cfg["train"]["dp"] = check_dp_sgd(cfg["train"]["dp"], "fl.train.dp")
    if not isinstance(cfg["filters"], list):
        raise ConfigError(f"fl.filters: expected a list of filters like [{{\"name\": \"quantize\", \"bits\": 8}}], "
                          f"got {cfg['filters']!r}")
    if "secure_aggregation" in cfg:
        cfg["secure_aggregation"] = check_secure_aggregation(cfg["secure_aggregation"], cfg["num_clients"])
    if "cross_test" in cfg:
        cfg["cross_test"] = check_cross_test(cfg["cross_test"])
    if "uncovered_entries" in cfg:
        cfg["uncovered_entries"] = check_uncovered_entries(cfg["uncovered_entries"])
    if "absences" in cfg:
        cfg["absences"] = check_absences(cfg["absences"], cfg["rounds"])
    if "threads" in cfg:
        cfg["threads"] = check_threads(cfg["threads"])
    if "tracking" in cfg:
        cfg["tracking"] = check_tracking(cfg["tracking"])
    for i, m in enumerate(cfg["methods"]):
        _check_entry(cfg, m, f"fl.methods[{i}] ({method_label(m)})")
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
            _check_parameters("model", override, f"fl.client_models.{cid}", skip=("dp_compatible",),
                              name=override.get("name", cfg["model"]["name"]))
    except PluginError as exc:
        raise ConfigError(str(exc)) from exc
    for where, spec in (("fl.model", cfg["model"]), *((f"fl.client_models.{c}", o) for c, o in cm.items())):
        if "dp_compatible" in spec:   # the engine's own key of a model spec (medfl.models.registry)
            spec["dp_compatible"] = read_bool(spec["dp_compatible"], f"{where}.dp_compatible")
    metrics = registry()["metric"]  # also makes sure every plugin loaded cleanly
    if folds and cv["metric"] not in metrics:
        raise ConfigError(f"fl.cv.metric: unknown metric {cv['metric']!r}; valid: {', '.join(sorted(metrics))}")
    cfg["early_stopping"] = check_early_stopping(cfg["early_stopping"], list(cfg["eval_splits"]))
    if cfg["early_stopping"] is not None and cfg["eval_every"] == 0:
        raise ConfigError("fl.early_stopping: decides on rounds evaluated along the way, but fl.eval_every is 0 "
                          "(only the last round is evaluated); set fl.eval_every (e.g. 1) or fl.early_stopping null")
    return cfg


# ---------------------------------------------------------------------------- torch threads

__all__ += ["THREADS_AUTO", "THREADS_ENV", "LOCAL_SITES_ENV", "check_threads", "available_cores", "sharing_processes",
            "auto_threads", "threads_setting", "resolve_threads", "set_threads", "local_sites", "actor_threads", "threads_record"]

#: The ``fl.threads`` value that divides the cores among the processes training on them.
THREADS_AUTO = "auto"
#: Environment variable with the ``--threads`` of the command line: it wins over ``fl.threads``
#: (so ``medfl resume --threads 1`` applies to a run whose saved config says otherwise) and
#: reaches the processes a command starts (a Flower site's worker).
THREADS_ENV = "MEDFL_THREADS"
#: Environment variable set in each Flower site process that ``medfl`` starts together with
#: others on one machine (``LocalFederation`` of the tests): how many there are.
LOCAL_SITES_ENV = "MEDFL_LOCAL_SITES"


def check_threads(value: Any, where: str = "fl.threads") -> int | str:
    """Check a threads setting: a positive integer (a string of digits too, as a command line
    gives it) or ``"auto"``.

    Returns:
        The number of threads as an ``int``, or ``"auto"``.

    Raises:
        ConfigError: anything else (0, a negative number, a fraction, a boolean, another word).
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, str) and value.strip().lower() == THREADS_AUTO:
        return THREADS_AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected a positive number of torch threads or \"auto\" (the cores this "
                          f"process may use divided among the processes training on them), got {value!r}")
    return value


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the platform has one
    (a container or ``taskset`` limit shows there, not in ``os.cpu_count()``), else every core."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # macOS, Windows
        return max(1, os.cpu_count() or 1)


def sharing_processes(processes: int = 1) -> int:
    """How many processes train on this machine's cores at once, counting ``processes`` of the
    job itself (1 in process; the concurrent Ray actors; ``MEDFL_LOCAL_SITES`` Flower sites that
    ``medfl`` started together) times the pytest-xdist workers (``PYTEST_XDIST_WORKER_COUNT``)
    when running under them."""
    return max(1, int(processes)) * _env_count("PYTEST_XDIST_WORKER_COUNT")


def _env_count(name: str) -> int:
    """The positive integer in environment variable ``name``; 1 when unset or not one."""
    import os

    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def local_sites() -> int:
    """How many Flower sites ``medfl`` started together on this machine (``MEDFL_LOCAL_SITES``,
    set by ``LocalFederation`` of the tests; 1 when unset): the processes a
    site's ``"auto"`` threads are shared with."""
    return _env_count(LOCAL_SITES_ENV)


def actor_threads(cfg: dict[str, Any], clients: int) -> int:
    """Torch threads of each Ray actor of the simulation backend (``fl.backend`` ``ray``):
    ``fl.threads`` (or ``--threads``) when a number, else ``"auto"`` over the actors that run at
    once, ``min(clients, cores Ray may use // client_cpus)`` (Ray's ``num_cpus``, default every
    core this process may use)."""
    setting = threads_setting(cfg.get("threads"))
    if setting != THREADS_AUTO:
        return int(setting)
    backend = cfg["backend"]
    cores = int(backend.get("num_cpus") or available_cores())
    actors = max(1, min(int(clients), cores // max(1, int(backend.get("client_cpus") or 1))))
    return auto_threads(actors)


def auto_threads(processes: int = 1, cores: int | None = None) -> int:
    """The ``"auto"`` thread count: ``cores`` (default :func:`available_cores`) divided by
    :func:`sharing_processes` ``(processes)``, rounded down, at least 1. Two processes on two
    cores get one thread each instead of two each (which oversubscribes the cores)."""
    return max(1, (available_cores() if cores is None else int(cores)) // sharing_processes(processes))


def threads_setting(value: Any = THREADS_AUTO) -> int | str:
    """The threads setting in force: ``MEDFL_THREADS`` (the command line's ``--threads``) when
    set, else ``value`` (a config's ``fl.threads``; ``None``: ``"auto"``), checked."""
    import os

    env = os.environ.get(THREADS_ENV)
    if env:
        return check_threads(env, f"{THREADS_ENV} (--threads)")
    return check_threads(THREADS_AUTO if value is None else value)


def resolve_threads(value: Any = THREADS_AUTO, processes: int = 1) -> int:
    """The number of torch threads for a process that trains beside ``processes - 1`` others of
    its job: :func:`threads_setting` ``(value)``, with ``"auto"`` worked out by :func:`auto_threads`."""
    setting = threads_setting(value)
    return auto_threads(processes) if setting == THREADS_AUTO else int(setting)


def set_threads(value: Any = THREADS_AUTO, processes: int = 1, *, apply_auto: bool = True) -> int:
    """Set torch's intra-op threads of this process to :func:`resolve_threads` ``(value,
    processes)`` (once per process, before it trains) and return the number in force.

    Args:
        value: ``fl.threads`` (``None``: ``"auto"``); ``MEDFL_THREADS`` (``--threads``) wins.
        processes: the processes of the job training on this machine's cores at once.
        apply_auto: ``False`` leaves torch as it is when the setting is ``"auto"``: what a
            library call (:func:`medfl.experiment.run_experiment`) does, so that a caller's own
            ``torch.set_num_threads`` stands; the process's entry point (``medfl run``, a
            bundle run, a Flower site) applies ``"auto"`` before it.
    """
    import torch

    if not apply_auto and threads_setting(value) == THREADS_AUTO:
        return torch.get_num_threads()
    threads = resolve_threads(value, processes)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def threads_record(value: Any = THREADS_AUTO) -> dict[str, Any]:
    """The ``threads`` block of a run's ``summary.json``: the setting in force
    (:func:`threads_setting`: ``--threads``, else ``fl.threads``, else ``"auto"``) and the torch
    threads of this process, the one that ran the rounds (in process: the one that trained every
    client; over Ray or Flower the coordinator's, each site set its own from the same setting)."""
    import torch

    return {"setting": threads_setting(value), "torch_threads": torch.get_num_threads()}
