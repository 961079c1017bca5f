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
from medfl.method import ENGINE_TRAIN_METRICS, Federation, Method, MethodConfigError, Preset, derive_seed
from medfl.metrics import classification_metrics
from medfl.models.registry import build_seeded
from medfl.plugins import lookup
from medfl.shapley import (balanced_subset, ensemble_game, feature_importance, importance_weights, mean_importance,
                           shapley_values, teacher_weights)
from medfl.logs import plugin_logger

if TYPE_CHECKING:  # pragma: no cover
    from medfl.context import ClientContext

__all__ = ["PFedCDP", "AUTHORS_NOISE_MULTIPLIER", "AUTHORS_TEACHER_WEIGHTS", "DEFAULT_CLUSTER_MODELS",
           "PRESETS", "fisher_information", "fisher_masks", "mix_extractor", "personal_observables",
           "quantization_error", "recalibrate_norms", "register_methods"]

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
_PAPER_OPEN: dict[str, str] = {
    "capability_weights": "eq. 1 gives 1/4 each 'if all resources matter the same' (and 0.3/0.3/0.1/0.3 as an "
                          "example); medfl 1/4",
    "t_high": "eq. 2 names T_H without a value; medfl 0.6",
    "t_medium": "eq. 2 names T_M without a value; medfl 0.4",
    "max_latency_ms": "C_Net's maximum acceptable latency has no value; medfl 200 ms",
    "fisher_keep": "eqs. 4-5's T_Fisher has no value; medfl keeps the top 20 % of the extractor's entries (a raw "
                   "threshold does not transfer between models; the authors' code uses a raw 0.01)",
    "fisher_threshold": "given as the quantile fisher_keep instead",
    "extractor_epochs": "Algorithm 1 freezes the extractor and trains only the classifier (0: that literal "
                        "reading, under which no feature learning happens anywhere); medfl 1 epoch of CE first",
    "kd_lambda": "eq. 11's lambda has no value; the authors' code's 0.3",
    "kd_temperature": "T_KD has no value; the authors' code's 3.0",
    "server_classifier": "nothing says how W_C,server is trained; medfl fits it on the public set every round",
    "server_epochs": "see server_classifier; 1 epoch a round",
    "delta": "not stated; the authors' code's 1e-5",
    "accountant": "'the privacy accountant' (III.C.3.i) is not named; Opacus's RDP accountant",
    "refine_epochs": "Algorithm 2's E has no value; 5",
    "refine_lr": "not stated; Adam at 1e-3",
    "alpha": "eq. 18's alpha has no value; 0.5 (with eq. 17 summed over the batch, KD then weighs about 1/A of "
             "SupCon for A anchors: see PFedCDP's docstring)",
    "refine_temperature": "eq. 18's T has no value; 2",
    "tau": "eq. 17's tau has no value; Khosla et al.'s reference code's 0.07",
    "supcon_views": "eq. 17 counts 2N views and 2N_y - 1 positives (Khosla et al.'s two augmented views), "
                    "Algorithm 2 feeds the batch as it is and names no augmentation; medfl 2 views drawn from the "
                    "public set's own random transforms (public_dataset.augment)",
    "teacher_weights": "III.A says Shapley values weight each model, III.D's equations average the teachers' "
                       "logits uniformly (z_T = 1/K sum_k z_T^k) and put the Shapley values on input features "
                       "(eqs. 16, 19); medfl follows the equations: uniform, with feature_shap 'printed' "
                       "('shapley' is medfl's per-teacher reading of III.A)",
    "feature_shap": "eqs. 16 and 19 as printed: (1/|F|) sum_i psi_i L = mean(psi) L; the explainer is not named "
                    "(medfl: shap's GradientExplainer)",
    "shap_samples": "'a representative subset of class-balanced test samples' has no size; 16",
    "grad_clip": "the paper clips no gradient; without a clip the paper's DP noise makes the local losses "
                 "overflow; medfl 5",
    "train.batch_size": "not stated; the authors' code's 64",
    "train.optimizer": "not stated; the authors' code's Adam",
    "train.lr": "not stated; Adam's 1e-3, as the authors' code (Keras's default)",
}
_PAPER_EXPERIMENT: dict[str, Any] = {
    "rounds": 20, "num_clients": 10, "fraction": 1.0, "partition": {"name": "dirichlet", "alpha": 0.5},
    "client_counts_fig2": [10, 50, 100], "private_data": "CBIS-DDSM, 2,326 train / 772 test images",
    "public_data": "MIAS benign / malignant, 280 train / 50 test",
}

