"""PFedCDP's settings: the named choices and constants, and how the keyword arguments are read
(:func:`read_settings`: each value checked, a :class:`MethodConfigError` naming it otherwise)."""

from __future__ import annotations

import math
from typing import Any

import torch

from medfl.capability import CLUSTERS, SCORES, assign_cluster, overall_score
from medfl.losses.distill import SUPCON_REDUCTIONS
from medfl.method import MethodConfigError
from medfl_plugins.common import read

__all__ = ["AUTHORS_NOISE_MULTIPLIER", "AUTHORS_TEACHER_WEIGHTS", "AUTHORS_V17_NOISE_MULTIPLIER",
           "DEFAULT_CLUSTER_MODELS", "DP_MODES", "KD_INPUTS", "KD_SCOPES", "SCORES_MODES", "State", "read_settings"]

State = dict[str, torch.Tensor]

#: The paper's models per cluster (section IV.A.2): A for High, B for Medium, C for Low.
DEFAULT_CLUSTER_MODELS: dict[str, dict[str, Any]] = {"high": {"name": "pfedcdp_a"}, "medium": {"name": "pfedcdp_b"},
                                                     "low": {"name": "pfedcdp_c"}}
#: The fixed teacher weights of the authors' code (high, medium, low), kept for comparison only.
AUTHORS_TEACHER_WEIGHTS = (0.4, 0.35, 0.25)
#: The authors' code's calibration at the paper's epsilon 5: ``sqrt(2 ln(1.25 / delta)) /
#: epsilon`` with delta 1e-5 (the classical one-release Gaussian mechanism), drawn afresh every
#: round and never composed (``differential_privacy.py``). Composed over 20 rounds by Opacus's
#: RDP accountant it spends epsilon 31.4 at delta 1e-5. The code itself runs at another
#: epsilon: ``DifferentialPrivacy`` defaults to epsilon 8 (sigma 0.606), and of the v1.7
#: clients only model B's applies it (``DifferentialPrivacy(epsilon=8.0)``, on its weights,
#: each tensor clipped to 2.5, noise 2.5 sigma per coordinate as here); models A and C send
#: their extractors without noise (repository snapshot d7364e07). Per coordinate, this sigma
#: is at least the code's: ``experiments/pfedcdp_evidence.py`` measures both.
AUTHORS_NOISE_MULTIPLIER = math.sqrt(2.0 * math.log(1.25 / 1e-5)) / 5.0
#: The sigma the authors' v1.7 model-B client runs at (``PFedCDP/v1.7/PFedCDP/client1.py``, ``fit``:
#: ``DifferentialPrivacy(epsilon=8.0, delta=1e-5)``): differential_privacy.py's formula (line 17)
#: at epsilon 8, ``sqrt(2 ln(1.25 / 1e-5)) / 8`` = 0.606.
AUTHORS_V17_NOISE_MULTIPLIER = math.sqrt(2.0 * math.log(1.25 / 1e-5)) / 8.0
#: The choices of the settings of the same names (``docs/pfedcdp.md``, "Settings", says what each is).
DP_MODES = ("update", "weights_per_tensor")
KD_SCOPES = ("classifier", "model")
KD_INPUTS = ("logits", "probabilities")
SCORES_MODES = ("personal", "global")
CAPABILITY_MODES = ("auto", "draw", "measure")
SERVER_CLASSIFIER = ("public", "init")
TEACHER_WEIGHTS = ("shapley", "uniform", "fixed")
FEATURE_SHAP = ("off", "printed", "input")
SHAPLEY_SCORES = ("accuracy", "balanced_accuracy", "auc")
QUANTIZE = ("update", "weights")
CLUSTER_AVERAGE = ("weighted", "uniform")
SUPCON_VIEWS = (1, 2)
#: The keywords read by one rule each (:func:`medfl_plugins.common.read`): the choices, an integer's
#: least value, or a number's range as the message says it; those of ``NULLABLE`` may be null.
RULES: dict[str, Any] = {
    "max_latency_ms": "> 0", "fisher_keep": "in [0, 1]", "fisher_batches": 1, "extractor_epochs": 0,
    "kd_lambda": "in [0, 1]", "kd_temperature": "> 0", "server_classifier": SERVER_CLASSIFIER, "server_epochs": 1,
    "kd_scope": KD_SCOPES, "kd_input": KD_INPUTS, "score": SCORES_MODES, "cluster_average": CLUSTER_AVERAGE,
    "grad_clip": "> 0", "epsilon": "> 0", "noise_multiplier": "> 0", "quantize": QUANTIZE, "dp_mode": DP_MODES,
    "clip": "> 0", "supcon_reduction": SUPCON_REDUCTIONS, "refine_epochs": 0, "refine_lr": "> 0",
    "alpha": "in [0, 1]", "refine_temperature": "> 0", "tau": "> 0", "shapley_score": SHAPLEY_SCORES,
    "shapley_samples": 1, "feature_shap": FEATURE_SHAP, "shap_samples": 1, "shap_nsamples": 1,
}
NULLABLE = ("fisher_keep", "fisher_batches", "grad_clip", "epsilon", "noise_multiplier", "shapley_samples")


