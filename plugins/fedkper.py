"""FedKPer (paper 001): knowledge personalisation and reliability/diversity aggregation.

The method is :class:`FedKPer`; its docstring gives the equations, the choices where the
paper is not explicit, and the ablation switches.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from medfl import hookimpl
from medfl.hub import HubAndSpoke
from medfl.training import get_state, make_optimizer, predict_proba, train_epochs
from medfl.messages import Instruction, Reply
from medfl.method import ClientContext, Preset

__all__ = ["FedKPer", "PRESETS", "label_entropy", "aggregation_score", "kper_loss", "register_methods"]

AGGREGATIONS = ("fedkper", "fedavg")

_PAPER_VALUES: dict[str, Any] = {"distill": True, "aggregation": "fedkper", "lambda_cap": 10.0, "clip": 5.0,
                                 "eps": 1e-12, "temperature": 1.0}
_PAPER_TRAIN: dict[str, Any] = {"optimizer": "sgd", "lr": 0.01, "epochs": 5, "momentum": 0.9, "weight_decay": 1e-5,
                                "batch_size": 50}
_KPER = "olivesgatech/FedKPer (commit f7717c5)"
_CFG = f"{_KPER}, config/fedkper.json"
_LOSS = f"{_KPER}, algorithms/fedkper/loss.py"
_TRAINER = f"{_KPER}, algorithms/fedkper/ClientTrainer.py"
_UNSTATED = "sec. 4.1 does not state it (it takes its setup from [8, 3]); the authors' code:"
#: where each value of the presets comes from (FedKPer's paper, 001, and the authors' code)
_PAPER_SOURCES: dict[str, str] = {
    "distill": "paper: sec. 3.2, eq. 3 (l = CE(q_k, y) + lambda KD(q_g, q_k))",
    "aggregation": "paper: sec. 3.2, eqs. 4-6 (p_k proportional to A_k (eps + d_k))",
    "lambda_cap": "paper: sec. 3.2 ('we additionally cap lambda at 10')",
    "clip": "paper: sec. 3.2 ('gradient-norm clipping (max norm of 5)')",
    "eps": "paper: sec. 3.2, eq. 6 ('we utilize eps = 10^-12 throughout')",
    "temperature": "reading: sec. 3.2, 'KD is KL divergence-based distillation on the client data' (no temperature), "
                   "read as plain KL of the two softmax outputs (T = 1, as the authors' code, "
                   f"{_LOSS}, line 15: tau = 1); other reading: Hinton's tempered KD with some T > 1",
    "train.optimizer": "paper: sec. 4.1 ('a SGD optimizer with eta = 0.01')",
    "train.lr": "paper: sec. 4.1 ('a SGD optimizer with eta = 0.01')",
    "train.epochs": "paper: sec. 4.1 ('Each local model is trained for 5 epochs')",
    "train.momentum": f"authors_code: {_UNSTATED} {_CFG}, line 30 (momentum 0.9, as FedNTD [3]'s config/fedntd.json)",
    "train.weight_decay": f"authors_code: {_UNSTATED} {_CFG}, line 30 (weight_decay 1e-5, as FedNTD [3]'s)",
    "train.batch_size": f"authors_code: {_UNSTATED} {_CFG}, line 7 (batch_size 50, as FedNTD [3]'s; the README's "
                        "BloodMNIST command, README.md line 10 at commit 2b78279, passes --batch_size=12)",
}
_AUTHORS_SOURCES: dict[str, str] = {
    "distill": f"authors_code: {_LOSS}, line 29 (loss = ce_loss + beta * kl_loss)",
    "aggregation": f"authors_code: {_KPER}, algorithms/fedkper/Server.py, lines 72-75 (aggregation weighted by the "
                   "clients' scores of ClientTrainer.py, lines 82-84)",
    "lambda_cap": f"authors_code: {_LOSS}, lines 16 and 26 (lam_max = 10; beta clamped at it)",
    "clip": f"authors_code: {_TRAINER}, lines 62-63 (loss.backward(), optimizer.step(): no gradient clipping)",
    "eps": f"open: the authors' code uses 1e-12 in the entropy and 1e-6 in the score A_k (eps + d_k) ({_TRAINER}, "
           "lines 82-84); medfl has one eps (1e-12): the score differs by at most 1e-6 A_k",
    "temperature": f"authors_code: {_LOSS}, line 15 (tau = 1)",
    "train.optimizer": f"authors_code: {_KPER}, main.py, line 68 (optim.SGD)",
    "train.lr": f"authors_code: {_CFG}, line 30 (lr 0.01)",
    "train.epochs": f"authors_code: {_CFG}, line 22 (local_epochs 5)",
    "train.momentum": f"authors_code: {_CFG}, line 30 (momentum 0.9)",
    "train.weight_decay": f"authors_code: {_CFG}, line 30 (weight_decay 1e-5)",
    "train.batch_size": f"authors_code: {_CFG}, line 7 (batch_size 50; the README's BloodMNIST command, "
                        "README.md line 10 at commit 2b78279, whose rounds and clients this preset's experiment "
                        "records, passes --batch_size=12)",
}
#: FedKPer's presets: the paper (sec. 3.2 and 4.1) and the authors' published code where it
#: differs (no gradient clipping). Neither can reproduce the per-round learning-rate decay
#: (x 0.99) of FedNTD's and the authors' code: medfl has no per-round learning-rate schedule.
PRESETS: dict[str, Preset] = {
    "paper": Preset(
        source="Fowler & AlRegib, FedKPer (paper 001), sec. 3.2 (eqs. 3-6: lambda = min(1/CE, 10), gradient-norm "
               "clip 5, eps 1e-12) and sec. 4.1 (SGD lr 0.01, 5 local epochs)",
        values=dict(_PAPER_VALUES), train=dict(_PAPER_TRAIN), sources=dict(_PAPER_SOURCES),
        experiment={"rounds": 100, "fraction": 0.1, "partition": {"name": "dirichlet", "alpha": 0.1},
                    "num_clients": "20 (BloodMNIST), 30 (OrganCMNIST), 50 (OrganSMNIST)",
                    "datasets": "BloodMNIST, OrganSMNIST, OrganCMNIST (MedMNIST)", "local_test_fraction": 0.2,
                    "model": "the four-layer CNN of FedAvg [8]", "seeds": 3,
                    "lr_schedule": "not stated (FedNTD's and the authors' code decay lr x 0.99 a round; medfl: none)"},
        description="the paper's settings (MedMNIST, Dirichlet 0.1, 10 % sampling)"),
    "authors": Preset(
        source="the authors' code, github.com/olivesgatech/FedKPer at commit f7717c5 (config/fedkper.json, "
               "main.py, algorithms/fedkper/{ClientTrainer,Server,loss}.py)",
        values={**_PAPER_VALUES, "clip": None}, train=dict(_PAPER_TRAIN), sources=dict(_AUTHORS_SOURCES),
        experiment={"rounds": 200, "fraction": 0.1, "partition": {"name": "dirichlet", "alpha": 0.1},
                    "num_clients": 20, "model": "fedavg_cifar (the four-layer CNN)",
                    "lr_schedule": "StepLR gamma 0.99 per round (medfl: none)",
                    "note": "config/fedkper.json is a CIFAR-10 template (100 clients, iid, sample ratio 0.5, "
                            "batch 50); rounds, clients, fraction and split are its README's BloodMNIST command "
                            "(which passes batch 12); the code clips no gradient (ClientTrainer.train)"},
        description="the authors' published code: the paper's settings without gradient clipping"),
}


def label_entropy(hist: Any, eps: float = 1e-12) -> float:
    """Normalised label-histogram entropy ``d_k`` (eqs. 4-5), clamped at 0.

    Args:
        hist: class counts ``m_{k,c}`` (length C, the number of classes).
        eps: the paper's epsilon.

    Returns:
        ``-sum_c pi_c log(pi_c + eps) / (log C + eps)`` with ``pi_c = m_c / (M + eps)``:
        1 for a uniform histogram, 0 for a single class (and for an empty histogram).
    """
    m = np.asarray(hist, dtype=np.float64).reshape(-1)
    if m.size == 0:
        return 0.0
    pi = m / (m.sum() + eps)
    h = -float((pi * np.log(pi + eps)).sum())
    return max(0.0, h / (float(np.log(m.size)) + eps))


def aggregation_score(accuracy: float, hist: Any, eps: float = 1e-12) -> float:
    """Unnormalised aggregation score ``p_bar_k = A_k (eps + d_k)`` (eq. 6)."""
    return float(accuracy) * (eps + label_entropy(hist, eps))


def kper_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, *,
              lambda_cap: float = 10.0, temperature: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """FedKPer's local loss on one batch (eq. 3) and the lambda it used.

    Args:
        student_logits: local model logits ``(B, C)`` (with gradient).
        teacher_logits: received global model logits ``(B, C)`` (no gradient needed).
        y: labels ``(B,)``.
        lambda_cap: upper bound of lambda.
        temperature: distillation temperature T.

    Returns:
        ``(CE(q_k, y) + lambda * T^2 KL(q_g^T || q_k^T), lambda)`` where
        ``lambda = min(1 / CE(q_g, y), lambda_cap)`` from the batch-mean CE of the teacher.
    """
    teacher_logits = teacher_logits.detach()
    ce = F.cross_entropy(student_logits, y)
    with torch.no_grad():
        lam = torch.clamp(F.cross_entropy(teacher_logits, y).reciprocal(), max=float(lambda_cap))
    t = float(temperature)
    kd = F.kl_div(F.log_softmax(student_logits / t, dim=1), F.log_softmax(teacher_logits / t, dim=1),
                  reduction="batchmean", log_target=True) * (t * t)
    return ce + lam * kd, lam


class FedKPer(HubAndSpoke):
    """FedKPer (paper 001): adaptive global-teacher distillation, eq. 6 aggregation.

    A hub-and-spoke method (:class:`medfl.hub.HubAndSpoke`). Each sampled client starts
    from the received global model ``w^{t-1}`` and trains with (eq. 3)::

        l = CE(q_k, y) + lambda * KD(q_g, q_k),     lambda = min(1 / CE(q_g, y), lambda_cap)

    with ``q_k`` the local model's and ``q_g`` the received (frozen) global model's predictions
    on the client's batch, and gradient-norm clipping at ``clip``. After training, the client
    measures ``A_k``, the trained local model's accuracy on its own (un-augmented) training
    set, and the normalised entropy of its label histogram (eqs. 4-5)::

        pi_{k,c} = m_{k,c} / (M_k + eps)
        d_k = -sum_c pi_{k,c} log(pi_{k,c} + eps) / (log C + eps)

    and sends the model with one scalar, the aggregation score ``p_bar_k = A_k (eps + d_k)``
    (eq. 6). The coordinator averages the sampled clients' models with weights
    ``p_k = p_bar_k / sum_j p_bar_j``. Clients are sampled by :meth:`Federation.sample` (the
    config's ``fraction``; the paper samples 10 %), seeded by (seed, round) only, so FedKPer
    sees exactly the clients FedAvg sees for the same seed. Every client is evaluated with the
    global model, as for FedAvg.

    Choices where the paper is not explicit:

    * ``KD`` is ``T^2 * KL(softmax(z_g / T) || softmax(z_k / T))`` averaged over the batch
      (teacher distribution first, as in Hinton et al.), with ``T = temperature = 1`` by default,
      i.e. plain ``KL(q_g || q_k)``.
    * ``lambda`` is computed from the batch-mean cross-entropy of the global model on the same
      batch, without gradient; ``CE(q_g, y) = 0`` gives the cap.
    * The teacher is the received global model in evaluation mode (BatchNorm running statistics,
      no dropout), frozen for the whole local update.
    * ``A_k`` is measured *after* local training (the paper: "we evaluate each local model on its
      corresponding local train set"), in evaluation mode (BatchNorm running statistics, no
      dropout) over the whole training split **without augmentation**
      (``client.loader("train", augment=False)``): the split's images as evaluation sees
      them. ``A_k`` is a reliability proxy for the model the client sends: measured through
      the random training transforms it would change with the transforms drawn for that
      pass (a noisy aggregation weight) and score the model on images it is never evaluated
      on.
    * ``d_k`` is clamped at 0: with ``eps`` inside the log, a single-class histogram gives
      ``d_k`` of about ``-1e-12`` instead of 0, which would make ``p_bar_k`` negative.
    * Gradient clipping (``clip``) applies in every variant (the ablations included); ``None``
      disables it. It replaces the config's ``train.clip_grad_norm`` for this method.
    * If every sampled client scores 0 (all ``A_k = 0``), the round falls back to FedAvg weights.

    Presets (``{"name": "fedkper", "preset": ...}``): ``paper`` (every value of sec. 3.2 and
    4.1, and FedNTD [3]'s momentum 0.9, weight decay 1e-5 and batch 50 where the paper is
    silent) and ``authors`` (github.com/olivesgatech/FedKPer: the same without gradient
    clipping). The per-round learning-rate decay (x 0.99) of FedNTD's and the authors' code
    is not reproduced.

    Ablations (paper Fig. 4): ``distill=True, aggregation="fedavg"`` is "KD only" (eq. 3 with
    FedAvg's sample-count weights; the reply then carries the model only);
    ``distill=False, aggregation="fedkper"`` is "Agg only" (cross-entropy with eq. 6 weights).

    Privacy: the reply's payload is the model state and the scalar score; no label histogram,
    accuracy or per-sample value leaves the client (``metrics`` holds only the training loss and
    step count, as for every method). Reply filters (``dp_gaussian``, ``quantize``) apply to
    the model state; the score is not covered by ``dp_gaussian``'s noise (the run lists it
    under ``not_covered``). DP-SGD (``train.dp``) is refused: eq. 3's ``lambda`` is a function
    of the whole batch and the update clips the global gradient norm, so a sample's influence
    is not bounded by per-sample clipping.

    Args:
        distill: use the adaptive distillation term (eq. 3); False trains with cross-entropy.
        aggregation: ``"fedkper"`` (eq. 6 weights) or ``"fedavg"`` (sample-count weights);
            not called ``aggregate``, which is :meth:`HubAndSpoke.aggregate`.
        lambda_cap: upper bound of lambda (paper: 10).
        clip: max gradient norm of local training (paper: 5); None for no clipping.
        eps: the epsilon of eqs. 4-6 (paper: 1e-12).
        temperature: distillation temperature T (default 1: plain KL).
    """

    name = "fedkper"
    # eq. 3's lambda depends on the whole batch and the local update clips the global gradient
    # norm: neither is a mean of per-sample terms that DP-SGD can clip per sample
    supports_dp_sgd = False
    description = "FedKPer: adaptive global-teacher distillation and accuracy x label-entropy aggregation"
    presets = PRESETS

    def __init__(self, distill: bool = True, aggregation: str = "fedkper", lambda_cap: float = 10.0,
                 clip: float | None = 5.0, eps: float = 1e-12, temperature: float = 1.0) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"fedkper: aggregation must be one of {', '.join(AGGREGATIONS)}, "
                             f"got {aggregation!r}")
        if lambda_cap <= 0 or temperature <= 0 or eps < 0:
            raise ValueError(f"fedkper: need lambda_cap > 0, temperature > 0, eps >= 0; got "
                             f"lambda_cap={lambda_cap}, temperature={temperature}, eps={eps}")
        if clip is not None and clip <= 0:
            raise ValueError(f"fedkper: clip must be > 0 or None, got {clip}")
        self.distill, self.aggregation, self.lambda_cap = bool(distill), str(aggregation), float(lambda_cap)
        self.clip, self.eps, self.temperature = None if clip is None else float(clip), float(eps), float(temperature)

    # ------------------------------------------------------------------ client side
    def local_loss(self, client: "ClientContext", model: nn.Module, instruction: Instruction
                   ) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """Eq. 3 with the received global model as a frozen teacher; None (CE) without
        ``distill``."""
        if not self.distill:
            return None
        teacher = self.client_model(client, instruction).to(client.device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        cap, temp = self.lambda_cap, self.temperature

        def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                zg = teacher(x)
            value, _ = kper_loss(m(x), zg, y, lambda_cap=cap, temperature=temp)
            return value

        return loss

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Train from the global model with eq. 3 and clipping; reply with the model and,
        for eq. 6 aggregation, the score ``A_k (eps + d_k)`` (``A_k`` on the training split
        without augmentation, in evaluation mode)."""
        model = self.client_model(client, instruction)
        loss_fn = self.local_loss(client, model, instruction)
        opt = make_optimizer(model.parameters(), client.train)
        stats = train_epochs(model, client.loader("train"), opt, int(client.train.get("epochs", 1)),
                             device=client.device, loss_fn=loss_fn, clip_grad_norm=self.clip)
        full = get_state(model)
        local = self.local_keys(model)
        payload: dict[str, Any] = {"model": {k: v for k, v in full.items() if k not in local}}
        if self.aggregation == "fedkper":
            # A_k on the un-augmented training split, in eval mode (predict_proba sets it)
            y, p = predict_proba(model, client.loader("train", shuffle=False, augment=False), client.device)
            acc = float((p.argmax(1) == y).mean()) if len(y) else 0.0
            hist = client.label_histogram(int(client.model_spec["num_classes"]))
            payload["score"] = aggregation_score(acc, hist, self.eps)
        return Reply(payload=payload, metrics=stats, num_examples=client.num_examples("train"))

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """The shared ``model``, and with ``aggregation`` ``"fedkper"`` the reliability ``score``."""
        return super().reply_keys(instruction) | ({"score"} if self.aggregation == "fedkper" else set())

    # ------------------------------------------------------------------ coordinator side
    def client_weights(self, replies: dict[str, Reply]) -> list[float]:
        """Eq. 6 scores (normalised by the average); FedAvg weights for ``aggregation="fedavg"``
        or when every score is 0."""
        scores = [float(r.payload["score"]) for r in replies.values()] if self.aggregation == "fedkper" else []
        return super().client_weights(replies) if sum(scores) <= 0 else scores


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register FedKPer."""
    register(FedKPer)
