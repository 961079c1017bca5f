"""Distillation and contrastive losses of PFedCDP (paper 000, eqs. 7-11 and 17-18).

Client side, the local classifier is trained against the server model as teacher (eq. 11)::

    L_local = (1 - lambda) CE(z_s, y) + lambda T^2 KL(softmax(z_t / T) || softmax(z_s / T))

Server side, the student is refined on public data from an ensemble of teachers with
supervised contrastive learning in place of cross-entropy (eq. 18)::

    L_SupMTKD = (1 - alpha) L_SCL(e_s, y) + alpha T^2 KL(softmax(z_bar / T) || softmax(z_s / T))

with ``z_bar`` the (weighted) mean of the teachers' logits (:func:`ensemble_logits`) and
``L_SCL`` the supervised contrastive loss of Khosla et al. 2020 (:func:`supcon_loss`).

Choices where the paper is loose, stated once here:

* ``KL`` is averaged over the batch (``reduction="batchmean"``), the teacher distribution
  first (as in Hinton et al.), and the teacher logits are detached: no gradient reaches a
  teacher through these losses.
* eq. 17 is written for ``2N`` augmented views (two of each sample, Khosla et al.): pass the
  embeddings of both views stacked, ``(2N, D)``, with the labels repeated (:func:`two_views`
  does that), and the normaliser ``|P(i)|`` is eq. 17's ``2 N_y - 1``. With one view per
  sample it becomes ``N_y - 1``, the number of other samples of the anchor's class.
* The paper sums ``L_i^SCL`` over the batch ("summed over all samples in the batch"):
  ``reduction="sum"``. ``reduction="mean"`` (the default of :func:`supcon_loss`, as Khosla
  et al.'s reference code does) takes the mean over the anchors instead, so the loss scale
  does not depend on the batch size. The two differ by the number ``A`` of anchors (the
  samples with at least one positive; every sample of a batch of two classes but the lone
  member of a class): ``sum = A x mean``. In eq. 18 that moves the balance: alpha with
  ``sum`` weighs KD against SupCon as ``alpha'`` with ``mean`` where
  ``alpha' / (1 - alpha') = alpha / ((1 - alpha) A)``, i.e. a given ``alpha'`` of the mean
  form is ``alpha = A alpha' / (1 - alpha' + A alpha')`` in the sum form (``alpha' = 0.5`` at
  ``A = 16``: ``alpha = 16/17 = 0.94``). Anchors with no positive are left out either way;
  the reference code's extra ``tau / base_tau`` factor is not applied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = [
    "kd_loss",
    "kl_to_teacher",
    "supcon_loss",
    "sup_mtkd_loss",
    "two_views",
    "SUPCON_REDUCTIONS",
    "ensemble_logits",
]


#: How :func:`supcon_loss` reduces the per-anchor losses: eq. 17's sum, or their mean.
SUPCON_REDUCTIONS = ("sum", "mean")


def _check_unit(name: str, value: float) -> float:
    v = float(value)
    if not (0.0 <= v <= 1.0):  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return v


def _check_positive(name: str, value: float) -> float:
    v = float(value)
    if not (v > 0.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def kl_to_teacher(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """The distillation term ``T^2 KL(softmax(z_t / T) || softmax(z_s / T))`` (eqs. 7, 8, 10).

    Shared by :func:`kd_loss` (eq. 11) and :func:`sup_mtkd_loss` (eq. 18).

    Args:
        student_logits: student logits ``(B, K)`` (with gradient).
        teacher_logits: teacher logits ``(B, K)``; detached here.
        temperature: distillation temperature ``T > 0``.

    Returns:
        A scalar: ``T^2`` times the KL divergence summed over classes and averaged over the
        batch.

    Raises:
        ValueError: ``temperature`` is not positive, or the logits' shapes differ.
    """
    t = _check_positive("temperature", temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    teacher_logits = teacher_logits.detach()
    kl = F.kl_div(F.log_softmax(student_logits / t, dim=1),
                  F.log_softmax(teacher_logits / t, dim=1), reduction="batchmean", log_target=True)
    return kl * (t * t)


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, y: Tensor, *, lam: float,
            temperature: float) -> Tensor:
    """PFedCDP's client-side distillation loss (eq. 11).

    ``(1 - lam) CE(z_s, y) + lam T^2 KL(softmax(z_t / T) || softmax(z_s / T))``: the local
    classifier fits its own labels while staying close to the server model's softened outputs.

    Args:
        student_logits: local model logits ``(B, K)`` (with gradient).
        teacher_logits: server model logits ``(B, K)`` (detached here).
        y: labels ``(B,)`` (class indices).
        lam: weight of the distillation term, in ``[0, 1]``.
        temperature: distillation temperature ``T > 0``.

    Returns:
        The scalar loss; CE is the batch mean (eq. 9), KL the batch mean (eq. 10).

    Raises:
        ValueError: ``lam`` outside ``[0, 1]`` or ``temperature <= 0``.
    """
    lam = _check_unit("lam", lam)
    t = _check_positive("temperature", temperature)
    ce = F.cross_entropy(student_logits, y)
    return (1.0 - lam) * ce + lam * kl_to_teacher(student_logits, teacher_logits, t)


def supcon_loss(embeddings: Tensor, labels: Tensor, temperature: float = 0.07, reduction: str = "mean") -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, ``L_out``; PFedCDP eq. 17).

    The embeddings are L2-normalised here. For an anchor ``i`` with positives ``P(i)`` (the
    other samples with the same label)::

        L_i = -1/|P(i)| sum_{p in P(i)} log( exp(z_i.z_p / tau) / sum_{a != i} exp(z_i.z_a / tau) )

    eq. 17 is written for ``2N`` augmented views, with normaliser ``2 N_y - 1``: give the two
    views' embeddings stacked and the labels repeated (:func:`two_views`); with one view per
    sample the normaliser is ``|P(i)| = N_y - 1``. Anchors without any positive are left out.
    The denominator is computed with ``logsumexp`` (numerically stable).

    Args:
        embeddings: ``(B, D)`` (or ``(B, ...)``, flattened per sample) representations.
        labels: ``(B,)`` class labels.
        temperature: ``tau > 0`` (default 0.07).
        reduction: ``"mean"`` (default): the mean of ``L_i`` over the anchors that have
            positives; ``"sum"``: their sum, as eq. 17's text says ("summed over all samples
            in the batch"); the module docstring relates eq. 18's alpha between the two.

    Returns:
        A scalar. When no anchor has a positive (all labels distinct, or ``B < 2``) it is a
        zero that stays connected to ``embeddings`` (so ``backward()`` works and gives zero
        gradients).

    Raises:
        ValueError: ``temperature <= 0``, an unknown ``reduction``, or the batch sizes of
            embeddings and labels differ.
    """
    tau = _check_positive("temperature", temperature)
    if reduction not in SUPCON_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(SUPCON_REDUCTIONS)}, got {reduction!r}")
    labels = labels.reshape(-1)
    if embeddings.shape[0] != labels.shape[0]:
        raise ValueError(f"{embeddings.shape[0]} embeddings but {labels.shape[0]} labels")
    n = embeddings.shape[0]
    labels = labels.to(embeddings.device)
    eye = torch.eye(n, dtype=torch.bool, device=embeddings.device)
    positives = (labels[:, None] == labels[None, :]) & ~eye
    n_pos = positives.sum(dim=1)
    anchors = n_pos > 0
    if not bool(anchors.any()):
        return embeddings.sum() * 0.0
    z = F.normalize(embeddings.reshape(n, -1), p=2, dim=1)
    sim = (z @ z.t()) / tau
    log_denominator = torch.logsumexp(sim.masked_fill(eye, float("-inf")), dim=1, keepdim=True)
    log_prob = sim - log_denominator
    pos_log_prob = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
    per_anchor = -pos_log_prob[anchors] / n_pos[anchors].to(sim.dtype)
    return per_anchor.sum() if reduction == "sum" else per_anchor.mean()