def _check_clusters(value: Any, name: str, what: str) -> list[str]:
    """``value`` as a list of distinct clusters in ``CLUSTERS``' order (``None``: all of them)."""
    if value is None:
        return list(CLUSTERS)
    if (isinstance(value, str) or not isinstance(value, (list, tuple))
            or set(value) - set(CLUSTERS) or len(set(value)) != len(value)):
        raise MethodConfigError(f"pfedcdp: {name} must be a list of distinct clusters among "
                                f"{', '.join(CLUSTERS)} ({what}), got {value!r}")
    return [c for c in CLUSTERS if c in value]


def read_settings(given: dict[str, Any]) -> dict[str, Any]:
    """PFedCDP's keyword arguments ``given`` as the method holds them, by the same names: each
    checked (a :class:`MethodConfigError` naming it and what to set instead), numbers as floats,
    cluster lists in ``CLUSTERS``' order, ``cluster_models`` and ``student_model`` filled in."""
    r = {k: read("pfedcdp", k, given[k], rule, none=k in NULLABLE, finite=False) for k, rule in RULES.items()}
    return {**r, **_read_clusters(given), **_read_local(given), **_read_privacy(given, r), **_read_refinement(given)}


def _read_clusters(g: dict[str, Any]) -> dict[str, Any]:
    """Eqs. 1-2's capability scores, weights and thresholds, and the cluster models."""
    capabilities, weights = g["capabilities"], g["capability_weights"]
    if isinstance(capabilities, str):
        if capabilities not in CAPABILITY_MODES:
            raise MethodConfigError(f"pfedcdp: capabilities must be one of {', '.join(CAPABILITY_MODES)}, a list "
                                    f"of score dicts or a dict by client id, got {capabilities!r}")
    else:
        entries = capabilities.values() if isinstance(capabilities, dict) else capabilities
        if not isinstance(capabilities, (list, tuple, dict)):
            raise MethodConfigError(f"pfedcdp: capabilities: unexpected {type(capabilities).__name__}")
        for e in entries:
            try:
                overall_score(dict(e), weights)
            except (TypeError, ValueError) as exc:
                raise MethodConfigError(f"pfedcdp: capabilities: {exc}") from None
    try:
        overall_score({k: 1.0 for k in SCORES}, weights)
        assign_cluster(0.5, float(g["t_high"]), float(g["t_medium"]))
    except (TypeError, ValueError) as exc:
        raise MethodConfigError(f"pfedcdp: {exc}") from None
    models = dict(DEFAULT_CLUSTER_MODELS)
    cluster_models = g["cluster_models"]
    if cluster_models is not None:
        if not isinstance(cluster_models, dict) or set(cluster_models) - set(CLUSTERS):
            raise MethodConfigError(f"pfedcdp: cluster_models must map some of {', '.join(CLUSTERS)} to model "
                                    f"specs, got {cluster_models!r}")
        for c, spec in cluster_models.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise MethodConfigError(f"pfedcdp: cluster_models[{c!r}] must be a model spec with a 'name'")
            models[c] = dict(spec)
    return {"capabilities": capabilities, "capability_weights": [float(w) for w in weights],
            "t_high": float(g["t_high"]), "t_medium": float(g["t_medium"]), "cluster_models": models}


def _read_local(g: dict[str, Any]) -> dict[str, Any]:
    """Algorithm 1's local steps: Fisher masks, the extractor's epochs, eq. 11, the server
    classifier, what is scored."""
    if (g["fisher_keep"] is None) == (g["fisher_threshold"] is None):
        raise MethodConfigError("pfedcdp: give exactly one of fisher_keep (a fraction, e.g. 0.2) or "
                                "fisher_threshold (T_Fisher); set the other to null")
    if not isinstance(g["apply_masks"], bool):
        raise MethodConfigError(f"pfedcdp: apply_masks must be true or false, got {g['apply_masks']!r}")
    cluster_lr = g["cluster_lr"]
    if cluster_lr is not None:
        if not isinstance(cluster_lr, dict) or set(cluster_lr) - set(CLUSTERS):
            raise MethodConfigError(f"pfedcdp: cluster_lr must map some of {', '.join(CLUSTERS)} to a learning "
                                    f"rate > 0 or null (train.lr), got {cluster_lr!r}")
        cluster_lr = {c: read("pfedcdp", f"cluster_lr[{c!r}]", cluster_lr.get(c), "> 0", none=True, finite=False)
                      for c in CLUSTERS}
    return {
        "fisher_threshold": None if g["fisher_threshold"] is None else float(g["fisher_threshold"]),
        "apply_masks": g["apply_masks"], "cluster_lr": cluster_lr,
        "kd_clusters": _check_clusters(g["kd_clusters"], "kd_clusters", "the clusters whose clients train on "
                                       "eq. 11; the others train on cross-entropy alone"),
    }