#: ``{"name": "pfedcdp", "preset": "paper"}``: every value paper 000 states (``open``: what it
#: leaves open and medfl's choice); ``"authors"``: the authors' published code where it differs.
PRESETS: dict[str, Preset] = {
    "paper": Preset(
        source=_PAPER + " (eqs. 1-19, Algorithms 1-2, IV.A.2)",
        values=_PAPER_VALUES,
        train={"epochs": 20, "batch_size": 64, "optimizer": "adam", "lr": 1e-3},   # IV.A.2: 20 local epochs
        open=_PAPER_OPEN, experiment=_PAPER_EXPERIMENT,
        description="the paper's settings: epsilon 5 over the run, C2 2.5, 8 bits on the update, models A/B/C, "
                    "20 local epochs, eq. 17 summed over 2N views"),
    "authors": Preset(
        source="the authors' code (github.com/shadhin39/PFedCDP: differential_privacy.py, v1.7 clients and "
               "server) where it differs from the paper; " + _PAPER + " elsewhere",
        values={**_PAPER_VALUES, "epsilon": None, "noise_multiplier": AUTHORS_NOISE_MULTIPLIER,
                "teacher_weights": "fixed"},
        train={"epochs": 5, "batch_size": 64, "optimizer": "adam", "lr": 1e-3},
        open={**{k: v for k, v in _PAPER_OPEN.items() if not k.startswith(("kd_", "train.", "teacher_weights"))},
              "clip": "the authors' code clips each weight tensor of the weights (not the update) to 2.5; medfl "
                      "clips the whole update's norm to C2 = 2.5 (eq. 12)",
              "bits": "the authors' clients quantize the weights, at 8 or (v1.7's client B) 12 bits; medfl the "
                      "paper's 8 bits on the update",
              "fisher_keep": "the authors' code thresholds raw Fisher values at 0.01 and then never applies the "
                             "masks; medfl applies eq. 6 to the top 20 %",
              "noise_multiplier": "the authors' differential_privacy.py calibrates sigma = sqrt(2 ln(1.25 / delta)) / "
                                  "epsilon for one release and adds it every round; it defaults to epsilon 8 (sigma "
                                  "0.606), which v1.7's model B client uses, and models A and C send without noise; "
                                  "medfl takes the paper's epsilon 5 in that formula (sigma 0.969) for every cluster",
              "train.lr": "the authors' code's Keras Adam default, 1e-3"},
        experiment={**_PAPER_EXPERIMENT, "authors_code_rounds": 10},
        description="the authors' code: sigma 0.969 each round without composition (Opacus: epsilon 31.4 over 20 "
                    "rounds), fixed teacher weights 0.4/0.35/0.25, 5 local epochs, Adam, batch 64"),
}


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
       global one (the authors' code computes the masks and then never applies them; ours is
       tested to change what the client keeps). Round 1 (no own extractor yet) starts from
       the global one; so does a client's classifier, from the server's.
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
      expectation to within 1/sqrt(d)), and ``noise_to_update_min`` = that norm over C2: the
      averaged clipped update has norm at most C2, so the noise is at least that many times
      the signal. Everything here is the noise plan's and the coordinator's own (sigma as the
      engine derives it, the weights it applies): no client reports its update's norm,
      which no noise would cover. ``received_update_norm`` is the norm of the averaged
      update as received (noise included).
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
    leaves open; ``"authors"``, the authors' published code where it differs: sigma 0.969
    (``AUTHORS_NOISE_MULTIPLIER``: the code's one-release Gaussian calibration at the paper's
    epsilon 5, delta 1e-5; the code itself uses epsilon 8, sigma 0.606, and only in model B's
    client) every round without composition, which the ledger records as the epsilon it is
    (31.4 over 20 rounds), fixed teacher weights [0.4, 0.35, 0.25], 5 local epochs, Adam, batch
    64. Neither copies the authors' code's bugs: it computes the Fisher masks and never
    applies them, and clips each weight tensor of the weights (not the update) to 2.5.

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
                                            "personal_norm_prev", "personal_drift"}
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
                 cluster_average: str = "weighted", supcon_reduction: str = "sum", supcon_views: int = 1) -> None:
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
        if self.quantize == "weights" and self.dp:
            raise MethodConfigError("pfedcdp: quantize 'weights' needs the update without DP (dp_gaussian makes the "
                                    "chain send the noised update, which is what is quantized); set epsilon and "
                                    "noise_multiplier to null, or quantize 'update'")
        self.cluster_average = _check_choice(cluster_average, "cluster_average", CLUSTER_AVERAGE)
        self.supcon_reduction = _check_choice(supcon_reduction, "supcon_reduction", SUPCON_REDUCTIONS)
        if supcon_views not in SUPCON_VIEWS or isinstance(supcon_views, bool):
            raise MethodConfigError(f"pfedcdp: supcon_views must be 1 or 2 (two augmented views of each public "
                                    f"sample, eq. 17's 2N), got {supcon_views!r}")
        self.supcon_views = int(supcon_views)
        self.clip = _check_pos(clip, "clip")
        self.delta = float(delta)
        self.accountant = str(accountant)
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16):
            raise MethodConfigError(f"pfedcdp: bits must be an integer from 1 to 16 or null, got {bits!r}")
        self.bits = bits
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

    def default_filters(self) -> list[dict[str, Any]]:
        """``dp_gaussian`` on the extractor's update (clip C2, a target epsilon or a noise
        multiplier; ``keys: all``: the reply holds the extractor's parameters only, and the
        cluster models differ from the run's ``fl.model``) and ``quantize`` (bits; on the
        update unless ``quantize="weights"``)."""
        out: list[dict[str, Any]] = []
        if self.dp:
            out.append(self._dp_entry())
        if self.bits is not None:
            out.append({"name": "quantize", "bits": self.bits, "update": self.quantize == "update"})
        return out

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

    def _planned_sigma(self, federation: Federation) -> float:
        """The noise multiplier of the run's extractor updates, planned as the engine plans the
        ``dp_gaussian`` of :meth:`default_filters` (the same filter, the same federation): the
        given ``noise_multiplier``, or the accountant's for ``epsilon`` over the planned
        rounds; 0 without DP."""
        if not self.dp:
            return 0.0
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
        for cid in self.federation.sample(round):
            c = self._cluster(cid)
            out[cid] = Instruction(payload=self._payload(c), config={"spec": json.dumps(self._spec(c)), "cluster": c})
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
        self.observed = {"round": round, "clusters": {}, "clients": {}}
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
        noise = self.sigma * self.clip * math.sqrt(d * w2)
        obs: dict[str, Any] = {
            "dp_noise": {"clients": float(len(states)), "coordinates": float(d), "sigma": self.sigma,
                         "clip": self.clip, "weights_sq_sum": w2, "noise_norm": noise,
                         "noise_per_coordinate": self.sigma * self.clip * math.sqrt(w2),
                         "noise_to_update_min": noise / self.clip,
                         "received_update_norm": _norm(new[k].double() - old[k].double() for k in received[0])},
            "cluster_model": {"norm": _norm(new.values()),
                              "above_one": sum(int((v.abs() > 1.0).sum()) for v in new.values()) / max(d, 1)}}
        if self.bits is not None:
            target = "update" if self.dp or self.quantize == "update" else "weights"
            errors = [quantization_error(u if target == "update" else s, self.bits) for u, s in zip(received, states)]
            norms = [_norm(u.values()) for u in received]
            err, upd = sum(errors) / len(errors), sum(norms) / len(norms)
            obs["quantization"] = {"bits": float(self.bits), "target": target, "error_norm": err,
                                   "update_norm": upd, "error_to_update": err / upd if upd > 0 else float("nan")}
        self.observed["clusters"][c] = obs
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
                need = 1.0 / math.sqrt(dp["coordinates"] * dp["weights_sq_sum"])
                out.append(
                    f"cluster {c}: the DP noise in the averaged extractor update has norm {dp['noise_norm']:.4g}, at "
                    f"least {dp['noise_to_update_min']:.3g}x any clipped update (sigma {self.sigma:.3g}, C2 "
                    f"{self.clip:g}, {int(dp['coordinates'])} coordinates, {int(dp['clients'])} client(s)): the "
                    f"cluster model is mostly noise, and eq. 6 copies it into the unkept share of every member's own "
                    f"extractor. A ratio of 1 needs sigma <= {need:.3g}: a larger epsilon, fewer rounds, more clients "
                    f"per cluster or a smaller extractor"
                    + (f" (the authors' code's sigma 0.969 a round, preset 'authors', epsilon 31.4 over 20 rounds, "
                       f"would still give {AUTHORS_NOISE_MULTIPLIER / need:.3g}x)"
                       if abs(self.sigma - AUTHORS_NOISE_MULTIPLIER) > 1e-9 else "")
                    + "; mechanisms.csv has the ratio per round")
            q = obs.get("quantization")
            if (q and q["target"] == "weights" and q["error_to_update"] > 1.0
                    and f"quantization:{c}" not in self.warned):
                self.warned.append(f"quantization:{c}")
                out.append(f"cluster {c}: {int(q['bits'])}-bit quantization of the weights errs "
                           f"{q['error_to_update']:.3g}x the update itself (error norm {q['error_norm']:.3g}); "
                           "quantize 'update' (eq. 14) quantizes the update instead")
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
        """The cluster's spec; the cluster's model too for a client that never trained."""
        out = {}
        for cid in self.federation.eval_client_ids:
            c = self._cluster(cid)
            payload = {} if cid in self.trained else self._payload(c)
            out[cid] = Instruction(payload=payload, config={"spec": json.dumps(self._spec(c)), "cluster": c})
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
            mixed = mix_extractor(own_ext, g_ext, masks)
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
        # 4. the extractor's local epochs (0: Algorithm 1 as printed)
        if self.extractor_epochs:
            opt = make_optimizer(model.parameters(), client.train)
            stats = train_epochs(model, client.loader("train"), opt, self.extractor_epochs, device=device,
                                 clip_grad_norm=self.grad_clip)
            metrics.update(loss_extractor=stats["loss"], steps_extractor=stats["steps"])
        # 5. the classifier on eq. 11, the extractor frozen; teacher = global extractor + server head
        teacher = build_seeded(spec, 0, device)
        teacher.load_state_dict({**g_ext, **g_buf, **s_head})
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        for n, p in model.named_parameters():
            p.requires_grad_(n in set(head_keys))
        lam, temp = self.kd_lambda, self.kd_temperature

        def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _freeze_body(m)
            with torch.no_grad():
                z = m.embed(x)
                zt = teacher(x)
            return kd_loss(m.head(z), zt, y, lam=lam, temperature=temp)

        opt = make_optimizer(model.head.parameters(), client.train)
        stats = train_epochs(model, client.loader("train"), opt, int(client.train.get("epochs", 1)), device=device,
                             loss_fn=loss, clip_grad_norm=self.grad_clip)
        metrics.update(loss=stats["loss"], steps=stats["steps"])
        state = get_state(model)
        ext = {k: state[k] for k in body}
        metrics.update(personal_observables(ext, own_ext, masks))
        client.state["extractor"] = ext
        client.state["buffers"] = {k: state[k] for k in buffer_keys}
        client.state["head"] = {k: state[k] for k in head_keys}
        return Reply(payload={"extractor": ext}, metrics=metrics, num_examples=client.num_examples("train"))

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The personalised model: the client's own extractor and classifier (the cluster's
        model for a client that has not trained yet)."""
        spec = self._client_spec(instruction)
        model = build_seeded(spec, 0, client.device)
        own = {**client.state.get("extractor", {}), **client.state.get("buffers", {}), **client.state.get("head", {})}
        if own and set(own) == set(model.state_dict()):
            model.load_state_dict(own)
        elif "extractor" in instruction.payload:
            p = instruction.payload
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
            "dp": {"private": self.dp, "sigma_per_round": self.sigma, "clip": self.clip,
                   "epsilon_target": self.epsilon, "noise_multiplier_given": self.noise_multiplier,
                   "spent": "privacy.csv and summary.json's privacy block (the accountant's epsilon)"},
            "noise_to_update_min_by_round": noise,
            "noise_drowns_update_from_round": {c: min((int(r) for r, v in by.items() if v >= NOISE_WARN_RATIO),
                                                      default=None) for c, by in noise.items()},
            "quantization": {"target": "update" if self.dp or self.quantize == "update" else "weights",
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
                                          "warned": self.warned})}

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


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register PFedCDP."""
    register(PFedCDP)