def two_views(first: Tensor, second: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The ``2N`` views of eq. 17 as :func:`supcon_loss` takes them.

    Args:
        first: the first view's embeddings (or images) ``(N, ...)``.
        second: the second view's, of the same samples in the same order ``(N, ...)``.
        labels: the samples' labels ``(N,)``.

    Returns:
        ``(cat([first, second]), cat([labels, labels]))``: sample ``i``'s two views sit at
        rows ``i`` and ``N + i``, each the other's positive.

    Raises:
        ValueError: the views' shapes differ, or their batch size is not the labels'.
    """
    if first.shape != second.shape:
        raise ValueError(f"the two views differ in shape: {tuple(first.shape)} and {tuple(second.shape)}")
    labels = labels.reshape(-1)
    if first.shape[0] != labels.shape[0]:
        raise ValueError(f"{first.shape[0]} samples per view but {labels.shape[0]} labels")
    return torch.cat([first, second]), torch.cat([labels, labels])


def sup_mtkd_loss(student_logits: Tensor, student_embeddings: Tensor, teacher_logits: Tensor,
                  y: Tensor, *, alpha: float, temperature: float, tau: float, reduction: str = "mean",
                  parts: bool = False) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """PFedCDP's server-side refinement loss (eq. 18).

    ``(1 - alpha) L_SCL(e_s, y) + alpha T^2 KL(softmax(z_t / T) || softmax(z_s / T))``, with
    supervised contrastive learning in place of cross-entropy.

    Args:
        student_logits: student logits ``(B, K)``.
        student_embeddings: student representations ``(B, D)`` for the contrastive term.
        teacher_logits: the teacher ensemble's logits ``(B, K)``, already combined (e.g. by
            :func:`ensemble_logits`); detached here.
        y: labels ``(B,)``.
        alpha: weight of the distillation term, in ``[0, 1]``.
        temperature: distillation temperature ``T > 0``.
        tau: contrastive temperature ``tau > 0``.
        reduction: SupCon's reduction over the anchors, ``"mean"`` (default) or ``"sum"``
            (eq. 17's text; see :func:`supcon_loss`).
        parts: also return the two terms (unweighted), for logging.

    Returns:
        The scalar loss; with ``parts``, ``(loss, L_SCL, T^2 KL)``.

    Raises:
        ValueError: a weight, temperature or reduction out of range.
    """
    alpha = _check_unit("alpha", alpha)
    t = _check_positive("temperature", temperature)
    scl = supcon_loss(student_embeddings, y, tau, reduction)
    kd = kl_to_teacher(student_logits, teacher_logits, t)
    loss = (1.0 - alpha) * scl + alpha * kd
    return (loss, scl, kd) if parts else loss


def ensemble_logits(logits: Sequence[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """The teacher ensemble's logits ``sum_k w_k z_k`` (the ``z_bar_T`` of section III-D).

    Args:
        logits: the ``K`` teachers' logits, each of the same shape (e.g. ``(B, C)``).
        weights: one non-negative weight per teacher (e.g. from
            :func:`medfl.shapley.teacher_weights`); normalised here to sum to 1. ``None``
            (default) gives the paper's uniform ``1/K``.

    Returns:
        A tensor of the teachers' common shape.

    Raises:
        ValueError: no teacher, shapes differ, or the weights are of the wrong length,
            negative, not finite, or sum to 0.
    """
    if len(logits) == 0:
        raise ValueError("ensemble_logits needs at least one teacher's logits")
    shape = logits[0].shape
    for k, z in enumerate(logits):
        if z.shape != shape:
            raise ValueError(f"teacher {k}'s logits have shape {tuple(z.shape)}, teacher 0's "
                             f"{tuple(shape)}")
    if weights is None:
        w = [1.0 / len(logits)] * len(logits)
    else:
        w = [float(v) for v in weights]
        if len(w) != len(logits):
            raise ValueError(f"{len(w)} weights for {len(logits)} teachers")
        bad = [v for v in w if not (math.isfinite(v) and v >= 0.0)]
        if bad:
            raise ValueError(f"teacher weights must be finite and non-negative, got {bad}")
        total = sum(w)
        if total <= 0.0:
            raise ValueError(f"teacher weights must sum to more than 0, got {w}")
        w = [v / total for v in w]
    stacked = torch.stack(list(logits))
    wt = torch.tensor(w, dtype=stacked.dtype, device=stacked.device)
    return (wt.reshape(-1, *([1] * len(shape))) * stacked).sum(dim=0)