def _read_privacy(g: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """Eqs. 12-15 and the authors' release: the noise, where it goes, the quantization (``r``:
    the keywords of :data:`RULES` as read)."""
    epsilon, noise_multiplier, quantize, dp_mode = r["epsilon"], r["noise_multiplier"], r["quantize"], r["dp_mode"]
    if epsilon is not None and noise_multiplier is not None:
        raise MethodConfigError(f"pfedcdp: give exactly one of epsilon (a target over the run; sigma is derived) "
                                f"or noise_multiplier (sigma of every round; the run records the epsilon it "
                                f"spends), and set the other to null; got epsilon {g['epsilon']!r} and "
                                f"noise_multiplier {g['noise_multiplier']!r}")
    dp = epsilon is not None or noise_multiplier is not None
    dp_clusters = _check_clusters(g["dp_clusters"], "dp_clusters", "the clusters whose extractors are noised")
    if dp_mode == "update" and dp and len(dp_clusters) != len(CLUSTERS):
        raise MethodConfigError(f"pfedcdp: dp_clusters {dp_clusters} needs dp_mode 'weights_per_tensor': "
                                "dp_mode 'update' noises the update with the engine's dp_gaussian filter, which "
                                "every client applies")
    if dp_mode == "weights_per_tensor":
        if epsilon is not None:
            raise MethodConfigError(f"pfedcdp: dp_mode 'weights_per_tensor' (the authors' noise on the weights, "
                                    f"preset authors_v1_7) takes sigma as noise_multiplier (the authors' code has "
                                    f"no accountant; the run records the epsilon spent), got epsilon "
                                    f"{g['epsilon']!r}; for a target epsilon use dp_mode 'update' with dp_clusters "
                                    "of all three clusters and quantize 'update' (eqs. 12-14, preset paper)")
        if quantize != "weights":
            raise MethodConfigError("pfedcdp: dp_mode 'weights_per_tensor' sends noised weights, so what is "
                                    "quantized is the weights: set quantize 'weights'")
    elif quantize == "weights" and dp:
        raise MethodConfigError("pfedcdp: quantize 'weights' needs the update without DP (dp_gaussian makes the "
                                "chain send the noised update, which is what is quantized); set epsilon and "
                                "noise_multiplier to null, or quantize 'update'")
    return {"dp_clusters": dp_clusters, "delta": float(g["delta"]), "accountant": str(g["accountant"]),
            "bits": _read_bits(g["bits"], quantize)}


def _read_bits(bits: Any, quantize: str) -> int | dict[str, int | None] | None:
    """Eq. 14's bits: one number (or ``None``: floats), or one per cluster (the authors' code)."""
    def bad(b: Any) -> bool:
        return b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 16)

    if isinstance(bits, dict):
        if set(bits) != set(CLUSTERS) or any(bad(b) for b in bits.values()):
            raise MethodConfigError(f"pfedcdp: bits per cluster must map each of {', '.join(CLUSTERS)} to an "
                                    f"integer from 1 to 16 or null, got {bits!r}")
        if quantize != "weights":
            raise MethodConfigError("pfedcdp: bits per cluster quantizes in the client step, on the weights "
                                    "(the authors' code): set quantize 'weights'")
        return {c: bits[c] for c in CLUSTERS}
    if bad(bits):
        raise MethodConfigError(f"pfedcdp: bits must be an integer from 1 to 16, null, or one of those per "
                                f"cluster, got {bits!r}")
    return bits


def _read_refinement(g: dict[str, Any]) -> dict[str, Any]:
    """Algorithm 2's post-hoc refinement: the student, eqs. 17-18, the teacher weights, eqs. 16 and 19."""
    supcon_views, teacher_weights = g["supcon_views"], g["teacher_weights"]
    if supcon_views not in SUPCON_VIEWS or isinstance(supcon_views, bool):
        raise MethodConfigError(f"pfedcdp: supcon_views must be 1 or 2 (two augmented views of each public "
                                f"sample, eq. 17's 2N), got {supcon_views!r}")
    if isinstance(teacher_weights, str):
        if teacher_weights not in TEACHER_WEIGHTS:
            raise MethodConfigError(f"pfedcdp: teacher_weights must be one of {', '.join(TEACHER_WEIGHTS)} or a "
                                    f"list of numbers, got {teacher_weights!r}")
    elif not (isinstance(teacher_weights, (list, tuple)) and teacher_weights
              and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in teacher_weights)
              and sum(teacher_weights) > 0):
        raise MethodConfigError(f"pfedcdp: teacher_weights list must hold non-negative numbers with a positive "
                                f"sum, got {teacher_weights!r}")
    return {"supcon_views": int(supcon_views), "refine": bool(g["refine"]),
            "student_model": dict(g["student_model"] or {"name": "pfedcdp_student"}),
            "teacher_weights": (teacher_weights if isinstance(teacher_weights, str)
                                else [float(w) for w in teacher_weights])}
