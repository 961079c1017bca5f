"""PFedCDP's losses as the training loops call them (``loss_fn(model, x, y)``): eq. 11 at the
client (and cross-entropy for the server classifier), eq. 18 in the post-hoc refinement. The
formulas themselves are :mod:`medfl.losses.distill`'s."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from medfl.losses.distill import ensemble_logits, kd_loss, sup_mtkd_loss, two_views
from medfl.training import StepMeans
from medfl_plugins.pfedcdp.models import freeze_body

__all__ = ["Eq18Loss", "local_loss"]

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def local_loss(teacher: nn.Module | None = None, *, whole: bool = False, lam: float = 0.0,
               temperature: float = 1.0, probabilities: bool = False) -> LossFn:
    """Algorithm 1's classifier loss, eq. 11: ``(1 - lam) CE + lam T^2 KL(teacher || student)``
    on the model's logits; cross-entropy alone without a ``teacher`` (a cluster outside
    ``kd_clusters``; the coordinator's fit of the server classifier).

    Args:
        teacher: the frozen teacher (the cluster's global extractor with the server classifier).
        whole: the whole model trains (the authors' v1.7 clients); otherwise the extractor is
            frozen (evaluation mode, no gradient) and only the classifier learns.
        lam, temperature: eq. 11's lambda and T_KD.
        probabilities: soft-max the student's and the teacher's outputs before eq. 11 (the
            authors' models end in a softmax layer, which eq. 11 soft-maxes again).
    """
    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if whole:
            zs = m(x)
        else:
            freeze_body(m)
            with torch.no_grad():
                z = m.embed(x)
            zs = m.head(z)
        if teacher is None:
            return nn.functional.cross_entropy(zs, y)
        with torch.no_grad():
            zt = teacher(x)
        if probabilities:       # the authors' softmax output layer, soft-maxed again by the loss
            zs, zt = torch.softmax(zs, dim=1), torch.softmax(zt, dim=1)
        return kd_loss(zs, zt, y, lam=lam, temperature=temperature)

    return loss


class Eq18Loss:
    """Eq. 18 on a batch of the public training split: ``scale ((1 - alpha) SupCon(student
    embeddings; tau) + alpha T^2 KL(weighted teacher ensemble || student))``.

    With ``views=2`` a batch is ``(B, 2C, ...)``, two views of each sample stacked along the
    channels (:class:`medfl_plugins.pfedcdp.refine.TwoViews`): SupCon runs on the 2B embeddings,
    KD on both views' logits. ``epoch`` and ``all`` average the loss terms (``loss``,
    ``supcon``, ``kd``) over the current epoch and the whole training; ``same_views`` says
    whether the first batch's two views were the same image (``None`` before it, or with one view).
    """

    def __init__(self, teachers: list[nn.Module], weights: list[float], *, alpha: float, temperature: float,
                 tau: float, reduction: str, scale: float, views: int, channels: int) -> None:
        self.teachers, self.weights, self.scale, self.views, self.channels = teachers, weights, scale, views, channels
        self.terms = {"alpha": alpha, "temperature": temperature, "tau": tau, "reduction": reduction}
        self.epoch, self.all = StepMeans(check=("loss",)), StepMeans()
        self.same_views: bool | None = None

    def __call__(self, m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.views == 2:
            first, second = x[:, :self.channels], x[:, self.channels:]
            if self.same_views is None:
                self.same_views = bool(torch.equal(first, second))
            x, y = two_views(first, second, y)
        with torch.no_grad():
            zt = ensemble_logits([t(x) for t in self.teachers], self.weights)
        emb = m.embed(x)
        total, scl, kd = sup_mtkd_loss(m.head(emb), emb, zt, y, parts=True, **self.terms)
        for log in (self.epoch, self.all):
            log.add(n, loss=self.scale * total, supcon=scl, kd=kd)
        return self.scale * total
