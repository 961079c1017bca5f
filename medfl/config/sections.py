"""The ``fl`` sections checked on their own: local training (``train`` and its DP-SGD
``dp``), the device, the backend, secure aggregation, scripted absences, early stopping, the
trackers, the quorum of sites and the opt-ins of a private run. Each check fills the section's defaults in, or raises
:class:`~medfl.config_values.ConfigError` naming the key and what was expected."""

from __future__ import annotations

import importlib.util
import math
from numbers import Real
from typing import Any

import torch

from medfl.config_values import BOOL_WORDS, ConfigError, check_keys, optional_section, read_bool
from medfl.plugins import PluginError, registry
from medfl.privacy.accounting import PrivacyConfigError, check_accountant, check_delta, check_positive

__all__ = ["ABSENCE_PHASES", "SECURE_AGGREGATION_DEFAULTS", "SECURE_AGGREGATION_MODULUS", "AMP_DTYPES",
           "DP_SGD_DEFAULTS", "check_dp_sgd", "OPTIMIZERS", "check_train", "BACKEND_DEFAULTS", "check_backend",
           "check_secure_aggregation", "EARLY_STOPPING_DEFAULTS", "check_absences", "TEST_SPLITS",
           "check_early_stopping", "check_tracking", "check_min_sites", "check_device", "UNDER_DP", "check_under_dp"]


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


#: Keys of ``train.dp`` (DP-SGD) and their defaults; ``epsilon`` or ``noise_multiplier``.
DP_SGD_DEFAULTS: dict[str, Any] = {"epsilon": None, "noise_multiplier": None, "max_grad_norm": 1.0,
                                   "delta": 1e-5, "accountant": "rdp"}


def check_dp_sgd(dp: Any, where: str) -> dict[str, Any] | None:
    """Check a ``train.dp`` section (DP-SGD) on its own and fill its defaults.

    Returns:
        ``None`` when DP-SGD is off, else the section with every key of
        :data:`DP_SGD_DEFAULTS`.

    Raises:
        ConfigError: unknown key, neither or both of ``epsilon`` and ``noise_multiplier``,
            epsilon <= 0, delta outside (0, 1), max_grad_norm <= 0, an unknown accountant.
    """
    out = optional_section(dp, DP_SGD_DEFAULTS, where, '{"epsilon": 3, "max_grad_norm": 1.0}')
    if out is None:
        return None
    try:
        if (out["epsilon"] is None) == (out["noise_multiplier"] is None):
            raise ConfigError(f"{where}: give exactly one of epsilon (a target, the noise is derived) and "
                              f"noise_multiplier; got epsilon={out['epsilon']!r}, "
                              f"noise_multiplier={out['noise_multiplier']!r}")
        for key in ("epsilon" if out["epsilon"] is not None else "noise_multiplier", "max_grad_norm"):
            out[key] = check_positive(out[key], key, where)
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
    expected = (f"{where}: expected one of {', '.join(map(repr, registry()['backend']))} or "
                f"{{\"name\": \"ray\", \"client_cpus\": 1, \"client_gpus\": 0}}, got {value!r}")
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ConfigError(expected)
    try:
        registry().resolve("backend", entry["name"])   # bare or qualified (dist:name)
    except PluginError as exc:
        raise ConfigError(f"{where}: {exc}" if not str(exc).startswith("unknown")   # ambiguous, or refused
                          else expected) from exc
    check_keys(entry, BACKEND_DEFAULTS, where)
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
    check_keys(value, SECURE_AGGREGATION_DEFAULTS, where)
    out = {**SECURE_AGGREGATION_DEFAULTS, **value}

    def count_or_fraction(key: str, least: int) -> None:
        v = out[key]
        ok = not isinstance(v, bool) and ((isinstance(v, int) and v >= least) or (isinstance(v, float) and 0 < v <= 1))
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


def check_early_stopping(value: Any, eval_splits: list[str], where: str = "fl.early_stopping") -> dict[str, Any] | None:
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

    out = optional_section(value, EARLY_STOPPING_DEFAULTS, where, '{"metric": "val/micro_f1", "patience": 5}')
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


#: The opt-in sections of a run with differential privacy (``fl.<key>: {"under_dp": CHOICE}``;
#: absent: off) and their choices, the default first. ``cross_test``: ``"refuse"`` (a run with
#: differential privacy and ``cross_test`` is refused before round 1) or ``"send_models"`` (every
#: client's evaluation model is sent in the clear for cross-site scoring, and the run's privacy
#: record says it is not private). ``uncovered_entries``: ``"refuse"`` (a run whose model is
#: noised, by a DP filter, DP-SGD or the method's own DP, and whose replies carry entries beside
#: the model that no mechanism covers is refused before anything is sent) or ``"send_in_clear"``
#: (the entries are sent, and the run's privacy record says it is not private).
UNDER_DP: dict[str, tuple[str, ...]] = {"cross_test": ("refuse", "send_models"),
                                        "uncovered_entries": ("refuse", "send_in_clear")}


def check_under_dp(key: str, value: Any) -> dict[str, Any] | None:
    """Check the opt-in section ``fl.<key>`` (a key of :data:`UNDER_DP`): ``None``, or ``{"under_dp": CHOICE}``.

    Raises:
        ConfigError: not a dict, an unknown key, or ``under_dp`` not one of the key's choices.
    """
    choices, where = UNDER_DP[key], f"fl.{key}"
    out = optional_section(value, {"under_dp": choices[0]}, where, f'{{"under_dp": "{choices[-1]}"}}')
    if out is not None and out["under_dp"] not in choices:
        raise ConfigError(f"{where}.under_dp: expected one of {', '.join(map(repr, choices))}, got {out['under_dp']!r}")
    return out
