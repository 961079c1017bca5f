"""PFedCDP (paper 000): capability clusters, Fisher-masked personalisation, classifier KD,
private quantized extractor updates, and post-hoc Shapley-weighted multi-teacher distillation
with supervised contrastive learning on the coordinator's public set.

The method is :class:`PFedCDP`; its docstring gives the algorithm step by step, the choices
where the paper is silent or inconsistent, and where the authors' code is known to be wrong.
The pieces live where other methods can reuse them: capability scores and clusters in
:mod:`medfl.capability`, the losses in :mod:`medfl.losses.distill`, Shapley values in
:mod:`medfl.shapley`, the paper's CNNs in :mod:`medfl.models.cnn`, the DP and quantization
in the built-in ``dp_gaussian`` and ``quantize`` filters (:mod:`medfl_plugins.privacy`).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl import hookimpl
from medfl.capability import CLUSTERS, SCORES, assign_cluster, draw_capabilities, measure_capabilities, overall_score
from medfl.training import (StepMeans, get_state, make_optimizer, predict_proba, train_epochs,
                                   weighted_average)
from medfl.losses.distill import SUPCON_REDUCTIONS, ensemble_logits, kd_loss, sup_mtkd_loss, two_views
from medfl.messages import Instruction, Reply
from medfl.method import ENGINE_TRAIN_METRICS, Federation, Method, MethodConfigError, OwnDp, Preset, derive_seed
from medfl.metrics import classification_metrics
from medfl.models.registry import build_seeded
from medfl.privacy.noise import gaussian
from medfl.plugins import lookup
from medfl.shapley import (balanced_subset, ensemble_game, feature_importance, importance_weights, mean_importance,
                           shapley_values, teacher_weights)
from medfl.logs import plugin_logger

if TYPE_CHECKING:  # pragma: no cover
    from medfl.context import ClientContext

__all__ = ["PFedCDP", "AUTHORS_NOISE_MULTIPLIER", "AUTHORS_TEACHER_WEIGHTS", "AUTHORS_V17_NOISE_MULTIPLIER",
           "DEFAULT_CLUSTER_MODELS", "DP_MODES", "PRESETS", "WEIGHT_DP", "authors_quantize", "clip_noise_tensors",
           "fisher_information", "fisher_masks", "mix_extractor", "personal_observables", "quantization_error",
           "recalibrate_norms", "register_methods"]

logger = plugin_logger(__name__)

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
#: Where the extractor's noise goes: ``"update"`` (eqs. 12-13: the update's L2 norm clipped to C2,
#: noised by the engine's ``dp_gaussian`` filter) or ``"weights_per_tensor"`` (the authors'
#: differential_privacy.py: each weight tensor of the extractor clipped to ``clip`` by its own L2
#: norm and Gaussian noise of standard deviation ``clip * sigma`` added to the weights, in the
#: method's client step, accounted through :meth:`PFedCDP.own_dp`).
DP_MODES = ("update", "weights_per_tensor")
#: What eq. 11's KD trains at the client: ``"classifier"`` (Algorithm 1: the extractor frozen) or
#: ``"model"`` (the authors' v1.7 clients: the whole model, ``full_model.trainable_variables``).
KD_SCOPES = ("classifier", "model")
#: What eq. 11's softmaxes act on: ``"logits"`` (eq. 11 as written) or ``"probabilities"`` (the
#: authors' v1.7 clients: their models end in a softmax layer, so the student's and the teacher's
#: outputs are probabilities, soft-maxed again in both the KL and the cross-entropy term).
KD_INPUTS = ("logits", "probabilities")
#: What a client's evaluation scores (:meth:`PFedCDP.client_eval_model`): ``"personal"`` (its own
#: extractor and classifier after its round) or ``"global"`` (its cluster's aggregated extractor,
#: as the coordinator holds it after the round, with the client's own classifier: the authors'
#: v1.7 ``FlowerClient.evaluate``).
SCORES_MODES = ("personal", "global")
#: The name of the authors' weight noise in ``privacy.csv`` (:meth:`PFedCDP.own_dp`).
WEIGHT_DP = "pfedcdp_weight_dp"
CAPABILITY_MODES = ("auto", "draw", "measure")
SERVER_CLASSIFIER = ("public", "init")
TEACHER_WEIGHTS = ("shapley", "uniform", "fixed")
FEATURE_SHAP = ("off", "printed", "input")
SHAPLEY_SCORES = ("accuracy", "balanced_accuracy", "auc")
QUANTIZE = ("update", "weights")
CLUSTER_AVERAGE = ("weighted", "uniform")
SUPCON_VIEWS = (1, 2)
#: A cluster's noise-to-update ratio from which the run warns that the noise drowns the update.
NOISE_WARN_RATIO = 10.0
#: A client's share of own-extractor weights above 1 in magnitude from which the run warns.
ABOVE_ONE_WARN = 0.05
#: A client's relative change of its personal (Fisher-kept) weights in one round from which the run warns.
DRIFT_WARN = 1.0


# --------------------------------------------------------------------------- pieces

def fisher_information(model: nn.Module, batches: Any, keys: list[str], device: str = "cpu",
                       max_batches: int | None = None) -> tuple[State, int]:
    """Empirical Fisher information of the parameters ``keys`` (eq. 3) on ``batches``.

    For each mini-batch, the squared gradient of the batch's mean log-likelihood (the
    negative cross-entropy) with respect to each parameter; averaged over the batches
    (``max_batches`` of them, all when ``None``). The model is in evaluation mode (no
    dropout, BatchNorm's running statistics), so the importance does not depend on random
    dropout masks. Returns the Fisher tensors (same shapes as the parameters) and the
    number of batches used."""
    model = model.to(device).eval()
    params = dict(model.named_parameters())
    missing = [k for k in keys if k not in params]
    if missing:
        raise KeyError(f"fisher_information: not parameters of the model: {missing[:5]}")
    fisher = {k: torch.zeros_like(params[k]) for k in keys}
    used = 0
    for x, y in batches:
        if max_batches is not None and used >= max_batches:
            break
        if x.shape[0] == 0:
            continue
        model.zero_grad(set_to_none=True)
        loglik = -nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        grads = torch.autograd.grad(loglik, [params[k] for k in keys], allow_unused=True)
        for k, g in zip(keys, grads):
            if g is not None:
                fisher[k] += g.detach() ** 2
        used += 1
    if used:
        fisher = {k: v / used for k, v in fisher.items()}
    return fisher, used


def fisher_masks(fisher: State, *, keep: float | None = None, threshold: float | None = None) -> State:
    """The personal masks of eq. 4 (1: keep the client's own value); the global mask of
    eq. 5 is ``1 - personal``.

    ``threshold`` is the paper's T_Fisher: ``F >= T`` is personal. ``keep`` is the quantile
    form: T is the ``keep`` quantile from the top over every entry of every tensor together
    (``keep=0.2``: the 20 % most important entries; ties at T are kept). Entries with zero
    Fisher information are never personal: the local data says nothing about them."""
    if (keep is None) == (threshold is None):
        raise ValueError("fisher_masks: give exactly one of keep (a fraction) or threshold (T_Fisher)")
    if threshold is None:
        flat = torch.cat([v.reshape(-1).double() for v in fisher.values()]) if fisher else torch.zeros(0)
        k = int(math.ceil(float(keep) * flat.numel()))
        if k <= 0 or flat.numel() == 0:
            return {name: torch.zeros_like(v, dtype=torch.bool) for name, v in fisher.items()}
        threshold_t = torch.topk(flat, k).values[-1]
        return {name: (v.double() >= threshold_t) & (v > 0) for name, v in fisher.items()}
    return {name: (v >= float(threshold)) & (v > 0) for name, v in fisher.items()}


def mix_extractor(own: State, global_: State, personal: State) -> State:
    """Eq. 6: ``M_personal * W_own + M_global * W_global`` with ``M_global = 1 - M_personal``,
    per entry of the extractor's state. Entries without a mask (buffers: BatchNorm running
    statistics) take the global value. The result lies where the global state does (the
    masks come from the client's device, the states from the wire and the state store)."""
    out = {}
    for k, g in global_.items():
        if k in personal and k in own:
            out[k] = torch.where(personal[k].to(g.device), own[k].to(g.device), g)
        else:
            out[k] = g.clone()
    return out


def _norm(tensors: Any) -> float:
    """The L2 norm of a collection of tensors taken together, in float64."""
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def personal_observables(new: State, prev: State | None, masks: State | None) -> dict[str, float]:
    """What a client reports of its own extractor after a round (scalars of its reply), so a
    person can see eq. 6 and the local training act on it.

    Args:
        new: the client's own extractor after this round (its personal model's weights).
        prev: its own extractor of the previous round (``None`` in its first round).
        masks: this round's personal masks (eq. 4; ``None`` in its first round).

    Returns:
        ``own_norm`` (L2 norm of ``new``) and ``above_one`` (the share of ``new``'s entries
        above 1 in magnitude: none in a trained CNN of this size without noise, most of them
        when eq. 6 copied a noise-drowned cluster model in); with ``prev`` and ``masks`` also
        ``personal_norm`` and ``personal_norm_prev`` (the norm of the personal entries, Fisher
        mask 1, now and in the previous round) and ``personal_drift``
        ``||M (new - prev)|| / ||M prev||`` (how far the kept entries moved this round).
    """
    total = sum(v.numel() for v in new.values())
    above = sum(int((v.abs() > 1.0).sum()) for v in new.values())
    out = {"own_norm": _norm(new.values()), "above_one": above / max(total, 1)}
    if prev is not None and masks is not None:
        keys = [k for k in masks if k in new and k in prev]
        m = {k: masks[k].to("cpu") for k in keys}
        out["personal_norm"] = _norm(new[k].cpu()[m[k]] for k in keys)
        out["personal_norm_prev"] = prev_norm = _norm(prev[k].cpu()[m[k]] for k in keys)
        moved = _norm((new[k].cpu() - prev[k].cpu())[m[k]] for k in keys)
        out["personal_drift"] = moved / prev_norm if prev_norm > 0 else 0.0
    return out


def quantization_error(state: State, bits: int) -> float:
    """The expected L2 norm of ``bits``-bit min-max quantization's error on ``state`` (eqs.
    14-15, per tensor): each tensor's step ``(max - min) / (2^b - 1)``, a rounding error
    uniform over one step (variance ``step^2 / 12``) on each of its entries, so
    ``sqrt(sum_t n_t step_t^2 / 12)``. What it is for: the coordinator's estimate of what
    quantization costs a reply, from the dequantized values alone (their minimum and maximum
    are decoded exactly)."""
    total = 0.0
    for v in state.values():
        if v.is_floating_point() and v.numel():
            step = (float(v.max()) - float(v.min())) / (2 ** bits - 1)
            total += v.numel() * step * step / 12.0
    return math.sqrt(total)


def clip_noise_tensors(state: State, clip: float, sigma: float, generator: torch.Generator) -> State:
    """The authors' ``DifferentialPrivacy.apply_dp`` (shadhin39/PFedCDP, differential_privacy.py,
    lines 19-29 and 31-40) on a model state: each tensor ``w`` scaled by ``min(1, clip / ||w||)``
    (its own L2 norm over all its entries, ``tf.norm(w, ord=2)``), then Gaussian noise of standard
    deviation ``clip * sigma`` added to every entry (drawn from ``generator``, on the CPU, float32
    as the code's ``tf.random.normal``). It acts on the weights themselves, not on an update."""
    out = {}
    for k, w in state.items():
        w32 = w.detach().to("cpu", torch.float32)
        norm = torch.linalg.vector_norm(w32)
        factor = torch.clamp(clip / norm, max=1.0) if float(norm) > 0 else torch.tensor(1.0)
        noise = gaussian(w32.shape, clip * sigma, generator)   # finite by construction (medfl.privacy.noise)
        out[k] = (w32 * factor + noise).to(w.dtype)
    return out


def authors_quantize(state: State, bits: int) -> State:
    """The authors' min-max quantization of the weights and its inverse (shadhin39/PFedCDP,
    quantization.py: ``quantize_weights`` lines 11-37, the formula lines 24-25; ``dequantize_weights``
    lines 39-52, the formula lines 47-48), per tensor: ``q = round((w - min) / (max - min + 1e-8)
    * (2^b - 1))`` (round half to even, as ``tf.round``), then ``q / (2^b - 1) * (max - min) +
    min``. What a coordinator receives of a weight tensor quantized at ``bits`` bits (medfl sends
    the dequantized floats)."""
    levels = float(2 ** bits - 1)
    out = {}
    for k, w in state.items():
        w32 = w.detach().to("cpu", torch.float32)
        if not w32.numel():
            out[k] = w.clone()
            continue
        lo, hi = w32.min(), w32.max()
        q = torch.round((w32 - lo) / (hi - lo + 1e-8) * levels)
        out[k] = (q / levels * (hi - lo) + lo).to(w.dtype)
    return out


class _PerClient(dict):  # type: ignore[type-arg]
    """``{client id: value}`` of :meth:`PFedCDP.own_dp`, resolved when asked from the method's
    cluster assignment (known after the profile exchange, before the ledger records round 1)
    by ``value(client id)``: the noise multiplier (:meth:`PFedCDP.client_noise`: a client of a
    noised cluster gets the authors' sigma over the square root of its model's number of noised
    tensors, a client of a cluster sent in the clear 0, its epsilon infinite; a client without a
    cluster yet, as in the plan's check before the profile or a site's policy, 0: it may be sent
    in the clear) or the number of values the noise covers (:meth:`PFedCDP.client_noised_values`)."""

    def __init__(self, value: Callable[[str], float]) -> None:
        super().__init__()
        self._value = value

    def __getitem__(self, client_id: str) -> float:
        return self._value(str(client_id))

    def __contains__(self, client_id: object) -> bool:
        return True


def _split_keys(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The extractor's parameters, its buffers (BatchNorm statistics) and the classifier's keys."""
    if not hasattr(model, "head_keys") or not hasattr(model, "body_keys") or not hasattr(model, "embed"):
        raise MethodConfigError(f"pfedcdp: {type(model).__name__} has no extractor/classifier split (head_keys, "
                                "body_keys, embed): use a registered medfl model (pfedcdp_a/b/c, small_cnn, resnet*)")
    params = {n for n, _ in model.named_parameters()}
    body = list(model.body_keys())
    return [k for k in body if k in params], [k for k in body if k not in params], list(model.head_keys())


def recalibrate_norms(model: nn.Module, loader: Any, device: str = "cpu") -> int:
    """Re-estimate every BatchNorm's running statistics of ``model`` on ``loader`` (a
    cumulative average over its batches, no gradient, other modules in evaluation mode);
    returns the number of batches used (0 and nothing changed for a model without BatchNorm)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return 0
    model.to(device).eval()
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    used = 0
    with torch.no_grad():
        for x, _ in loader:
            if x.shape[0] > 1:
                model(x.to(device))
                used += 1
    for m, mom in zip(norms, saved):
        m.momentum = mom
    model.eval()
    return used


def _freeze_body(model: nn.Module) -> None:
    """Evaluation mode for every module but the head (no dropout, no BatchNorm update)."""
    for name, mod in model.named_modules():
        if name and not name.startswith("head"):
            mod.eval()


def _check_unit(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise MethodConfigError(f"pfedcdp: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_pos_int(value: Any, name: str, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise MethodConfigError(f"pfedcdp: {name} must be an integer >= {0 if zero else 1}, got {value!r}")
    return int(value)


def _check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise MethodConfigError(f"pfedcdp: {name} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _check_clusters(value: Any, name: str, what: str) -> list[str]:
    """``value`` as a list of distinct clusters in ``CLUSTERS``' order (``None``: all of them)."""
    if value is None:
        return list(CLUSTERS)
    if (isinstance(value, str) or not isinstance(value, (list, tuple))
            or set(value) - set(CLUSTERS) or len(set(value)) != len(value)):
        raise MethodConfigError(f"pfedcdp: {name} must be a list of distinct clusters among "
                                f"{', '.join(CLUSTERS)} ({what}), got {value!r}")
    return [c for c in CLUSTERS if c in value]


def _check_pos(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value) > 0:
        raise MethodConfigError(f"pfedcdp: {name} must be a number > 0, got {value!r}")
    return float(value)


class _TwoViews(Dataset):
    """Two draws of the random transforms of each public sample (eq. 17's ``2N`` views),
    stacked along the channel axis, ``(2C, H, W[, D])``, so a batch keeps the image's number
    of dimensions; the loss splits them again."""

    def __init__(self, first: Dataset, second: Dataset) -> None:
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        xa, y = self.first[i]
        xb, _ = self.second[i]
        return torch.cat([torch.as_tensor(xa), torch.as_tensor(xb)]), y


# --------------------------------------------------------------------------- presets

_PAPER = "paper 000 (Shadin et al.), Sec. III and IV.A"
_PAPER_VALUES: dict[str, Any] = {
    "cluster_models": {c: dict(v) for c, v in DEFAULT_CLUSTER_MODELS.items()},   # IV.A.2: models A / B / C
    "student_model": {"name": "pfedcdp_student"},          # IV.A.2: 16-32 filters, dense 64, dropout 0.5
    "capability_weights": [0.25, 0.25, 0.25, 0.25], "t_high": 0.6, "t_medium": 0.4, "max_latency_ms": 200.0,
    "fisher_keep": 0.2, "fisher_threshold": None, "extractor_epochs": 1,
    "kd_lambda": 0.3, "kd_temperature": 3.0, "server_classifier": "public", "server_epochs": 1,
    "epsilon": 5.0, "noise_multiplier": None, "clip": 2.5, "delta": 1e-5, "accountant": "rdp",   # IV.A.2
    "bits": 8, "quantize": "update",                       # IV.A.2, eq. 14 and Algorithm 1 line 21
    "cluster_average": "weighted",                         # III.C.4.ii and Algorithm 2 line 10: FedAvg
    "refine": True, "refine_epochs": 5, "refine_lr": 1e-3, "alpha": 0.5, "refine_temperature": 2.0,
    "tau": 0.07, "supcon_reduction": "sum", "supcon_views": 2,   # eq. 17: summed over the batch, 2N views
    "teacher_weights": "uniform", "feature_shap": "printed", "shap_samples": 16, "grad_clip": 5.0,
}
_PAPER_EXPERIMENT: dict[str, Any] = {
    "rounds": 20, "num_clients": 10, "fraction": 1.0, "partition": {"name": "dirichlet", "alpha": 0.5},
    "client_counts_fig2": [10, 50, 100], "private_data": "CBIS-DDSM, 2,326 train / 772 test images",
    "public_data": "MIAS benign / malignant, 280 train / 50 test",
}

_PAPER_VALUES.update(dp_mode="update", dp_clusters=list(CLUSTERS), apply_masks=True, kd_scope="classifier",
                     kd_clusters=list(CLUSTERS), kd_input="logits", score="personal")
_PAPER_TRAIN: dict[str, Any] = {"epochs": 20, "batch_size": 64, "optimizer": "adam", "lr": 1e-3}

_REPO = "shadhin39/PFedCDP (snapshot d7364e07)"
_V17 = _REPO + ", PFedCDP/v1.7/PFedCDP/"
_DP_FILE = _REPO + ", PFedCDP/differential_privacy.py"
_CA = _V17 + "client.py"      # model A (high)
_CB = _V17 + "client1.py"     # model B (medium); as stored it does not compile (IndentationError, line 281)
_CC = _V17 + "client2.py"     # model C (low)
_SERVER = _V17 + "server_main_contrastive_learning.py"
#: Where each value of the ``paper`` preset comes from (:attr:`medfl.method.Preset.sources`).
_PAPER_SOURCES: dict[str, str] = {
    "cluster_models": "reading: Sec. IV.A (Experimental Setup), the models paragraph: model A for high, B for medium, "
                      "C for low capability (C: 8 and 16 filters, a 32-unit dense layer); model B 'includes dropout "
                      "regularization' with no rate given: medfl's pfedcdp_b drops 0.5 after its dense layer "
                      "(medfl.models.cnn.PFEDCDP_B_DROPOUT), the paper's student's rate (Sec. IV.A) and the rate of "
                      "the authors' model-B classifier (" + _CB + ", line 722: Dropout(0.5) before its softmax "
                      "layer, line 723; their model B is another network, lines 703-724); other reading: another "
                      "rate (their model C drops 0.4, " + _CC + ", line 637)",
    "student_model": "paper: Sec. IV.A: the student has 16 and 32 filters, a 64-unit dense layer, dropout 0.5",
    "capability_weights": "reading: eq. 1 (Sec. III.B) takes w1..w4 = 1/4 'if all resources matter the same'; "
                          "other reading: its example weights 0.3/0.3/0.1/0.3",
    "t_high": "open: eq. 2 (Sec. III.B) names T_H without a value; medfl 0.6 (a score of 3/4 of the maximum on "
              "most resources)",
    "t_medium": "open: eq. 2 names T_M without a value; medfl 0.4",
    "max_latency_ms": "open: Sec. III.B's network score divides by a maximum acceptable latency with no value; "
                      "medfl 200 ms",
    "fisher_keep": "open: eqs. 4-5's T_Fisher has no value; medfl keeps the top 20 % of the extractor's entries "
                   "(a raw threshold does not transfer between models; the authors' code uses a raw 0.01)",
    "fisher_threshold": "open: given as the quantile fisher_keep instead (eqs. 4-5 name no value)",
    "extractor_epochs": "reading: Algorithm 1 freezes the extractor and trains only the classifier, so no feature "
                        "learning would happen anywhere (that literal reading is 0); other reading, medfl's: 1 "
                        "epoch of cross-entropy on the whole local model first",
    "kd_lambda": "authors_code: " + _CA + ", line 171 (PartitionedModel.__init__: KnowledgeDistillationLoss("
                 "temperature=3.0, lambda_balance=0.3)); the same in client1.py line 736 and client2.py line 651 "
                 "(eq. 11's lambda has no value in the paper)",
    "kd_temperature": "authors_code: " + _CA + ", line 171 (KnowledgeDistillationLoss(temperature=3.0, ...)); the "
                      "same in client1.py line 736 and client2.py line 651 (T_KD has no value in the paper)",
    "server_classifier": "open: nothing in Sec. III.C or Algorithm 2 says how W_C,server is trained; medfl fits it "
                         "on the public set every round",
    "server_epochs": "open: see server_classifier; 1 epoch a round",
    "epsilon": "paper: Sec. IV.A, 'we apply Differential Privacy (epsilon = 5.0, C2 = 2.5) ... to the model "
               "updates'; sigma from the accountant over the run (Sec. III.C.3.i, eq. 13)",
    "noise_multiplier": "paper: Sec. III.C.3.i: 'sigma is the noise multiplier computed by the privacy "
                        "accountant ... with respect to epsilon and delta' (null: derived from epsilon)",
    "clip": "paper: Sec. IV.A, C2 = 2.5; eq. 12 clips the update's L2 norm",
    "delta": "authors_code: " + _DP_FILE + ", line 7: DifferentialPrivacy(epsilon=8.0, delta=1e-5, ...) (the paper "
             "states no delta)",
    "accountant": "open: 'the privacy accountant' (Sec. III.C.3.i) is not named; Opacus's RDP accountant",
    "bits": "paper: Sec. IV.A, 'Quantization (8 bits)'; eqs. 14-15",
    "quantize": "paper: Sec. III.C.3.ii, eq. 14 quantizes the update Delta W; Algorithm 1 line 21",
    "cluster_average": "reading: Sec. III.C.4.ii and Algorithm 2 line 10 name FedAvg (weighted by training-set "
                       "size); other reading: Algorithm 2's 'Avg' literally, a uniform mean",
    "refine": "paper: Sec. III.D and Algorithm 2 lines 15-28 (the post-hoc refinement)",
    "refine_epochs": "open: Algorithm 2's E has no value; 5",
    "refine_lr": "open: not stated; Adam at 1e-3",
    "alpha": "open: eq. 18's alpha has no value; 0.5 (with eq. 17 summed over the batch, KD then weighs about 1/A "
             "of SupCon for A anchors: see PFedCDP's docstring)",
    "refine_temperature": "open: eq. 18's T has no value; 2",
    "tau": "open: eq. 17's tau has no value; Khosla et al.'s reference code's 0.07",
    "supcon_reduction": "paper: Sec. III.D after eq. 17: 'This L^SCL term, summed over all samples in the batch'",
    "supcon_views": "reading: eq. 17 counts 2N views and 2N_y - 1 positives (Khosla et al.'s two augmented views); "
                    "other reading: Algorithm 2 feeds the batch as it is and names no augmentation (1 view)",
    "teacher_weights": "reading: Sec. III.D's equations average the teachers' logits uniformly (z_T = 1/K sum_k "
                       "z_T^k) and put the Shapley values on input features (eqs. 16, 19); other reading: Sec. "
                       "III.A's 'Shapley values weight each model' ('shapley')",
    "feature_shap": "paper: eqs. 16 and 19 as printed, (1/|F|) sum_i psi_i L = mean(psi) L (the explainer is not "
                    "named: medfl uses shap's GradientExplainer)",
    "shap_samples": "open: 'a representative subset of class-balanced test samples' (Sec. III.D) has no size; 16",
    "grad_clip": "open: the paper clips no gradient; without a clip the paper's DP noise makes the local losses "
                 "overflow; medfl 5",
    "dp_mode": "paper: Sec. III.C.3.i, eqs. 12-13: the feature-extractor update Delta W_L,k is clipped to C2 and "
               "noised",
    "dp_clusters": "paper: Sec. IV.A applies DP 'to the model updates before transmission' of every client (and "
                   "Algorithm 1, which every cluster runs): all three clusters",
    "apply_masks": "paper: eq. 6 and Algorithm 1: W_L = M_personal * W_L,own + M_global * W_L,global",
    "kd_scope": "paper: Algorithm 1 trains the classifier on eq. 11 with the extractor frozen",
    "kd_clusters": "paper: Algorithm 1, which every cluster runs, distils each client's classifier from the server "
                   "model (eq. 11): all three clusters",
    "kd_input": "paper: eqs. 7-11 apply the softmax to the logits z (softmax(z / T))",
    "score": "reading: Sec. IV.B reports accuracy on the private CBIS-DDSM data without saying which model is "
             "scored; medfl scores each client's personalised model (its own extractor and classifier after its "
             "round, the 'personalized models' of Sec. V); other reading: the cluster's aggregated extractor with "
             "the client's classifier (the authors' v1.7 FlowerClient.evaluate, preset authors_v1_7)",
    "train.epochs": "paper: Sec. IV.A, 'each client performing local training for 20 epochs per round'",
    "train.batch_size": "authors_code: " + _CA + ", line 393 (FlowerClient.fit: train_with_distillation(x_train, "
                        "y_train, epochs=5, batch_size=64, ...)); client1.py line 992, client2.py line 913 (the paper "
                        "states none)",
    "train.optimizer": "authors_code: " + _CA + ", line 363 (FlowerClient.__init__ compiles the full model with "
                       "keras.optimizers.Adam()) and line 257 (the distillation loop's Adam()); client1.py lines 963 "
                       "and 867, client2.py line 888 (the paper states none)",
    "train.lr": "reading: the paper states no learning rate; 1e-3, Keras's Adam default, at which the authors' v1.7 "
                "models A and B train (" + _CA + ", line 363; client1.py, line 963: keras.optimizers.Adam()); other "
                "reading: their model C's 3e-4 (client2.py, line 888: Adam(learning_rate=0.0003); cluster_lr of "
                "preset authors_v1_7)",
}

#: The authors' v1.7 clients (``PFedCDP/v1.7/PFedCDP/client.py``: model A, ``client1.py``: model B,
#: ``client2.py``: model C), what each sends in ``FlowerClient.fit``.
_V17_VALUES: dict[str, Any] = {
    **_PAPER_VALUES, "dp_mode": "weights_per_tensor", "dp_clusters": ["medium"], "epsilon": None,
    "noise_multiplier": AUTHORS_V17_NOISE_MULTIPLIER, "clip": 2.5, "delta": 1e-5, "quantize": "weights",
    "bits": {"high": None, "medium": 12, "low": None}, "apply_masks": False, "fisher_keep": None,
    "fisher_threshold": 0.01, "kd_scope": "model", "extractor_epochs": 0, "kd_lambda": 0.3, "kd_temperature": 3.0,
    "grad_clip": None, "teacher_weights": "fixed", "kd_clusters": ["high"],
    "cluster_lr": {"high": None, "medium": None, "low": 3e-4}, "kd_input": "probabilities", "score": "global",
}
_V17_SOURCES: dict[str, str] = {
    **_PAPER_SOURCES,
    "dp_mode": "authors_code: " + _CB + ", lines 996-997 (FlowerClient.fit: weights = get_feature_extractor_weights(); "
               "weights = dp.apply_dp(weights)), with client1.py's own DifferentialPrivacy (lines 47-96, which "
               "replaces the one imported from differential_privacy.py at line 11): clip_weights, lines 62-72, scales "
               "each tensor by min(1, 2.5 / ||w||), add_noise, lines 74-83, adds noise of std clipping_threshold * "
               "noise_multiplier to the weights; the paper (eqs. 12-13) clips and noises the update",
    "dp_clusters": "authors_code: " + _CB + ", line 997 (model B's fit calls dp.apply_dp); " + _CA + ", line 409 "
                   "(model A) and client2.py, line 923 (model C): fit returns get_feature_extractor_weights() "
                   "without noise; the paper (Sec. IV.A) noises every client's update",
    "epsilon": "authors_code: the code has no accountant: epsilon only enters the one-release formula ("
               + _CB + ", line 60; " + _DP_FILE + ", line 17); null here, the run records the epsilon spent",
    "noise_multiplier": "authors_code: " + _CB + ", line 60: sqrt(2 ln(1.25 / delta)) / epsilon, at line 984: "
                        "DifferentialPrivacy(epsilon=8.0, delta=1e-5): 0.606 every round, never composed (the paper: "
                        "epsilon 5 over the run, Sec. IV.A)",
    "clip": "authors_code: " + _CB + ", line 50 (clipping_threshold=2.5), applied per weight tensor in lines 62-72",
    "delta": "authors_code: " + _CB + ", line 984: DifferentialPrivacy(epsilon=8.0, delta=1e-5)",
    "accountant": "open: the code accounts nothing; medfl records the weights' releases with Opacus's RDP "
                  "accountant at noise multiplier sigma / sqrt(number of tensors) (see PFedCDP.own_dp)",
    "quantize": "authors_code: " + _CB + ", line 998: quantization.quantize_weights(weights) on the noised weights "
                "(client1.py's own Quantization, lines 98-131, replacing the import at line 12; the formula lines "
                "118-119); fit returns its (codes, min/max) pair as the parameters (lines 998 and 1007) and no v1.7 "
                "file dequantizes them: medfl sends the dequantized values (the paper, eq. 14: the update)",
    "bits": "authors_code: " + _CB + ", line 985: Quantization(num_bits=12); client.py (line 409) and client2.py "
            "(line 923) send floats (the paper: 8 bits for every client, Sec. IV.A)",
    "apply_masks": "authors_code: " + _CB + ", lines 981 and 988 (client2.py, lines 906 and 909): "
                   "set_feature_extractor_weights(parameters) and then apply_fisher_personalization(parameters, ...), "
                   "whose 'local' weights (client1.py, line 759: get_feature_extractor_weights()) are now the global "
                   "ones: eq. 6 mixes the global extractor with itself (client.py, model A, computes no masks); the "
                   "masks are computed and not applied",
    "fisher_keep": "authors_code: " + _CB + ", line 666 (create_binary_masks: fisher_layer >= self.threshold; "
                   "client2.py, line 581): a raw threshold (fisher_threshold), no quantile",
    "fisher_threshold": "authors_code: " + _CB + ", line 739 (PartitionedModel.__init__: "
                        "FisherInformationCalculator(threshold=0.01); client2.py, line 654), computed once (line 762) "
                        "on at most 1,000 training samples (line 766); with apply_masks false it only sets "
                        "personal_fraction",
    "kd_scope": "authors_code: " + _CA + ", lines 298-299 (train_with_distillation's distillation loop: "
                "tape.gradient(total_loss, self.full_model.trainable_variables)) and lines 244-250 (without a "
                "teacher: self.full_model.fit); client1.py lines 908-909 and 854, client2.py lines 824-825 and 767: "
                "in both branches the whole model trains. On what is kd_clusters: only model A's fit looks for a "
                "teacher (client.py, line 387); models B and C never do and train on cross-entropy alone (this "
                "source said 'the whole model learns on eq. 11' before issue 63, true of model A only)",
    "kd_clusters": "authors_code: " + _CA + ", line 387 (model A's FlowerClient.fit calls download_teacher_model"
                   "(self.current_round), lines 185-200, and with a teacher distils, lines 257-299); " + _CB + ", "
                   "lines 977-1007 and client2.py, lines 902-923 (models B and C's fit) never call "
                   "download_teacher_model (client1.py line 795, client2.py line 708), so teacher_model stays None "
                   "(client1.py line 733, client2.py line 648) and train_with_distillation takes its branch without "
                   "distillation (client1.py lines 814 and 854, client2.py lines 727 and 767: full_model.fit, plain "
                   "cross-entropy)",
    "cluster_lr": "authors_code: " + _CC + ", line 888 (model C's FlowerClient.__init__ compiles the full model with "
                  "keras.optimizers.Adam(learning_rate=0.0003), what trains it: its fit loads no teacher, so "
                  "train_with_distillation runs full_model.fit, line 767; the module-level compile at line 452 has "
                  "the same rate); models A and B compile Adam() at Keras's 1e-3 (client.py, line 363; client1.py, "
                  "line 963): train.lr",
    "kd_input": "authors_code: " + _CA + ", line 158 (model A's classifier ends in Dense(2, activation='softmax')); "
                "lines 287 and 290 (the student's and the teacher's 'logits' are the models' outputs, "
                "probabilities); lines 522-523 and 530 (compute_distillation_loss soft-maxes them again in the KL "
                "term and the student's again in the cross-entropy term)",
    "score": "authors_code: " + _CA + ", lines 411-418; client1.py, lines 1009-1018; client2.py, lines 925-934 "
             "(FlowerClient.evaluate: set_feature_extractor_weights(parameters), the aggregated extractor, then "
             "full_model.evaluate with the client's own classifier)",
    "extractor_epochs": "authors_code: " + _CB + ", lines 991-993 (FlowerClient.fit: train_with_distillation "
                        "alone, no separate cross-entropy phase; client.py lines 390-395, client2.py lines 912-914)",
    "grad_clip": "authors_code: " + _CA + ", line 299 and client1.py, line 909 (optimizer.apply_gradients on the raw "
                 "gradients); Keras fit (client1.py line 854, client2.py line 767) with the compiled Adam and no "
                 "clipnorm (client1.py line 963, client2.py line 888)",
    "teacher_weights": "authors_code: " + _SERVER + ", line 218 (MultiTeacherDistiller.train_step: weights = [0.4, "
                       "0.35, 0.25], 'A=40%, B=35%, C=25%'), fixed for High/Medium/Low",
    "train.epochs": "authors_code: " + _CA + ", line 392; client1.py, line 992; client2.py, line 913 (FlowerClient."
                    "fit: train_with_distillation(..., epochs=5, batch_size=64, ...)) (the paper: 20, Sec. IV.A)",
    "train.lr": "authors_code: " + _CA + ", line 363 and client1.py, line 963 (FlowerClient.__init__: "
                "keras.optimizers.Adam() at Keras's default 1e-3, models A and B); model C's 3e-4: cluster_lr",
}

#: The previous ``authors`` preset, kept under its own name: the code's formula at the paper's
#: epsilon 5 on every cluster's update (a mixture of the paper and the code, not a file).
_FORMULA_VALUES: dict[str, Any] = {**_PAPER_VALUES, "epsilon": None, "noise_multiplier": AUTHORS_NOISE_MULTIPLIER,
                                   "teacher_weights": "fixed"}
_FORMULA_SOURCES: dict[str, str] = {
    **_PAPER_SOURCES,
    "epsilon": "reading: the code's one-release formula read as sigma itself, every round, never composed: null "
               "(the run records the epsilon spent); other reading: the paper's epsilon 5 as a target over the run "
               "(Sec. IV.A, preset paper)",
    "noise_multiplier": "reading: the authors' differential_privacy.py (line 17) calibrates sigma = sqrt(2 ln(1.25 / "
                        "delta)) / epsilon for one release and adds it every round; here at the paper's epsilon 5 "
                        "(Sec. IV.A): sigma 0.969 for every cluster. other reading: what the code runs, epsilon 8 "
                        "(sigma 0.606) on model B only (preset authors_v1_7)",
    "teacher_weights": _V17_SOURCES["teacher_weights"],
    "train.epochs": _V17_SOURCES["train.epochs"],
}


#: ``{"name": "pfedcdp", "preset": ...}``: ``paper``, every value paper 000 states and medfl's
#: choice for what it leaves open; ``authors_v1_7``, the authors' v1.7 client files exactly in
#: what leaves a client (which clusters are noised, sigma, per-tensor clipping of the weights,
#: masks, quantization); ``authors``, the same (v1.7 is the repository's newest client code and
#: the only one with the paper's three clusters A/B/C, Fisher masks and classifier KD: the
#: top-level ``PFedCDP/client1.py`` is a 50-client Fashion-MNIST FedAvg with noisy gradients);
#: ``authors_formula``, the code's sigma formula at the paper's epsilon on every cluster (what
#: ``authors`` was before issue 48). Each value's source: the preset's ``sources``.
PRESETS: dict[str, Preset] = {
    "paper": Preset(
        source=_PAPER + " (eqs. 1-19, Algorithms 1-2, IV.A)",
        values=_PAPER_VALUES, train=_PAPER_TRAIN, experiment=_PAPER_EXPERIMENT,
        sources=_PAPER_SOURCES,
        description="the paper's settings: epsilon 5 over the run, C2 2.5, 8 bits on the update, models A/B/C, "
                    "20 local epochs, eq. 17 summed over 2N views"),
    "authors_v1_7": Preset(
        source="the authors' v1.7 clients (github.com/shadhin39/PFedCDP, PFedCDP/v1.7/PFedCDP/client.py, "
               "client1.py, client2.py, FlowerClient.fit; PFedCDP/differential_privacy.py, quantization.py) in "
               "what each cluster sends; " + _PAPER + " elsewhere",
        values=_V17_VALUES, train={**_PAPER_TRAIN, "epochs": 5},
        experiment={**_PAPER_EXPERIMENT, "authors_code_rounds": 10}, sources=_V17_SOURCES,
        description="the authors' v1.7 clients: only model B (medium) noised, sigma 0.606 (epsilon 8, never "
                    "composed) on its weights clipped per tensor to 2.5, 12 bits; A and C in the clear; masks not "
                    "applied; the whole model trains 5 epochs: A on the KD loss with softmax applied twice, B and C "
                    "on cross-entropy alone (C at lr 3e-4); scored with the aggregated extractor and each client's "
                    "classifier"),
    "authors_formula": Preset(
        source="the authors' sigma formula (PFedCDP/differential_privacy.py, line 17) at the paper's epsilon 5 on "
               "every cluster's update; " + _PAPER + " elsewhere",
        values=_FORMULA_VALUES, train={**_PAPER_TRAIN, "epochs": 5},
        experiment={**_PAPER_EXPERIMENT, "authors_code_rounds": 10}, sources=_FORMULA_SOURCES,
        description="sigma 0.969 each round on every cluster's update without composition (Opacus: epsilon 31.4 "
                    "over 20 rounds), fixed teacher weights, 5 local epochs: a reading, not a file"),
}
PRESETS["authors"] = PRESETS["authors_v1_7"]


# --------------------------------------------------------------------------- the method

class PFedCDP(Method):
    """PFedCDP (Shadin, Zhang, Wang, Pan; paper 000).

    **Clusters** (eqs. 1-2). Before round 1 every client reports four capability scores in
    [0, 1] through the profile exchange (:meth:`Method.configure_profile`; nothing else
    leaves it): CPU (frequency now / maximum), memory (available / total), battery (level,
    1.0 without a battery) and network (1 - latency / ``max_latency_ms`` to the coordinator).
    ``capabilities`` says where they come from: ``"measure"`` (this machine,
    :func:`medfl.capability.measure_capabilities`), ``"draw"`` (a seeded simulation draw),
    ``"auto"`` (measured at a Flower site, drawn in process, where every client shares one
    machine), or the scores themselves (a list in client order or ``{client_id: {...}}``).
    The coordinator computes ``C_O = w . scores`` (``capability_weights``) and the cluster:
    High if ``C_O >= t_high``, Medium if ``t_medium <= C_O < t_high``, Low otherwise. A
    client that does not answer, or answers something that is not four scores in [0, 1], is
    put in Low (and the run says so). Each cluster has its own model (``cluster_models``,
    default the paper's A / B / C), initialised once per run.

    **Client, round t** (Algorithm 1). The instruction carries the cluster's global extractor
    ``W_L,global(t-1)``, the server's classifier ``W_C,server(t-1)`` and the cluster's spec.

    1. Fisher information (eq. 3) of the client's own extractor of round t-1 (with its own
       classifier) on its training split without augmentation: per mini-batch the squared
       gradient of the mean log-likelihood, averaged over ``fisher_batches`` batches (all
       when ``None``).
    2. Masks (eqs. 4-5): personal where ``F >= T_Fisher`` (``fisher_threshold``) or, by
       default, for the top ``fisher_keep`` fraction of the extractor's entries (a raw
       threshold does not transfer between models); global elsewhere. The paper's eqs. 4
       and 5 both hold at ``F = T``, which would add the two values; we give ties to the
       personal mask only (``M_global = 1 - M_personal``), and zero Fisher is never personal.
    3. Eq. 6: ``W_L(t) = M_personal * W_L,own(t-1) + M_global * W_L,global(t-1)``: a
       parameter above the threshold keeps the client's own value, the others take the
       global one (ours is tested to change what the client keeps; the authors' v1.7 clients
       apply the masks after overwriting their own extractor with the global one, so their
       eq. 6 mixes the global extractor with itself: ``apply_masks=False`` reproduces that,
       the masks computed and reported, the client starting from the global extractor).
       Round 1 (no own extractor yet) starts from the global one; so does a client's
       classifier, from the server's.
    4. ``extractor_epochs`` epochs of cross-entropy on the whole local model (extractor and
       the client's classifier). Algorithm 1 as printed never trains the extractor (it is
       frozen and only the classifier learns), so no feature learning would happen anywhere;
       ``extractor_epochs = 0`` is that literal algorithm, the default 1 is our reading.
    5. The classifier alone trains ``train.epochs`` epochs on eq. 11,
       ``(1 - kd_lambda) CE + kd_lambda T^2 KL(teacher || student)``, the extractor frozen
       (evaluation mode), the teacher being the cluster's global extractor with the server's
       classifier (evaluation mode, no gradient).
    6. The reply is the extractor alone (``reply_state``); its update
       ``W_L(t) - W_L,global(t-1)`` (Algorithm 1 line 18) is clipped to ``clip`` (C2, eq.
       12), noised (eq. 13, ``dp_gaussian``) and quantized to ``bits`` bits (``quantize``,
       eqs. 14-15 per tensor): the method's :meth:`default_filters`, planned, applied, undone
       and accounted by the engine like any filter. The noise is given by exactly one of
       ``epsilon`` (a target over the run: sigma from the accountant for every round the
       client takes part in, as III.C.3.i says) or ``noise_multiplier`` (sigma itself, each
       round; the accountant then records the epsilon it spends, however large: the authors'
       formula at the paper's epsilon 5 adds sigma 0.969 every round, epsilon 31.4 over 20
       rounds); neither sends the
       update without noise (not private; the run says so). Eq. 14 quantizes the update:
       ``quantize="update"`` (default) makes the chain subtract ``W_L,global(t-1)`` before the
       quantizer also without DP (with DP it always does); ``"weights"`` quantizes the
       extractor's weights themselves (medfl's behaviour before, kept for comparison: a step
       of the weights' range rather than the update's, an error of the order of a round's
       update, 27 times the update's on the test fixture's model A; only without DP).
       The classifier, the Fisher information and the masks never leave the client; they
       stay in its state with its own extractor (before the noise: the client's own model is
       not a release). BatchNorm statistics of a cluster model with BatchNorm
       (``resnet*``) are statistics of the data that the noise does not cover: they never
       leave the client, which keeps its own (as FedBN does); the coordinator re-estimates
       its cluster model's statistics on the public set (:func:`recalibrate_norms`) for the
       teacher and the server classifier. The paper's models have no BatchNorm.

    **Coordinator** (Algorithm 2). Dequantize (the filters' undo), FedAvg within each
    cluster to the cluster's new global extractor: weighted by training-set sizes
    (``cluster_average="weighted"``, default: III.C.4.ii and Algorithm 2 line 10 name FedAvg)
    or ``"uniform"`` (Algorithm 2's ``Avg`` read literally; it also gives the least noise in
    the average, ``sigma C2 / sqrt(n)`` per coordinate, against ``sigma C2 sqrt(sum w_k^2)``). How the
    server's classifier ``W_C,server`` is trained is never said; with
    ``server_classifier="public"`` (default) the coordinator fits it each round on its
    public set (``fl.public_dataset``) on top of the cluster's frozen new extractor
    (``server_epochs`` epochs of cross-entropy; also once before round 1, so its teacher is
    not random); ``"init"`` keeps it at its initial value (the other reading: nothing trains
    it). The public set never reaches a client.

    **Post-hoc refinement** (``finalize``, Algorithm 2 lines 15-28). The cluster models that
    trained (extractor + server classifier) are teachers. Teacher weights
    (``teacher_weights``): ``"shapley"`` (default) the exact Shapley value of each teacher in
    the game v(S) = ``shapley_score`` of the mean-logit ensemble of S on a class-balanced
    subset of the public *training* split (``shapley_samples`` per class; the test split
    is kept for the final scores), negative values clipped to 0 and normalised
    (:func:`medfl.shapley.teacher_weights`); ``"uniform"`` (III.D's ``z_T = 1/K sum_k
    z_T^k``); ``"fixed"`` the authors' code's [0.4, 0.35, 0.25] (High, Medium, Low); or a
    list. A new student (``student_model``, default the paper's 16-32 filter CNN with dense
    64 and dropout 0.5) trains ``refine_epochs`` epochs (Adam, ``refine_lr``) on the public
    training split with eq. 18: ``(1 - alpha) SupCon(student embeddings; tau) + alpha T^2
    KL(weighted teacher ensemble || student)``. SupCon (eq. 17) is summed over the batch's
    anchors, as the paper's text says (``supcon_reduction="sum"``, default), or averaged
    (``"mean"``, Khosla et al.'s reference code and medfl's behaviour before). The two differ
    by the number A of anchors (samples with a positive: at batch 16 of two classes, 16), so
    alpha's balance moves: alpha with "sum" weighs KD against SupCon as alpha' with "mean"
    where ``alpha' / (1 - alpha') = alpha / ((1 - alpha) A)``: "mean" with alpha' 0.5 is
    "sum" with alpha 16/17 = 0.94 at A = 16, and "sum" with alpha 0.5 is "mean" with alpha'
    1/17 (SupCon shapes the embedding almost alone; the classifier, which SupCon does not
    reach, learns from KD at whatever scale, Adam being scale-free per parameter).
    ``supcon_views=2`` draws two views of each public sample from the public set's random
    transforms (``public_dataset.augment``) as eq. 17's ``2N`` and ``2 N_y - 1`` count
    (Khosla et al.): SupCon runs on the 2N embeddings, KD on both views' logits; without
    random transforms the two views are the same image (the run warns). Default 1 view:
    Algorithm 2 feeds the batch as it is and the paper names no augmentation.
    ``student_metrics.csv`` (:meth:`final_tables`) has the student after every epoch (0:
    before training) on the public test split (accuracy, macro and micro F1, AUC...) and the
    epoch's training loss terms on the public training split, the paper's Fig. 3;
    ``plots/student_metrics.png`` draws it (the reporting plugin, ``medfl report``).

    Eqs. 16-19's feature Shapley values (``feature_shap="printed"``): psi^(k) per teacher from the ``shap`` package (GradientExplainer, |SHAP| averaged over
    ``shap_samples`` public samples and the classes), psi their mean, and eq. 19 as printed:
    ``(1/|F|) sum_i psi_i L = mean(psi) L``, a constant factor on the loss (with Adam it
    changes nothing but epsilon's relative size); it is computed, reported and applied, and
    off by default because as printed it cannot weight features. ``feature_shap="input"`` is
    the per-feature weighting we judge to be meant: psi becomes multiplicative weights of mean
    1 (:func:`medfl.shapley.importance_weights`, floor 0.1) and the student sees ``x * w``
    (the ``input_weighted`` model, so the weights travel with it and apply at evaluation
    too); the teachers see ``x``: the student is pushed to match them from the features they
    rely on.

    **What the mechanisms do, every run** (:meth:`mechanisms`, ``mechanisms.csv``; a summary
    in :meth:`report`'s ``mechanisms``; :meth:`mechanism_warnings` on stderr):

    * ``dp_noise`` per cluster and round: sigma, C2, the number ``d`` of noised coordinates
      (the extractor's parameters), ``sum w_k^2`` of the round's aggregation weights, the
      noise's norm in the cluster's averaged update ``sigma C2 sqrt(d sum w_k^2)`` (its
      expectation to within 1/sqrt(d)), and ``noise_to_update_min`` = that norm over C2 (the
      ``signal_bound`` below): the averaged clipped update has norm at most C2, so the noise is
      at least that many times the signal. Everything here is the noise plan's and the coordinator's own (sigma as the
      engine derives it, the weights it applies): no client reports its update's norm,
      which no noise would cover. ``received_update_norm`` is the norm of the averaged
      update as received (noise included). ``noised`` (1 or 0: ``dp_clusters``) and ``target``
      (``update`` or ``weights``: ``dp_mode``) say what was noised; a cluster sent in the clear
      has sigma 0. ``signal_bound`` is the largest norm of what a client sends before the noise
      (C2; ``clip sqrt(L)`` for weights clipped tensor by tensor, L tensors), and
      ``noise_to_update_min`` is the noise's norm over it.
    * ``quantization`` per cluster: what was quantized (``update`` or ``weights``), the
      expected error norm of the replies' quantization (:func:`quantization_error`, from the
      dequantized values) and its ratio to the received updates' norm (both means over the
      cluster's replies).
    * ``cluster_model`` per cluster: the new global extractor's norm and share of entries
      above 1 in magnitude.
    * ``personalization`` per client, from the scalars its reply carries
      (:func:`personal_observables`): the personal share (eq. 4), its own extractor's norm
      and share above 1 in magnitude after the round, and the personal entries' norm now and
      last round and relative change. These are statistics of the client's own model, which
      the epsilon does not cover, like its training loss (``privacy.not_covered``: the
      training metrics of a reply); they are a few numbers about ~10^5 weights.

    The run warns once when the noise is at least ``NOISE_WARN_RATIO`` (10) times any
    clipped update in a cluster (naming the sigma under which it would not be, and what to
    change), when a client's own extractor has more than ``ABOVE_ONE_WARN`` (5 %) of its
    weights above 1 in magnitude or its personal weights moved by more than their own norm
    in a round (``DRIFT_WARN``), and when quantizing the weights errs more than the update
    itself.

    **Presets** (``{"name": "pfedcdp", "preset": ...}``, :data:`PRESETS`; ``config.json``'s
    ``preset`` block says where each value came from): ``"paper"``, every value paper 000
    states (epsilon 5 over the run, C2 2.5, 8 bits on the update, models A / B / C and the
    student, FedAvg, eq. 17 summed, 20 local epochs) and medfl's choice for each value it
    leaves open; ``"authors_v1_7"`` (and ``"authors"``, its alias), the authors' v1.7 client
    files (``PFedCDP/v1.7/PFedCDP/client.py``, ``client1.py``, ``client2.py``) in what each
    cluster sends: model B alone noised (``dp_clusters=["medium"]``), sigma 0.606
    (``AUTHORS_V17_NOISE_MULTIPLIER``, epsilon 8 in the code's one-release formula) every round
    on its weights, each weight tensor clipped to 2.5 by its own norm
    (``dp_mode="weights_per_tensor"``: :func:`clip_noise_tensors` in the client step, accounted
    through :meth:`own_dp`), then quantized at 12 bits (``bits`` per cluster,
    :func:`authors_quantize`); models A and C in the clear (not private: their epsilon is
    infinite); the masks not applied; the whole model trains (``kd_scope="model"``) 5 epochs,
    model A on eq. 11 with its softmax outputs soft-maxed again (``kd_input="probabilities"``),
    models B and C on cross-entropy alone (``kd_clusters=["high"]``: their ``fit`` never calls
    ``download_teacher_model``), model C at learning rate 3e-4 (``cluster_lr``); each round
    scored with the cluster's aggregated extractor and the client's own classifier
    (``score="global"``, their ``evaluate``); fixed teacher weights [0.4, 0.35, 0.25].
    What of the v1.7 files is *not* reproduced, and why: model A's teacher is medfl's (the
    cluster's global extractor with the server classifier, every round), while their client A
    loads ``Model_A_server_model-round-{r}.h5`` from its working directory when present
    (client.py, lines 185-200, 387), a file their server writes only in
    ``SaveModelStrategy.aggregate_fit`` after round r, through ``set_weights`` of the clients'
    extractor arrays on ``create_model_A()``, another network with a 3-class MIAS classifier
    (server_main_contrastive_learning.py): as stored, no round-r teacher exists at round r's
    fit, and one left from elsewhere would meet a 2-class student; medfl distils model A as
    its code is written instead. Keras keeps each client's compiled Adam state across rounds,
    medfl builds a new optimizer each round; every v1.7 client loads the whole CBIS-DDSM
    (client.py, line 505; client1.py, line 550; client2.py, line 465), medfl partitions it;
    none of the three files runs as stored: client1.py does not compile (an IndentationError at
    line 281, the nested ``apply_fisher_personalization``'s loop body dedented after its
    ``for`` at line 277), client2.py builds its model at line 448 before ``client_id`` exists
    (line 461), and the ``evaluate`` of client.py and client2.py calls ``precision_score``
    (client.py, line 427; client2.py, line 941) without a module-level sklearn import, so it
    returns zeros from its ``except`` (client.py, lines 486-496); medfl computes the scores.
    ``"authors_formula"``, the code's formula
    at the paper's epsilon 5 (sigma 0.969, ``AUTHORS_NOISE_MULTIPLIER``) on every cluster's
    update without composition (31.4 over 20 rounds). Each value's source is in the preset's
    ``sources``.

    The run scores the refined student, each teacher and the weighted teacher ensemble
    (:meth:`final_models`) on the public test split and on every client's splits
    (``final_metrics.csv``); the clusters are the run's groups (``groups.csv``, per-cluster
    curves in ``plots/groups.png``); :meth:`report` holds the scores, clusters, teacher
    weights and Shapley values.

    Args:
        capabilities: ``"auto"``, ``"draw"``, ``"measure"``, a list of score dicts in client
            order, or ``{client_id: {"cpu", "memory", "battery", "network"}}``.
        capability_weights: w1..w4 of eq. 1 (summing to 1).
        t_high, t_medium: the thresholds T_H and T_M of eq. 2 (the paper gives no values).
        max_latency_ms: the maximum acceptable latency of the network score.
        cluster_models: ``{"high": spec, "medium": spec, "low": spec}`` (any registered model
            with an extractor/classifier split); default the paper's A / B / C.
        fisher_keep: the fraction of extractor entries kept personal (quantile form).
        fisher_threshold: T_Fisher (raw form); give this or ``fisher_keep``.
        fisher_batches: mini-batches for the Fisher information (``None``: the whole split).
        extractor_epochs: local CE epochs of the extractor after the mixing (0: Algorithm 1
            as printed).
        kd_lambda, kd_temperature: lambda and T_KD of eq. 11 (the paper gives no values).
        server_classifier: ``"public"`` or ``"init"`` (see above).
        server_epochs: epochs of the server classifier's fit on the public set per round.
        epsilon, clip, delta, accountant: the update's DP (paper: epsilon 5, C2 2.5);
            ``epsilon=None`` (and no ``noise_multiplier``) sends it without noise (not
            private; the run says so).
        noise_multiplier: sigma of every round instead of a target ``epsilon`` (give one of
            the two, the other null); the accountant records the epsilon spent.
        bits: quantization bits (paper: 8); ``None`` sends floats.
        quantize: ``"update"`` (eq. 14, default) or ``"weights"`` (only without DP).
        cluster_average: ``"weighted"`` (FedAvg by training-set size, default) or
            ``"uniform"``.
        refine: run the post-hoc refinement.
        student_model: the student's spec.
        refine_epochs, refine_lr: the student's training.
        alpha, refine_temperature, tau: eq. 18's alpha, T and SupCon's temperature.
        supcon_reduction: ``"sum"`` (eq. 17's text, default) or ``"mean"`` over the anchors.
        supcon_views: 1 (default) or 2 augmented views of each public sample (eq. 17's 2N).
        dp_mode: ``"update"`` (eqs. 12-13, the engine's ``dp_gaussian``) or
            ``"weights_per_tensor"`` (the authors' noise on the weights, each tensor clipped;
            needs ``noise_multiplier`` and ``quantize="weights"``).
        dp_clusters: the clusters whose replies are noised (default all three; a subset needs
            ``dp_mode="weights_per_tensor"``): ``mechanisms.csv``'s ``dp_noise`` says per cluster
            whether it was (``noised``) and at what ``sigma``.
        apply_masks: apply eq. 6 (default) or start each round from the global extractor (the
            masks still computed: ``personal_fraction``).
        kd_scope: ``"classifier"`` (Algorithm 1, the extractor frozen) or ``"model"`` (the whole
            model trains).
        kd_clusters: the clusters whose clients train on eq. 11 (default all three); the others
            train on cross-entropy alone and build no teacher.
        cluster_lr: ``{cluster: learning rate or null}``, the local learning rate per cluster
            (null or absent: ``train.lr``).
        kd_input: ``"logits"`` (eq. 11 on the logits) or ``"probabilities"`` (the model's
            output soft-maxed before eq. 11, which soft-maxes it again: the authors' models end
            in a softmax layer).
        score: ``"personal"`` (each client's own extractor and classifier) or ``"global"`` (its
            cluster's aggregated extractor with its own classifier) is what a client's
            evaluation scores; ``summary.json``'s ``scoring`` names it.
        teacher_weights: ``"shapley"``, ``"uniform"``, ``"fixed"`` or a list of weights.
        shapley_score: v(S)'s score: ``accuracy``, ``balanced_accuracy`` or ``auc``.
        shapley_samples: public samples per class in the Shapley game (``None``: as many as
            the smallest class has).
        feature_shap: ``"off"``, ``"printed"`` (eqs. 16 and 19 as printed) or ``"input"``
            (psi weights the student's input, feature by feature).
        shap_samples: public samples explained per teacher (and as many as background).
        shap_nsamples: GradientExplainer's samples per explained input (its ``nsamples``).
        grad_clip: the global gradient-norm clip of the client's local training (both
            phases) and of the server classifier's fit; not in the paper, ``None`` turns it off. With the paper's privacy
            (epsilon 5, C2 2.5) every coordinate of a client's update gets noise of standard
            deviation sigma * C2 (sigma 1.35 for 2 rounds, 4.27 for the paper's 20: noise of
            3.4 to 10.7 per coordinate against an update clipped to norm 2.5), so the cluster's
            extractor is mostly noise and unclipped local steps on it overflow; the clip keeps
            training finite.
    """

    name = "pfedcdp"
    description = ("PFedCDP: capability clusters, Fisher-masked personalisation, classifier KD, DP + quantized "
                   "extractor updates, Shapley-weighted MTKD + SupCon on a public set")
    reply_state = {"extractor": "extractor"}
    supports_dp_sgd = False
    presets = PRESETS
    # the Fisher masks' share, the extractor's own epochs, personal_observables' norms
    train_metrics = ENGINE_TRAIN_METRICS | {"fisher_batches", "personal_fraction", "loss_extractor",
                                            "steps_extractor", "own_norm", "above_one", "personal_norm",
                                            "personal_norm_prev", "personal_drift", "weight_dp_releases"}
    profile_metrics = frozenset(SCORES)

    def __init__(self, capabilities: Any = "auto", capability_weights: list[float] | tuple[float, ...] = (0.25,) * 4,
                 t_high: float = 0.6, t_medium: float = 0.4, max_latency_ms: float = 200.0,
                 cluster_models: dict[str, dict[str, Any]] | None = None,
                 fisher_keep: float | None = 0.2, fisher_threshold: float | None = None,
                 fisher_batches: int | None = None, extractor_epochs: int = 1,
                 kd_lambda: float = 0.5, kd_temperature: float = 2.0,
                 server_classifier: str = "public", server_epochs: int = 1,
                 epsilon: float | None = 5.0, clip: float = 2.5, delta: float = 1e-5, accountant: str = "rdp",
                 bits: int | None = 8, refine: bool = True, student_model: dict[str, Any] | None = None,
                 refine_epochs: int = 5, refine_lr: float = 1e-3, alpha: float = 0.5,
                 refine_temperature: float = 2.0, tau: float = 0.07, teacher_weights: Any = "shapley",
                 shapley_score: str = "accuracy", shapley_samples: int | None = None,
                 feature_shap: str = "off", shap_samples: int = 16, shap_nsamples: int = 200,
                 grad_clip: float | None = 5.0, noise_multiplier: float | None = None, quantize: str = "update",
                 cluster_average: str = "weighted", supcon_reduction: str = "sum", supcon_views: int = 1,
                 dp_mode: str = "update", dp_clusters: list[str] | tuple[str, ...] | None = None,
                 apply_masks: bool = True, kd_scope: str = "classifier",
                 kd_clusters: list[str] | tuple[str, ...] | None = None,
                 cluster_lr: dict[str, float | None] | None = None, kd_input: str = "logits",
                 score: str = "personal") -> None:
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
                    overall_score(dict(e), capability_weights)
                except (TypeError, ValueError) as exc:
                    raise MethodConfigError(f"pfedcdp: capabilities: {exc}") from None
        self.capabilities = capabilities
        try:
            overall_score({k: 1.0 for k in SCORES}, capability_weights)
            assign_cluster(0.5, float(t_high), float(t_medium))
        except (TypeError, ValueError) as exc:
            raise MethodConfigError(f"pfedcdp: {exc}") from None
        self.capability_weights = [float(w) for w in capability_weights]
        self.t_high, self.t_medium = float(t_high), float(t_medium)
        self.max_latency_ms = _check_pos(max_latency_ms, "max_latency_ms")
        models = dict(DEFAULT_CLUSTER_MODELS)
        if cluster_models is not None:
            if not isinstance(cluster_models, dict) or set(cluster_models) - set(CLUSTERS):
                raise MethodConfigError(f"pfedcdp: cluster_models must map some of {', '.join(CLUSTERS)} to model "
                                        f"specs, got {cluster_models!r}")
            for c, spec in cluster_models.items():
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                    raise MethodConfigError(f"pfedcdp: cluster_models[{c!r}] must be a model spec with a 'name'")
                models[c] = dict(spec)
        self.cluster_models = models
        if (fisher_keep is None) == (fisher_threshold is None):
            raise MethodConfigError("pfedcdp: give exactly one of fisher_keep (a fraction, e.g. 0.2) or "
                                    "fisher_threshold (T_Fisher); set the other to null")
        self.fisher_keep = None if fisher_keep is None else _check_unit(fisher_keep, "fisher_keep")
        self.fisher_threshold = None if fisher_threshold is None else float(fisher_threshold)
        self.fisher_batches = None if fisher_batches is None else _check_pos_int(fisher_batches, "fisher_batches")
        self.extractor_epochs = _check_pos_int(extractor_epochs, "extractor_epochs", zero=True)
        self.kd_lambda = _check_unit(kd_lambda, "kd_lambda")
        self.kd_temperature = _check_pos(kd_temperature, "kd_temperature")
        self.server_classifier = _check_choice(server_classifier, "server_classifier", SERVER_CLASSIFIER)
        self.server_epochs = _check_pos_int(server_epochs, "server_epochs")
        self.epsilon = None if epsilon is None else _check_pos(epsilon, "epsilon")
        self.noise_multiplier = None if noise_multiplier is None else _check_pos(noise_multiplier, "noise_multiplier")
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise MethodConfigError(f"pfedcdp: give exactly one of epsilon (a target over the run; sigma is derived) "
                                    f"or noise_multiplier (sigma of every round; the run records the epsilon it "
                                    f"spends), and set the other to null; got epsilon {epsilon!r} and "
                                    f"noise_multiplier {noise_multiplier!r}")
        self.quantize = _check_choice(quantize, "quantize", QUANTIZE)
        self.dp_mode = _check_choice(dp_mode, "dp_mode", DP_MODES)
        self.dp_clusters = _check_clusters(dp_clusters, "dp_clusters", "the clusters whose extractors are noised")
        if self.dp_mode == "update" and self.dp and len(self.dp_clusters) != len(CLUSTERS):
            raise MethodConfigError(f"pfedcdp: dp_clusters {self.dp_clusters} needs dp_mode 'weights_per_tensor': "
                                    "dp_mode 'update' noises the update with the engine's dp_gaussian filter, which "
                                    "every client applies")
        if self.dp_mode == "weights_per_tensor":
            if self.epsilon is not None:
                raise MethodConfigError(f"pfedcdp: dp_mode 'weights_per_tensor' (the authors' noise on the weights, "
                                        f"preset authors_v1_7) takes sigma as noise_multiplier (the authors' code has "
                                        f"no accountant; the run records the epsilon spent), got epsilon {epsilon!r}; "
                                        "for a target epsilon use dp_mode 'update' with dp_clusters of all three "
                                        "clusters and quantize 'update' (eqs. 12-14, preset paper)")
            if quantize != "weights":
                raise MethodConfigError("pfedcdp: dp_mode 'weights_per_tensor' sends noised weights, so what is "
                                        "quantized is the weights: set quantize 'weights'")
        elif self.quantize == "weights" and self.dp:
            raise MethodConfigError("pfedcdp: quantize 'weights' needs the update without DP (dp_gaussian makes the "
                                    "chain send the noised update, which is what is quantized); set epsilon and "
                                    "noise_multiplier to null, or quantize 'update'")
        if not isinstance(apply_masks, bool):
            raise MethodConfigError(f"pfedcdp: apply_masks must be true or false, got {apply_masks!r}")
        self.apply_masks = apply_masks
        self.kd_scope = _check_choice(kd_scope, "kd_scope", KD_SCOPES)
        self.kd_clusters = _check_clusters(kd_clusters, "kd_clusters", "the clusters whose clients train on eq. 11; "
                                           "the others train on cross-entropy alone")
        if cluster_lr is not None:
            if not isinstance(cluster_lr, dict) or set(cluster_lr) - set(CLUSTERS):
                raise MethodConfigError(f"pfedcdp: cluster_lr must map some of {', '.join(CLUSTERS)} to a learning "
                                        f"rate > 0 or null (train.lr), got {cluster_lr!r}")
            cluster_lr = {c: None if cluster_lr.get(c) is None else _check_pos(cluster_lr[c], f"cluster_lr[{c!r}]")
                          for c in CLUSTERS}
        self.cluster_lr: dict[str, float | None] | None = cluster_lr
        self.kd_input = _check_choice(kd_input, "kd_input", KD_INPUTS)
        self.score = _check_choice(score, "score", SCORES_MODES)
        self.cluster_average = _check_choice(cluster_average, "cluster_average", CLUSTER_AVERAGE)
        self.supcon_reduction = _check_choice(supcon_reduction, "supcon_reduction", SUPCON_REDUCTIONS)
        if supcon_views not in SUPCON_VIEWS or isinstance(supcon_views, bool):
            raise MethodConfigError(f"pfedcdp: supcon_views must be 1 or 2 (two augmented views of each public "
                                    f"sample, eq. 17's 2N), got {supcon_views!r}")
        self.supcon_views = int(supcon_views)
        self.clip = _check_pos(clip, "clip")
        self.delta = float(delta)
        self.accountant = str(accountant)
        def bad_bits(b: Any) -> bool:
            return b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 16)

        if isinstance(bits, dict):
            if set(bits) != set(CLUSTERS) or any(bad_bits(b) for b in bits.values()):
                raise MethodConfigError(f"pfedcdp: bits per cluster must map each of {', '.join(CLUSTERS)} to an "
                                        f"integer from 1 to 16 or null, got {bits!r}")
            if self.quantize != "weights":
                raise MethodConfigError("pfedcdp: bits per cluster quantizes in the client step, on the weights "
                                        "(the authors' code): set quantize 'weights'")
            bits = {c: bits[c] for c in CLUSTERS}
        elif bad_bits(bits):
            raise MethodConfigError(f"pfedcdp: bits must be an integer from 1 to 16, null, or one of those per "
                                    f"cluster, got {bits!r}")
        self.bits: int | dict[str, int | None] | None = bits
        self.refine = bool(refine)
        self.student_model = dict(student_model or {"name": "pfedcdp_student"})
        self.refine_epochs = _check_pos_int(refine_epochs, "refine_epochs", zero=True)
        self.refine_lr = _check_pos(refine_lr, "refine_lr")
        self.alpha = _check_unit(alpha, "alpha")
        self.refine_temperature = _check_pos(refine_temperature, "refine_temperature")
        self.tau = _check_pos(tau, "tau")
        if isinstance(teacher_weights, str):
            if teacher_weights not in TEACHER_WEIGHTS:
                raise MethodConfigError(f"pfedcdp: teacher_weights must be one of {', '.join(TEACHER_WEIGHTS)} or a "
                                        f"list of numbers, got {teacher_weights!r}")
        elif not (isinstance(teacher_weights, (list, tuple)) and teacher_weights
                  and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in teacher_weights)
                  and sum(teacher_weights) > 0):
            raise MethodConfigError(f"pfedcdp: teacher_weights list must hold non-negative numbers with a positive "
                                    f"sum, got {teacher_weights!r}")
        self.teacher_weights = teacher_weights if isinstance(teacher_weights, str) else [float(w) for w in teacher_weights]
        self.shapley_score = _check_choice(shapley_score, "shapley_score", SHAPLEY_SCORES)
        self.shapley_samples = None if shapley_samples is None else _check_pos_int(shapley_samples, "shapley_samples")
        self.feature_shap = _check_choice(feature_shap, "feature_shap", FEATURE_SHAP)
        self.shap_samples = _check_pos_int(shap_samples, "shap_samples")
        self.shap_nsamples = _check_pos_int(shap_nsamples, "shap_nsamples")
        self.grad_clip = None if grad_clip is None else _check_pos(grad_clip, "grad_clip")

    @property
    def dp(self) -> bool:
        """Whether the extractor's update is noised (``epsilon`` or ``noise_multiplier`` given)."""
        return self.epsilon is not None or self.noise_multiplier is not None

    def hparams(self) -> dict[str, Any]:
        """The resolved hyperparameters (cluster_models and student_model filled in)."""
        out = super().hparams()
        out["capability_weights"] = list(self.capability_weights)
        return out

    # ------------------------------------------------------------------ shared
    def _spec(self, c: str) -> dict[str, Any]:
        fed = self.federation
        return {"spatial_dims": fed.spatial_dims, "in_channels": fed.in_channels, "num_classes": fed.num_classes,
                **self.cluster_models[c]}

    def _dp_entry(self) -> dict[str, Any]:
        """The ``dp_gaussian`` entry of :meth:`default_filters` (a target epsilon or sigma)."""
        noise = {"epsilon": self.epsilon} if self.epsilon is not None else {"noise_multiplier": self.noise_multiplier}
        return {"name": "dp_gaussian", **noise, "clip": self.clip, "delta": self.delta, "accountant": self.accountant,
                "keys": "all"}

    @property
    def in_step(self) -> bool:
        """Whether the client step itself noises and quantizes its extractor's weights (the
        authors' pipeline: ``dp_mode="weights_per_tensor"`` or bits per cluster) instead of the
        engine's filters."""
        return self.dp_mode == "weights_per_tensor" or isinstance(self.bits, dict)

    def cluster_bits(self, c: str) -> int | None:
        """The quantization bits of cluster ``c``'s replies (``None``: sent as floats)."""
        return self.bits.get(c) if isinstance(self.bits, dict) else self.bits

    def noised(self, c: str) -> bool:
        """Whether cluster ``c``'s replies carry DP noise."""
        return self.dp and c in self.dp_clusters

    def default_filters(self) -> list[dict[str, Any]]:
        """``dp_gaussian`` on the extractor's update (clip C2, a target epsilon or a noise
        multiplier; ``keys: all``: the reply holds the extractor's parameters only, and the
        cluster models differ from the run's ``fl.model``) and ``quantize`` (bits; on the
        update unless ``quantize="weights"``). None where the client step does both itself
        (:attr:`in_step`: the authors' noise on the weights of some clusters, bits per cluster)."""
        out: list[dict[str, Any]] = []
        if self.dp and self.dp_mode == "update":
            out.append(self._dp_entry())
        if self.bits is not None and not self.in_step:
            out.append({"name": "quantize", "bits": self.bits, "update": self.quantize == "update"})
        return out

    def own_dp(self, federation: Federation) -> OwnDp | None:
        """The authors' noise on the weights (``dp_mode="weights_per_tensor"``), applied in the
        client step to the clusters of ``dp_clusters``: one release a round of each member's
        extractor weights, each of its L tensors clipped to ``clip``, noise ``clip * sigma`` per
        entry. Accounted as a Gaussian release of the whole extractor, whose L2 sensitivity
        (the weights against none, as ``dp_gaussian``'s update against none) is ``clip *
        sqrt(L)``: noise multiplier ``sigma / sqrt(L)`` per client of a noised cluster, 0
        (epsilon infinite, not private) per client of a cluster sent in the clear. ``None``
        otherwise (the engine's ``dp_gaussian`` filter accounts the update's noise)."""
        if not (self.dp and self.dp_mode == "weights_per_tensor"):
            return None
        return OwnDp(mechanism=WEIGHT_DP, unit="client", noise_multiplier=_PerClient(self.client_noise), sample_rate=1.0,
                     steps=1, clip=self.clip, delta=self.delta, accountant=self.accountant,
                     steps_metric="weight_dp_releases",
                     statement=(f"each extractor weight tensor clipped to {self.clip:g} by its L2 norm and Gaussian "
                                f"noise of std {self.clip:g} x {self.noise_multiplier:.4g} added to the weights, in "
                                f"clusters {', '.join(self.dp_clusters) or 'none'}; the other clusters send their "
                                "weights in the clear (noise multiplier 0: not private). The per-client noise "
                                "multiplier, sigma / sqrt(number of tensors), is resolved after the capability "
                                "profile; privacy.csv has each client's"),
                     noised_values=_PerClient(self.client_noised_values))

    def client_noise(self, client_id: str) -> float:
        """The noise multiplier :meth:`own_dp` accounts for ``client_id`` (see :class:`_PerClient`)."""
        c = getattr(self, "assign", {}).get(client_id)
        if c is None or not self.noised(c) or self.noise_multiplier is None:
            return 0.0
        return float(self.noise_multiplier) / math.sqrt(len(self.extractors[c]))

    def client_noised_values(self, client_id: str) -> int:
        """How many values :meth:`own_dp`'s noise covers at ``client_id``: its cluster's extractor
        weights (0 before the client has a cluster)."""
        c = getattr(self, "assign", {}).get(client_id)
        if c is None or c not in getattr(self, "extractors", {}):
            return 0
        return int(sum(t.numel() for t in self.extractors[c].values()))

    def _signal_bound(self, c: str) -> float:
        """The largest L2 norm of what a cluster-``c`` client sends before the noise: C2 for the
        clipped update, ``clip * sqrt(L)`` for the weights clipped tensor by tensor."""
        if self.dp_mode == "update":
            return self.clip
        return self.clip * math.sqrt(len(self.extractors[c]))

    # ------------------------------------------------------------------ coordinator: setup, profile
    def setup(self, federation: Federation) -> None:
        """One model per cluster (seeded); the server classifiers fitted on the public set."""
        super().setup(federation)
        if isinstance(self.capabilities, (list, tuple)) and len(self.capabilities) != len(federation.eval_client_ids):
            raise MethodConfigError(f"pfedcdp: capabilities lists {len(self.capabilities)} clients, the run has "
                                    f"{len(federation.eval_client_ids)}")
        if isinstance(self.capabilities, dict):
            missing = sorted(set(federation.eval_client_ids) - set(map(str, self.capabilities)))
            if missing:
                raise MethodConfigError(f"pfedcdp: capabilities has no scores for client(s) {missing}")
        needs_public = self.server_classifier == "public" or self.refine
        if needs_public and federation.public is None:
            raise MethodConfigError("pfedcdp: server_classifier 'public' and the post-hoc refinement need a public "
                                    "dataset at the coordinator: set fl.public_dataset (e.g. MIAS), or use "
                                    "server_classifier: 'init' and refine: false")
        self.extractors: dict[str, State] = {}
        self.buffers: dict[str, State] = {}
        self.heads: dict[str, State] = {}
        for c in CLUSTERS:
            model = build_seeded(self._spec(c), derive_seed(federation.seed, "pfedcdp", c))
            params, buffers, head = _split_keys(model)
            state = get_state(model)
            self.extractors[c] = {k: state[k] for k in params}
            self.buffers[c] = {k: state[k] for k in buffers}
            self.heads[c] = {k: state[k] for k in head}
        # the initial models' BatchNorm statistics and server classifiers come from the public
        # set before round 1's instructions (configure_round); a resumed run loads them instead
        self._initial_fit_due = True
        self.assign: dict[str, str] = {}
        self.scores: dict[str, dict[str, float]] = {}
        self.trained: set[str] = set()
        self.report_: dict[str, Any] = {}
        self.student: State | None = None
        self._student_rows: list[dict[str, Any]] = []
        self.sigma = self._planned_sigma(federation)
        self.observed: dict[str, Any] = {}     # this round's mechanism observables (server_update)
        self.history: dict[str, dict[str, dict[str, float]]] = {}   # {observable: {id: {round: value}}}
        self.warned: list[str] = []            # what mechanism_warnings has said (once each)
        self.first_noised_round: int | None = None   # the first round a noised cluster's replies were averaged

    def _planned_sigma(self, federation: Federation) -> float:
        """The noise multiplier of the run's extractor updates, planned as the engine plans the
        ``dp_gaussian`` of :meth:`default_filters` (the same filter, the same federation): the
        given ``noise_multiplier``, or the accountant's for ``epsilon`` over the planned
        rounds; 0 without DP."""
        if not self.dp:
            return 0.0
        if self.dp_mode == "weights_per_tensor":
            return float(self.noise_multiplier)
        entry = self._dp_entry()
        dp = lookup("filter", entry.pop("name")).from_config(entry)
        dp.plan(federation, "pfedcdp: the noise plan of its mechanisms")
        return float(dp.noise_multiplier)

    def configure_profile(self) -> dict[str, Instruction]:
        """Every client reports its four capability scores."""
        return {cid: Instruction() for cid in self.federation.eval_client_ids}

    def client_profile(self, client: "ClientContext", instruction: Instruction) -> dict[str, float]:
        """The four scores of eq. 1 (measured, drawn or configured; see the class docstring)."""
        mode = self.capabilities
        if isinstance(mode, dict):
            return {k: float(v) for k, v in dict(mode[client.client_id]).items() if k in SCORES}
        if isinstance(mode, (list, tuple)):
            if not client.client_id.isdigit() or int(client.client_id) >= len(mode):
                raise MethodConfigError(f"pfedcdp: capabilities is a list; client {client.client_id!r} has no entry")
            return {k: float(v) for k, v in dict(mode[int(client.client_id)]).items() if k in SCORES}
        if mode == "measure" or (mode == "auto" and client.deployed):
            scores, notes = measure_capabilities(client.coordinator or None, max_latency_ms=self.max_latency_ms)
            logger.info(f"medfl pfedcdp: client {client.client_id}: capability scores measured on this machine: "
                        + "; ".join(f"{k} {scores[k]:.3f} ({notes[k]})" for k in SCORES))
            return {k: float(scores[k]) for k in SCORES}
        return dict(draw_capabilities([client.client_id], client.seed)[client.client_id])

    def server_profile(self, results: dict[str, dict[str, float]]) -> None:
        """Eqs. 1-2: each client's overall score and cluster; missing or bad scores -> Low."""
        for cid in self.federation.eval_client_ids:
            got = results.get(cid)
            try:
                if got is None:
                    raise ValueError("no answer")
                scores = {k: float(got[k]) for k in SCORES}
                score = overall_score(scores, self.capability_weights)
                self.assign[cid] = assign_cluster(score, self.t_high, self.t_medium)
                self.scores[cid] = {**scores, "overall": score}
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning(f"medfl pfedcdp: client {cid}: no usable capability scores ({exc}); placed in the low "
                               "cluster")
                self.assign[cid] = "low"
                self.scores[cid] = {"overall": float("nan")}

    def _cluster(self, cid: str) -> str:
        if not self.assign:  # a run resumed before round 1's checkpoint without a profile: all Low
            raise MethodConfigError("pfedcdp: clients have no clusters (the profile exchange did not run)")
        return self.assign.get(cid, "low")

    # ------------------------------------------------------------------ coordinator: rounds
    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Each sampled client gets its cluster's extractor, server classifier and spec (the
        first call of a fresh run fits the initial models on the public set first, so round
        1's teacher is not random)."""
        if self._initial_fit_due:
            for c in CLUSTERS:
                self._calibrate(c)
                if self.server_classifier == "public":
                    self._fit_head(c, 0)
            self._initial_fit_due = False
        out = {}
        self._instructed = list(self.federation.sample(round))
        for cid in self._instructed:
            c = self._cluster(cid)
            config: dict[str, Any] = {"spec": json.dumps(self._spec(c)), "cluster": c}
            if self.in_step:        # the round seeds the client step's noise
                config["round"] = round
            out[cid] = Instruction(payload=self._payload(c), config=config)
        return out

    def _payload(self, c: str) -> dict[str, State]:
        """Cluster ``c``'s model as sent: the extractor's parameters (what the client's
        reply updates), its buffers and the server's classifier."""
        return {"extractor": self.extractors[c], "extractor_buffers": self.buffers[c], "server_head": self.heads[c]}

    def _state(self, c: str) -> State:
        """Cluster ``c``'s whole model state (extractor, its buffers, server classifier)."""
        return {**self.extractors[c], **self.buffers[c], **self.heads[c]}

    def _cluster_model(self, c: str) -> nn.Module:
        """Cluster ``c``'s model holding :meth:`_state`, on the run's device."""
        model = build_seeded(self._spec(c), 0, self.federation.device)
        model.load_state_dict(self._state(c))
        return model

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """FedAvg (or the uniform mean) of the (dequantized, noised) extractors within each
        cluster; the server classifiers refitted on the public set; the round's observables."""
        self.observed = {"round": round, "clusters": {}, "clients": {},
                         "noised_missing": sorted(cid for cid in getattr(self, "_instructed", [])
                                                  if cid not in replies and self.noised(self._cluster(cid)))}
        for c in CLUSTERS:
            members = [cid for cid in replies if self._cluster(cid) == c]
            if not members:
                continue
            states = [replies[cid].payload["extractor"] for cid in members]
            weights = [float(max(replies[cid].num_examples, 0)) for cid in members]
            if self.cluster_average == "uniform" or sum(weights) <= 0:
                weights = [1.0] * len(members)
            old = self.extractors[c]
            self.extractors[c] = weighted_average(states, weights)
            self._observe_cluster(c, old, states, weights)
            for cid in members:
                self._observe_client(cid, c, replies[cid].metrics)
            self.trained.update(members)
            self._calibrate(c)
            if self.server_classifier == "public":
                self._fit_head(c, round)

    # ------------------------------------------------------------------ coordinator: what the mechanisms did
    def _observe_cluster(self, c: str, old: State, states: list[State], weights: list[float]) -> None:
        """Cluster ``c``'s observables of this round (see the class docstring): the noise the
        plan puts in its averaged update against the largest clipped update, quantization's
        error against the received updates, the new cluster model's magnitudes."""
        total = sum(weights)
        w2 = sum((w / total) ** 2 for w in weights)
        d = sum(v.numel() for v in old.values() if v.is_floating_point())
        new = self.extractors[c]
        received = [{k: s[k].double() - old[k].double() for k in old if old[k].is_floating_point()} for s in states]
        sigma = self.sigma if self.noised(c) else 0.0
        noise = sigma * self.clip * math.sqrt(d * w2)
        bound = self._signal_bound(c)
        obs: dict[str, Any] = {
            "dp_noise": {"clients": float(len(states)), "coordinates": float(d), "noised": float(self.noised(c)),
                         "target": "weights" if self.dp_mode == "weights_per_tensor" else "update",
                         "sigma": sigma, "clip": self.clip, "signal_bound": bound, "weights_sq_sum": w2,
                         "noise_norm": noise, "noise_per_coordinate": sigma * self.clip * math.sqrt(w2),
                         "noise_to_update_min": noise / bound,
                         "received_update_norm": _norm(new[k].double() - old[k].double() for k in received[0])},
            "cluster_model": {"norm": _norm(new.values()),
                              "above_one": sum(int((v.abs() > 1.0).sum()) for v in new.values()) / max(d, 1)}}
        bits = self.cluster_bits(c)
        if bits is not None:
            target = "update" if self.dp_mode == "update" and (self.dp or self.quantize == "update") else "weights"
            errors = [quantization_error(u if target == "update" else s, bits) for u, s in zip(received, states)]
            norms = [_norm(u.values()) for u in received]
            err, upd = sum(errors) / len(errors), sum(norms) / len(norms)
            obs["quantization"] = {"bits": float(bits), "target": target, "error_norm": err,
                                   "update_norm": upd, "error_to_update": err / upd if upd > 0 else float("nan")}
        self.observed["clusters"][c] = obs
        if self.noised(c) and self.first_noised_round is None:
            self.first_noised_round = int(self.observed["round"])
        self._remember("noise_to_update_min", c, obs["dp_noise"]["noise_to_update_min"])
        if "quantization" in obs:
            self._remember("quantization_error_to_update", c, obs["quantization"]["error_to_update"])

    def _observe_client(self, cid: str, c: str, metrics: dict[str, float]) -> None:
        """Client ``cid``'s observables of this round: the scalars its reply reported
        (:func:`personal_observables`) and its personal share (eq. 4)."""
        names = ("personal_fraction", "own_norm", "above_one", "personal_norm", "personal_norm_prev",
                 "personal_drift")
        obs = {k: float(metrics[k]) for k in names if isinstance(metrics.get(k), (int, float))}
        self.observed["clients"][cid] = {"cluster": c, **obs}
        for k in ("above_one", "personal_drift"):
            if k in obs:
                self._remember(k, cid, obs[k])

    def _remember(self, what: str, who: str, value: float) -> None:
        self.history.setdefault(what, {}).setdefault(who, {})[str(self.observed["round"])] = float(value)

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """The observables of ``round`` (``mechanisms.csv``): per cluster ``dp_noise``,
        ``quantization`` and ``cluster_model``, per client ``personalization`` (the class
        docstring says what each value is)."""
        if self.observed.get("round") != round:
            return []
        rows: list[dict[str, Any]] = []
        for c, obs in self.observed["clusters"].items():
            rows += [{"mechanism": name, "scope": "cluster", "id": c, **vals} for name, vals in obs.items()]
        for cid, obs in self.observed["clients"].items():
            rows.append({"mechanism": "personalization", "scope": "client", "id": cid, **obs})
        return rows

    def scored_from(self, round: int) -> int | None:
        """The first round whose evaluated (personal) models PFedCDP's noise shaped, as known after
        ``round``. A client's round-r personal model is its own extractor and classifier after its
        round-r training, which starts from the cluster model averaged in round r - 1 (eq. 6 takes
        the unkept share from it; without the masks it is all of it) and distils from it (eq. 11);
        the noise a client adds to its round-r reply reaches the cluster model only in that
        round's :meth:`server_update`, after the round's personal models were made (the client
        keeps its own, un-noised model). So with noise on, the first round whose personal models
        saw a noisy update is the round after the first round in which a noised cluster's
        replies were averaged: round 2 when round 1's clients send noised extractors (``None``
        after round 1, 2 from round 2 on). Without noise (``epsilon`` and ``noise_multiplier``
        null), or when no client is in a noised cluster (``dp_clusters``), nothing noisy ever
        reaches a personal model and the distillation from the cluster's model shapes round 1's
        already: 1. With ``score="global"`` a round's evaluation scores the cluster model averaged
        in that round, so the first noised round is itself the first one scored on noise."""
        if not self.dp or not any(self.noised(c) for c in self.assign.values()):
            return 1
        # score "global": the round's evaluation scores the cluster model averaged in that very
        # round, so the first round whose replies were noised is already scored on noise
        lag = 0 if self.score == "global" else 1
        if self.first_noised_round is None or self.first_noised_round + lag > round:
            return None
        return self.first_noised_round + lag

    def mechanism_warnings(self, round: int) -> list[str]:
        """Once each: the noise drowns a cluster's update; a client's own weights blew up;
        quantizing the weights errs more than the update."""
        if self.observed.get("round") != round:
            return []
        out = []
        for c, obs in self.observed["clusters"].items():
            dp = obs["dp_noise"]
            if dp["noise_to_update_min"] >= NOISE_WARN_RATIO and f"noise:{c}" not in self.warned:
                self.warned.append(f"noise:{c}")
                need = dp["signal_bound"] / (self.clip * math.sqrt(dp["coordinates"] * dp["weights_sq_sum"]))
                out.append(
                    f"cluster {c}: the DP noise in the averaged extractor update has norm {dp['noise_norm']:.4g}, at "
                    f"least {dp['noise_to_update_min']:.3g}x any clipped {dp['target']} (sigma {self.sigma:.3g}, C2 "
                    f"{self.clip:g}, {int(dp['coordinates'])} coordinates, {int(dp['clients'])} client(s)): the "
                    f"cluster model is mostly noise, and eq. 6 copies it into "
                    + ("the unkept share of every member's own extractor." if self.apply_masks else
                       "every member's extractor (apply_masks false: all of it).")
                    + f" A ratio of 1 needs sigma <= {need:.3g}: a larger epsilon, fewer rounds, more clients "
                    f"per cluster or a smaller extractor"
                    + (f" (the authors' formula at the paper's epsilon, sigma 0.969 a round, preset 'authors_formula', "
                       f"epsilon 31.4 over 20 rounds, would still give {AUTHORS_NOISE_MULTIPLIER / need:.3g}x)"
                       if abs(self.sigma - AUTHORS_NOISE_MULTIPLIER) > 1e-9 else "")
                    + "; mechanisms.csv has the ratio per round")
            q = obs.get("quantization")
            if (q and q["target"] == "weights" and q["error_to_update"] > 1.0
                    and f"quantization:{c}" not in self.warned):
                self.warned.append(f"quantization:{c}")
                out.append(f"cluster {c}: {int(q['bits'])}-bit quantization of the weights errs "
                           f"{q['error_to_update']:.3g}x the update itself (error norm {q['error_norm']:.3g}); "
                           "quantize 'update' (eq. 14) quantizes the update instead")
        missing = self.observed.get("noised_missing") or []
        if missing and len(CLUSTERS) > len(self.dp_clusters) and "noised_missing" not in self.warned:
            self.warned.append("noised_missing")
            out.append(f"client(s) {', '.join(missing)} of the noised cluster(s) {', '.join(self.dp_clusters)} sent "
                       "no usable reply this round (reply_events.csv says why), so no noised update reached the "
                       "cluster's model: the other clusters send their weights in the clear, and until a noised reply "
                       "is averaged no round is scored (scored_from)")
        blown = [(cid, o) for cid, o in self.observed["clients"].items()
                 if o.get("above_one", 0.0) > ABOVE_ONE_WARN or o.get("personal_drift", 0.0) > DRIFT_WARN]
        new = [cid for cid, _ in blown if f"blowup:{cid}" not in self.warned]
        if new:
            self.warned.extend(f"blowup:{cid}" for cid in new)
            now = [100 * o.get("above_one", 0.0) for cid, o in blown if cid in new]
            first = [100 * min(self.history.get("above_one", {}).get(cid, {}).items(), key=lambda kv: int(kv[0]),
                               default=("", float("nan")))[1] for cid in new]
            drifted = [cid for cid, o in blown if cid in new and o.get("personal_drift", 0.0) > DRIFT_WARN]
            out.append(f"the personal models blew up: client(s) {', '.join(new)} have {min(now):.0f}-{max(now):.0f} % "
                       f"of their own extractor's weights above 1 in magnitude ({min(first):.0f}-{max(first):.0f} % "
                       "in their first round)"
                       + (f"; the Fisher-kept weights of client(s) {', '.join(drifted)} moved more than their own "
                          "norm" if drifted else "")
                       + ". Eq. 6 takes the unkept share of each client's extractor from its cluster model, which the "
                       "DP noise dominates (dp_noise in mechanisms.csv): a larger epsilon or fewer rounds, more "
                       "clients per cluster, or no DP (epsilon null) to see the mechanism without it")
        return out

    def _calibrate(self, c: str) -> None:
        """Re-estimate cluster ``c``'s BatchNorm statistics on the public training split
        (clients never send theirs; without a public set or BatchNorm, nothing changes)."""
        fed = self.federation
        if not self.buffers[c] or fed.public is None:
            return
        model = self._cluster_model(c)
        loader = fed.public.loader("train", batch_size=int(fed.train.get("batch_size", 16)), shuffle=False,
                                   augment=False)
        if recalibrate_norms(model, loader, fed.device):
            state = get_state(model)
            self.buffers[c] = {k: state[k] for k in self.buffers[c]}

    def _fit_head(self, c: str, round: int) -> None:
        """Fit cluster ``c``'s server classifier on the public training split on top of its
        frozen extractor (``server_epochs`` epochs of cross-entropy)."""
        fed = self.federation
        model = self._cluster_model(c)
        seed = derive_seed(fed.seed, "server_head", c, round)
        loader = fed.public.loader("train", batch_size=int(fed.train.get("batch_size", 16)), seed=seed)
        head = list(model.head.parameters())
        for p in model.parameters():
            p.requires_grad_(False)
        for p in head:
            p.requires_grad_(True)
        opt = make_optimizer(head, fed.train)

        def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _freeze_body(m)
            with torch.no_grad():
                z = m.embed(x)
            return nn.functional.cross_entropy(m.head(z), y)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            train_epochs(model, loader, opt, self.server_epochs, device=fed.device, loss_fn=loss,
                         clip_grad_norm=self.grad_clip)
        state = get_state(model)
        self.heads[c] = {k: state[k] for k in self.heads[c]}

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """The cluster's spec; the cluster's model too for a client that never trained, and for
        every client with ``score="global"`` (its aggregated extractor is what is scored)."""
        out = {}
        for cid in self.federation.eval_client_ids:
            c = self._cluster(cid)
            payload = self._payload(c) if self.score == "global" or cid not in self.trained else {}
            out[cid] = Instruction(payload=payload, config={"spec": json.dumps(self._spec(c)), "cluster": c,
                                                            "score": self.score})
        return out

    def client_groups(self) -> dict[str, str]:
        """The capability cluster of each client."""
        return dict(self.assign)

    # ------------------------------------------------------------------ client
    def _client_spec(self, instruction: Instruction) -> dict[str, Any]:
        try:
            spec = json.loads(str(instruction.config["spec"]))
        except (KeyError, ValueError):
            raise MethodConfigError("pfedcdp: the instruction carries no model spec") from None
        return dict(spec)

    def distils(self, cluster: str) -> bool:
        """Whether a client of ``cluster`` trains on eq. 11 (``kd_clusters``); the others train on
        cross-entropy alone, with no teacher."""
        return cluster in self.kd_clusters

    def client_train(self, cluster: str, train: dict[str, Any]) -> dict[str, Any]:
        """The local training settings of a client of ``cluster``: ``train`` with the learning rate
        of ``cluster_lr`` where it names one (the authors' v1.7 model C: Adam at 3e-4)."""
        lr = (self.cluster_lr or {}).get(cluster)
        return dict(train) if lr is None else {**train, "lr": float(lr)}

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Algorithm 1: Fisher masks, eq. 6, extractor epochs, classifier KD; reply with the
        extractor (the engine's filters clip, noise and quantize its update)."""
        spec = self._client_spec(instruction)
        g_ext: State = instruction.payload["extractor"]
        g_buf: State = instruction.payload["extractor_buffers"]
        s_head: State = instruction.payload["server_head"]
        device = client.device
        model = build_seeded(spec, derive_seed(client.seed, "model"), device)
        body, buffer_keys, head_keys = _split_keys(model)
        if set(body) != set(g_ext) or set(buffer_keys) != set(g_buf) or set(head_keys) != set(s_head):
            raise MethodConfigError(f"pfedcdp: client {client.client_id}: the cluster model sent does not match "
                                    f"its spec {spec.get('name')!r}")
        own_ext = client.state.get("extractor")
        own_head = client.state.get("head")
        own_buf = client.state.get("buffers") or g_buf
        if own_ext is not None and set(own_ext) != set(g_ext):   # the cluster's model changed: start over
            own_ext, own_head, own_buf = None, None, g_buf
        metrics: dict[str, float] = {}
        masks: State | None = None
        # 1-3. Fisher information of the own model, masks, eq. 6
        if own_ext is not None:
            model.load_state_dict({**own_ext, **own_buf, **(own_head or s_head)})
            fisher, used = fisher_information(model, client.loader("train", augment=False), body, device,
                                              self.fisher_batches)
            masks = fisher_masks(fisher, keep=self.fisher_keep, threshold=self.fisher_threshold)
            # apply_masks false: the masks are computed and not applied (the authors' v1.7 clients)
            mixed = (mix_extractor(own_ext, g_ext, masks) if self.apply_masks
                     else {k: v.clone() for k, v in g_ext.items()})
            total = sum(m.numel() for m in masks.values())
            metrics.update(fisher_batches=float(used),
                           personal_fraction=float(sum(int(m.sum()) for m in masks.values())) / max(total, 1))
        else:
            mixed = {k: v.clone() for k, v in g_ext.items()}
            metrics.update(fisher_batches=0.0, personal_fraction=0.0)
        head_state = own_head if own_head is not None else s_head
        model.load_state_dict({**mixed, **own_buf, **head_state})
        for p in model.parameters():
            p.requires_grad_(True)
        cluster = str(instruction.config.get("cluster", ""))
        train_cfg = self.client_train(cluster, client.train)
        # 4. the extractor's local epochs (0: Algorithm 1 as printed)
        if self.extractor_epochs:
            opt = make_optimizer(model.parameters(), train_cfg)
            stats = train_epochs(model, client.loader("train"), opt, self.extractor_epochs, device=device,
                                 clip_grad_norm=self.grad_clip)
            metrics.update(loss_extractor=stats["loss"], steps_extractor=stats["steps"])
        # 5. the classifier on eq. 11, the extractor frozen; teacher = global extractor + server head.
        # A cluster outside kd_clusters trains on cross-entropy alone and builds no teacher (the
        # authors' v1.7 models B and C never load one).
        distil = self.distils(cluster)
        teacher: nn.Module | None = None
        if distil:
            teacher = build_seeded(spec, 0, device)
            teacher.load_state_dict({**g_ext, **g_buf, **s_head})
            teacher.eval()
            for p in teacher.parameters():
                p.requires_grad_(False)
        whole = self.kd_scope == "model"     # the authors' v1.7: the whole model trains
        for n, p in model.named_parameters():
            p.requires_grad_(whole or n in set(head_keys))
        lam, temp, probs = self.kd_lambda, self.kd_temperature, self.kd_input == "probabilities"

        def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if whole:
                zs = m(x)
            else:
                _freeze_body(m)
                with torch.no_grad():
                    z = m.embed(x)
                zs = m.head(z)
            if teacher is None:
                return nn.functional.cross_entropy(zs, y)
            with torch.no_grad():
                zt = teacher(x)
            if probs:       # the authors' softmax output layer, soft-maxed again by the loss
                zs, zt = torch.softmax(zs, dim=1), torch.softmax(zt, dim=1)
            return kd_loss(zs, zt, y, lam=lam, temperature=temp)

        opt = make_optimizer(model.parameters() if whole else model.head.parameters(), train_cfg)
        stats = train_epochs(model, client.loader("train"), opt, int(client.train.get("epochs", 1)), device=device,
                             loss_fn=loss, clip_grad_norm=self.grad_clip)
        metrics.update(loss=stats["loss"], steps=stats["steps"])
        state = get_state(model)
        ext = {k: state[k] for k in body}
        metrics.update(personal_observables(ext, own_ext, masks))
        client.state["extractor"] = ext
        client.state["buffers"] = {k: state[k] for k in buffer_keys}
        client.state["head"] = {k: state[k] for k in head_keys}
        sent = ext
        if self.in_step:        # the authors' pipeline: noise and quantize the weights here, per cluster
            sent, released = self._release_weights(ext, cluster,
                                                   int(instruction.config.get("round", 0)), client.seed)
            if self.dp and self.dp_mode == "weights_per_tensor":
                metrics["weight_dp_releases"] = released
        return Reply(payload={"extractor": sent}, metrics=metrics, num_examples=client.num_examples("train"))

    def _release_weights(self, ext: State, cluster: str, round: int, seed: int) -> tuple[State, float]:
        """What a cluster-``cluster`` client sends of its extractor's weights in the authors'
        pipeline (:attr:`in_step`), and the releases :meth:`own_dp` accounts (1: one a round,
        noised or in the clear): in a noised cluster each tensor clipped and noised
        (:func:`clip_noise_tensors`, seeded by the client and the round), then quantized at the
        cluster's bits (:func:`authors_quantize`, sent dequantized). The client keeps ``ext``
        (its own model is not a release)."""
        if cluster not in CLUSTERS:
            raise MethodConfigError(f"pfedcdp: the instruction names no cluster (got {cluster!r})")
        sent = ext
        if self.noised(cluster) and self.dp_mode == "weights_per_tensor":
            gen = torch.Generator().manual_seed(derive_seed(seed, "weight_dp", round))
            sent = clip_noise_tensors(ext, self.clip, float(self.noise_multiplier), gen)
        bits = self.cluster_bits(cluster)
        if bits is not None:
            sent = authors_quantize(sent, bits)
        device = next(iter(ext.values())).device if ext else "cpu"
        return {k: v.to(device) for k, v in sent.items()}, 1.0

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The model a client's evaluation scores (``score``): ``"personal"``, its own extractor
        and classifier; ``"global"``, its cluster's aggregated extractor (and buffers) as sent
        with the client's own classifier (the authors' v1.7 ``evaluate``:
        ``set_feature_extractor_weights(parameters)``, then the full model). A client that has not
        trained yet scores the cluster's model (its server classifier)."""
        spec = self._client_spec(instruction)
        model = build_seeded(spec, 0, client.device)
        own = {**client.state.get("extractor", {}), **client.state.get("buffers", {}), **client.state.get("head", {})}
        p = instruction.payload
        head = client.state.get("head")
        if (str(instruction.config.get("score", self.score)) == "global" and "extractor" in p and head
                and set({**p["extractor"], **p["extractor_buffers"], **head}) == set(model.state_dict())):
            model.load_state_dict({**p["extractor"], **p["extractor_buffers"], **head})
        elif own and set(own) == set(model.state_dict()):
            model.load_state_dict(own)
        elif "extractor" in p:
            model.load_state_dict({**p["extractor"], **p["extractor_buffers"], **p["server_head"]})
        return model.eval()

    # ------------------------------------------------------------------ post hoc
    def _teacher(self, c: str) -> nn.Module:
        model = self._cluster_model(c)
        for p in model.parameters():
            p.requires_grad_(False)
        return model.eval()

    def _teacher_clusters(self) -> list[str]:
        return [c for c in CLUSTERS if any(self._cluster(cid) == c for cid in self.trained)]

    def _weights(self, clusters: list[str], logits: list[torch.Tensor], y: np.ndarray) -> tuple[list[float], Any]:
        """The teacher weights and (for ``shapley``) the Shapley values."""
        if self.teacher_weights == "uniform":
            return [1.0 / len(clusters)] * len(clusters), None
        if self.teacher_weights == "fixed":
            w = [AUTHORS_TEACHER_WEIGHTS[CLUSTERS.index(c)] for c in clusters]
            return [v / sum(w) for v in w], None
        if isinstance(self.teacher_weights, list):
            if len(self.teacher_weights) != len(CLUSTERS):
                raise MethodConfigError(f"pfedcdp: teacher_weights lists {len(self.teacher_weights)} weights; give "
                                        f"one per cluster ({', '.join(CLUSTERS)})")
            w = [self.teacher_weights[CLUSTERS.index(c)] for c in clusters]
            if sum(w) <= 0:
                w = [1.0] * len(clusters)
            return [v / sum(w) for v in w], None
        idx = balanced_subset(y, self.shapley_samples, derive_seed(self.federation.seed, "shapley"))
        game = ensemble_game([z[idx] for z in logits], y[idx], self.shapley_score,
                             num_classes=self.federation.num_classes)
        values = shapley_values(len(clusters), game)
        return teacher_weights(values), {"values": values, "v_all": game(frozenset(range(len(clusters)))),
                                         "v_empty": game(frozenset()), "samples": int(len(idx))}

    def finalize(self) -> None:
        """Shapley-weighted multi-teacher KD with SupCon on the public set (eq. 18)."""
        if not self.refine:
            return
        fed = self.federation
        clusters = self._teacher_clusters()
        if not clusters:
            logger.warning("medfl pfedcdp: no cluster trained; nothing to refine")
            return
        teachers = [self._teacher(c) for c in clusters]
        bs = int(fed.train.get("eval_batch_size", 64))
        plain = fed.public.loader("train", batch_size=bs, shuffle=False, augment=False)
        logits, y = [], None
        for t in teachers:
            zs, ys = [], []
            with torch.no_grad():
                for x, yy in plain:
                    zs.append(t(x.to(fed.device)).cpu())
                    ys.append(yy)
            logits.append(torch.cat(zs))
            y = torch.cat(ys).numpy()
        weights, shap_info = self._weights(clusters, logits, y)
        report: dict[str, Any] = {"teachers": clusters, "teacher_weights_mode": self.teacher_weights,
                                  "teacher_weights": dict(zip(clusters, weights))}
        if shap_info is not None:
            report["shapley"] = {"score": self.shapley_score, "values": dict(zip(clusters, shap_info["values"])),
                                 "v_all": shap_info["v_all"], "v_empty": shap_info["v_empty"],
                                 "samples": shap_info["samples"]}
        scale = 1.0
        student_spec = {"spatial_dims": fed.spatial_dims, "in_channels": fed.in_channels,
                        "num_classes": fed.num_classes, **self.student_model}
        weights_map = None
        if self.feature_shap != "off":
            xs = torch.cat([x for x, _ in plain])
            n = min(self.shap_samples, len(xs))
            gen = torch.Generator().manual_seed(derive_seed(fed.seed, "shap"))
            pick = torch.randperm(len(xs), generator=gen)[: 2 * n]
            background, explain = xs[pick[:n]], xs[pick[n: 2 * n]] if len(pick) > n else xs[pick[:n]]
            psis = [feature_importance(t, background, explain, nsamples=self.shap_nsamples,
                                       seed=derive_seed(fed.seed, "shap", c))
                    for t, c in zip(teachers, clusters)]
            psi = mean_importance(psis)
            report["feature_shap"] = {"mode": self.feature_shap, "mean_psi": float(np.mean(psi)),
                                      "samples": int(n),
                                      "per_teacher_mean_psi": {c: float(np.mean(p)) for c, p in zip(clusters, psis)}}
            if self.feature_shap == "printed":      # eq. 19 as printed: (1/|F|) sum_i psi_i L = mean(psi) L
                scale = float(np.mean(psi))
            else:                                   # per feature: the student sees x * w(psi), mean(w) = 1
                weights_map = importance_weights(psi, floor=0.1)
                student_spec = {"name": "input_weighted", "inner": dict(self.student_model),
                                "shape": list(weights_map.shape), "spatial_dims": fed.spatial_dims,
                                "in_channels": fed.in_channels, "num_classes": fed.num_classes}
                report["feature_shap"].update(weight_min=float(weights_map.min()), weight_max=float(weights_map.max()))
        # the student
        student = build_seeded(student_spec, derive_seed(fed.seed, "student"), fed.device)
        if weights_map is not None:
            student.feature_weights.copy_(torch.as_tensor(weights_map, dtype=torch.float32))
        _split_keys(student)   # the student needs embed() for SupCon
        opt = torch.optim.Adam(student.parameters(), lr=self.refine_lr)
        loader = self._refine_loader()
        alpha, temp, tau, reduction, channels = self.alpha, self.refine_temperature, self.tau, self.supcon_reduction, \
            int(fed.in_channels)
        logs = {"epoch": StepMeans(check=("loss",)), "all": StepMeans()}
        same_views: list[bool] = []

        def loss(m: nn.Module, x: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            if self.supcon_views == 2:             # (B, 2C, ...): the two views stacked along the channels
                first, second = x[:, :channels], x[:, channels:]
                if not same_views:
                    same_views.append(bool(torch.equal(first, second)))
                x, yb = two_views(first, second, yb)
            with torch.no_grad():
                zt = ensemble_logits([t(x) for t in teachers], weights)
            emb = m.embed(x)
            total, scl, kd = sup_mtkd_loss(m.head(emb), emb, zt, yb, alpha=alpha, temperature=temp, tau=tau,
                                           reduction=reduction, parts=True)
            for log in logs.values():
                log.add(n, loss=scale * total, supcon=scl, kd=kd)
            return scale * total

        test = fed.public.loader("test", batch_size=bs, shuffle=False, augment=False)
        rows = [self._student_scores(student, 0, test)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(fed.seed, "refine", "init"))
            for epoch in range(1, self.refine_epochs + 1):
                logs["epoch"] = StepMeans(check=("loss",))
                train_epochs(student, loader, opt, 1, device=fed.device, loss_fn=loss)
                parts = logs["epoch"].means()
                rows.append({"epoch": epoch, "split": "public_train", "steps": float(logs["epoch"].steps),
                             **{k: parts.get(k, float("nan")) for k in ("loss", "supcon", "kd")}})
                rows.append(self._student_scores(student, epoch, test))
        self._student_rows = rows
        report["refine"] = {"epochs": self.refine_epochs, "loss": logs["all"].means().get("loss", 0.0),
                            "steps": float(logs["all"].steps), "public_train": int(fed.public.size("train")),
                            "supcon_reduction": self.supcon_reduction, "supcon_views": self.supcon_views,
                            "student_metrics": "student_metrics.csv"}
        if same_views and same_views[0]:
            note = ("the public training split has no random transforms (public_dataset.augment), so the two views "
                    "of each sample are the same image: each anchor's extra positive is itself")
            report["refine"]["views_identical"] = note
            logger.warning(f"medfl pfedcdp: supcon_views 2: {note}")
        self.student = get_state(student)
        self._student_spec = {k: v for k, v in student_spec.items()
                              if k not in ("spatial_dims", "in_channels", "num_classes")}
        self.report_ = report
        self._teacher_weights = dict(zip(clusters, weights))
        logger.info(f"medfl pfedcdp: refined the student on {fed.public.size('train')} public samples; teacher weights "
                    + ", ".join(f"{c} {w:.3f}" for c, w in zip(clusters, weights)))

    def _refine_loader(self) -> DataLoader:
        """The public training split as the student trains on it: one view of each sample,
        or (``supcon_views=2``) two draws of its random transforms stacked along the channels
        (two datasets whose transforms are seeded from a numpy draw of the run seed)."""
        fed = self.federation
        bs, seed = int(fed.train.get("batch_size", 16)), derive_seed(fed.seed, "refine")
        if self.supcon_views == 1:
            return fed.public.loader("train", batch_size=bs, seed=seed)
        saved = np.random.get_state()
        np.random.seed(derive_seed(fed.seed, "refine", "views"))
        try:
            views = _TwoViews(fed.public.dataset("train", augment=True), fed.public.dataset("train", augment=True))
        finally:
            np.random.set_state(saved)
        gen = torch.Generator().manual_seed(derive_seed(seed, "public_loader", "train"))
        return DataLoader(views, batch_size=bs, shuffle=True, generator=gen)

    def _student_scores(self, student: nn.Module, epoch: int, loader: DataLoader) -> dict[str, Any]:
        """One ``student_metrics`` row: the student's metrics on the public test split."""
        y, p = predict_proba(student, loader, self.federation.device)
        return {"epoch": epoch, "split": "public_test", **classification_metrics(y, p, self.federation.num_classes)}

    def final_models(self) -> dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """The refined student, each cluster's teacher and their weighted ensemble."""
        out: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        clusters = self._teacher_clusters()
        for c in clusters:
            out[f"teacher_{c}"] = (self._spec(c), self._state(c))
        weights = getattr(self, "_teacher_weights", None)
        if clusters and weights:
            members = [self._spec(c) for c in clusters]
            state = {f"members.{i}.{k}": v for i, c in enumerate(clusters)
                     for k, v in self._state(c).items()}
            out["teacher_ensemble"] = ({"name": "weighted_ensemble", "members": members,
                                        "weights": [weights[c] for c in clusters]}, state)
        if self.student is not None:
            out["student"] = (dict(getattr(self, "_student_spec", self.student_model)), self.student)
        return out

    def final_tables(self) -> dict[str, list[dict[str, Any]]]:
        """``student_metrics``: the student after every refinement epoch (the paper's Fig. 3;
        see :meth:`finalize`)."""
        return {"student_metrics": list(self._student_rows)} if self._student_rows else {}

    def _mechanism_report(self) -> dict[str, Any]:
        """The readable summary of what the mechanisms did (:meth:`report`'s ``mechanisms``)."""
        noise = self.history.get("noise_to_update_min", {})
        return {
            "dp": {"private": self.dp and len(self.dp_clusters) == len(CLUSTERS), "mode": self.dp_mode,
                   "clusters_noised": [c for c in CLUSTERS if self.noised(c)],
                   "clusters_in_clear": [c for c in CLUSTERS if not self.noised(c)],
                   "sigma_per_round": self.sigma, "clip": self.clip,
                   "epsilon_target": self.epsilon, "noise_multiplier_given": self.noise_multiplier,
                   "spent": "privacy.csv and summary.json's privacy block (the accountant's epsilon)"},
            "noise_to_update_min_by_round": noise,
            "noise_drowns_update_from_round": {c: min((int(r) for r, v in by.items() if v >= NOISE_WARN_RATIO),
                                                      default=None) for c, by in noise.items()},
            "quantization": {"target": ("update" if self.dp_mode == "update" and (self.dp or self.quantize == "update")
                                        else "weights"),
                             "bits": self.bits,
                             "error_to_update_by_round": self.history.get("quantization_error_to_update", {})},
            "own_weights_above_one_by_round": self.history.get("above_one", {}),
            "personal_drift_by_round": self.history.get("personal_drift", {}),
            "cluster_average": self.cluster_average,
            "warnings": len(self.warned),
        }

    def report(self) -> dict[str, Any]:
        """Clusters, capability scores, teacher weights and Shapley values, and what the
        mechanisms did (``mechanisms``) (summary.json)."""
        counts = {c: sum(1 for v in self.assign.values() if v == c) for c in CLUSTERS}
        return {"clusters": dict(self.assign), "cluster_sizes": counts, "capability_scores": self.scores,
                "scoring": {"score": self.score, "kd_clusters": list(self.kd_clusters), "kd_input": self.kd_input,
                            "cluster_lr": self.cluster_lr},
                "thresholds": {"t_high": self.t_high, "t_medium": self.t_medium}, **self.report_,
                "mechanisms": self._mechanism_report()}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Cluster extractors and server classifiers, the assignment, who trained, the
        mechanisms' history and what was warned."""
        return {"extractors": self.extractors, "buffers": self.buffers, "heads": self.heads,
                "assign": json.dumps(self.assign),
                "scores": json.dumps(self.scores), "trained": json.dumps(sorted(self.trained)),
                "mechanisms": json.dumps({"observed": self.observed, "history": self.history,
                                          "warned": self.warned, "first_noised_round": self.first_noised_round})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.extractors = {c: dict(v) for c, v in state["extractors"].items()}
        self.buffers = {c: dict(v) for c, v in state["buffers"].items()}
        self._initial_fit_due = False
        self.heads = {c: dict(v) for c, v in state["heads"].items()}
        self.assign = dict(json.loads(state["assign"]))
        self.scores = dict(json.loads(state["scores"]))
        self.trained = set(json.loads(state["trained"]))
        mech = json.loads(state.get("mechanisms", "{}"))
        self.observed = dict(mech.get("observed", {}))
        self.history = dict(mech.get("history", {}))
        self.warned = list(mech.get("warned", []))
        self.first_noised_round = mech.get("first_noised_round")


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register PFedCDP."""
    register(PFedCDP)
