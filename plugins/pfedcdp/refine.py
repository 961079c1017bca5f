"""PFedCDP's post-hoc refinement (Algorithm 2, lines 15-28; eqs. 16-19), a part of
:class:`~medfl_plugins.pfedcdp.method.PFedCDP` (:class:`Refinement`): the cluster models that
trained are teachers, weighted by Shapley values or otherwise; a new student learns eq. 18 on
the coordinator's public training split and is scored on its test split after every epoch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl.capability import CLUSTERS
from medfl.logs import plugin_logger
from medfl.method import MethodConfigError, derive_seed
from medfl.metrics import classification_metrics
from medfl.models.registry import build_seeded
from medfl.shapley import (balanced_subset, ensemble_game, feature_importance, importance_weights, mean_importance,
                           shapley_values, teacher_weights)
from medfl.training import StepMeans, get_state, predict_proba, train_epochs
from medfl_plugins.pfedcdp.losses import Eq18Loss
from medfl_plugins.pfedcdp.models import frozen, split_keys
from medfl_plugins.pfedcdp.settings import AUTHORS_TEACHER_WEIGHTS

__all__ = ["Refinement", "TwoViews", "teacher_logits"]

logger = plugin_logger(__package__ or __name__)


class TwoViews(Dataset):
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


def teacher_logits(teachers: list[nn.Module], loader: DataLoader, device: str) -> tuple[list[torch.Tensor], Any]:
    """Each teacher's logits on ``loader``'s samples (on the CPU) and their labels (numpy)."""
    logits, y = [], None
    for t in teachers:
        zs, ys = [], []
        with torch.no_grad():
            for x, yy in loader:
                zs.append(t(x.to(device)).cpu())
                ys.append(yy)
        logits.append(torch.cat(zs))
        y = torch.cat(ys).numpy()
    return logits, y


class Refinement:
    """The post-hoc refinement's steps (``finalize``) and what it leaves (``final_models``,
    ``final_tables``). Reads the method's refinement settings, its ``federation``, the cluster
    models (``_cluster_model``, ``_spec``, ``_state``) and who trained."""

    def _teacher(self, c: str) -> nn.Module:
        """Cluster ``c``'s model (extractor and server classifier) as a frozen teacher."""
        return frozen(self._cluster_model(c))

    def _teacher_clusters(self) -> list[str]:
        """The clusters whose models trained (some member sent a reply)."""
        return [c for c in CLUSTERS if any(self._cluster(cid) == c for cid in self.trained)]

    def _weights(self, clusters: list[str], logits: list[torch.Tensor], y: np.ndarray) -> tuple[list[float], Any]:
        """The teacher weights and (for ``shapley``) the Shapley values."""
        if self.teacher_weights == "uniform":
            return [1.0 / len(clusters)] * len(clusters), None
        if self.teacher_weights != "shapley":           # "fixed" (the authors' code's) or a list, by cluster
            given = AUTHORS_TEACHER_WEIGHTS if self.teacher_weights == "fixed" else self.teacher_weights
            if len(given) != len(CLUSTERS):
                raise MethodConfigError(f"pfedcdp: teacher_weights lists {len(given)} weights; give "
                                        f"one per cluster ({', '.join(CLUSTERS)})")
            w = [given[CLUSTERS.index(c)] for c in clusters]
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
        """Algorithm 2, lines 15-28: the teachers' weights (eq. 16's Shapley values or another
        choice, :meth:`_weights`), eqs. 16 and 19's feature importance (:meth:`_feature_shap`),
        and a new student trained on eq. 18 (:meth:`_train_student`)."""
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
        weights, shap_info = self._weights(clusters, *teacher_logits(teachers, plain, fed.device))
        report: dict[str, Any] = {"teachers": clusters, "teacher_weights_mode": self.teacher_weights,
                                  "teacher_weights": dict(zip(clusters, weights))}
        if shap_info is not None:
            report["shapley"] = {"score": self.shapley_score, **shap_info,
                                 "values": dict(zip(clusters, shap_info["values"]))}
        scale, student_spec, weights_map = self._feature_shap(teachers, clusters, plain, report)
        student = build_seeded(student_spec, derive_seed(fed.seed, "student"), fed.device)
        if weights_map is not None:
            student.feature_weights.copy_(torch.as_tensor(weights_map, dtype=torch.float32))
        split_keys(student)   # the student needs embed() for SupCon
        report["refine"] = self._train_student(student, teachers, weights, scale, bs)
        self.student = get_state(student)
        self._student_spec = {k: v for k, v in student_spec.items()
                              if k not in ("spatial_dims", "in_channels", "num_classes")}
        self.report_ = report
        self._teacher_weights = dict(zip(clusters, weights))
        logger.info(f"medfl pfedcdp: refined the student on {fed.public.size('train')} public samples; teacher weights "
                    + ", ".join(f"{c} {w:.3f}" for c, w in zip(clusters, weights)))

    def _feature_shap(self, teachers: list[nn.Module], clusters: list[str], plain: DataLoader,
                      report: dict[str, Any]) -> tuple[float, dict[str, Any], Any]:
        """Eqs. 16 and 19 (``feature_shap``): each teacher's feature importance psi^(k) on public
        samples (``report["feature_shap"]``), and what it does to the student: the loss's scale
        (``"printed"``: mean(psi)), the student's spec and its input weights (``"input"``:
        ``input_weighted`` with weights of mean 1, else ``None``)."""
        fed = self.federation
        student_spec = self._model_spec(self.student_model)
        if self.feature_shap == "off":
            return 1.0, student_spec, None
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
            return float(np.mean(psi)), student_spec, None
        weights_map = importance_weights(psi, floor=0.1)    # per feature: the student sees x * w(psi), mean(w) = 1
        report["feature_shap"].update(weight_min=float(weights_map.min()), weight_max=float(weights_map.max()))
        return 1.0, self._model_spec({"name": "input_weighted", "inner": dict(self.student_model),
                                      "shape": list(weights_map.shape)}), weights_map

    def _train_student(self, student: nn.Module, teachers: list[nn.Module], weights: list[float], scale: float,
                       bs: int) -> dict[str, Any]:
        """Eq. 18 for ``refine_epochs`` epochs (Adam, ``refine_lr``) on the public training split;
        ``student_metrics``' rows (:meth:`final_tables`) and the report's ``refine`` block."""
        fed = self.federation
        opt = torch.optim.Adam(student.parameters(), lr=self.refine_lr)
        loader = self._refine_loader()
        loss = Eq18Loss(teachers, weights, alpha=self.alpha, temperature=self.refine_temperature, tau=self.tau,
                        reduction=self.supcon_reduction, scale=scale, views=self.supcon_views,
                        channels=int(fed.in_channels))
        test = fed.public.loader("test", batch_size=bs, shuffle=False, augment=False)
        rows = [self._student_scores(student, 0, test)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(fed.seed, "refine", "init"))
            for epoch in range(1, self.refine_epochs + 1):
                loss.epoch = StepMeans(check=("loss",))
                train_epochs(student, loader, opt, 1, device=fed.device, loss_fn=loss)
                parts = loss.epoch.means()
                rows.append({"epoch": epoch, "split": "public_train", "steps": float(loss.epoch.steps),
                             **{k: parts.get(k, float("nan")) for k in ("loss", "supcon", "kd")}})
                rows.append(self._student_scores(student, epoch, test))
        self._student_rows = rows
        out = {"epochs": self.refine_epochs, "loss": loss.all.means().get("loss", 0.0),
               "steps": float(loss.all.steps), "public_train": int(fed.public.size("train")),
               "supcon_reduction": self.supcon_reduction, "supcon_views": self.supcon_views,
               "student_metrics": "student_metrics.csv"}
        if loss.same_views:
            note = ("the public training split has no random transforms (public_dataset.augment), so the two views "
                    "of each sample are the same image: each anchor's extra positive is itself")
            out["views_identical"] = note
            logger.warning(f"medfl pfedcdp: supcon_views 2: {note}")
        return out

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
            views = TwoViews(fed.public.dataset("train", augment=True), fed.public.dataset("train", augment=True))
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
        clusters = self._teacher_clusters()
        out = {f"teacher_{c}": (self._spec(c), self._state(c)) for c in clusters}
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
