"""Subgroup fairness: AUC per sex at each client and the gap of the FedSKD paper (eq. 16).

At the client, :func:`subgroup_scores` scores one split separately for each subgroup
(``auc_M``, ``auc_F`` with their sizes ``n_M``, ``n_F``); only those scalars leave it.
:func:`fairness_report` then reads a run's ``metrics.csv`` rows of the last round:

    Delta_auc = | 1/N sum_k AUC_male^k  -  1/N sum_k AUC_female^k |        (eq. 16)

over the N clients on their local test split (the paper's setting). A client whose test
split lacks one sex, or has a single class within it, has no AUC for that group; the means
skip it (and say how many clients entered each mean).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from medfl.metrics.classification import roc_auc

__all__ = ["GROUPS", "subgroup_scores", "fairness_report"]

#: Subgroup attribute -> (code, metric-name suffix) pairs scored by :func:`subgroup_scores`.
GROUPS: dict[str, tuple[str, ...]] = {"sex": ("M", "F")}


def subgroup_scores(y: np.ndarray, probs: np.ndarray, attributes: Mapping[str, np.ndarray] | None
                    ) -> dict[str, float]:
    """AUC and size of every subgroup of one split, e.g. ``{"auc_M", "n_M", "auc_F", "n_F"}``.

    Args:
        y: true labels ``(N,)``.
        probs: class probabilities ``(N, C)``.
        attributes: attribute name -> per-sample codes ``(N,)`` (``""`` unknown); ``None``
            or an attribute of another length gives nothing.
    """
    out: dict[str, float] = {}
    if not attributes:
        return out
    y = np.asarray(y)
    for attr, codes in GROUPS.items():
        vals = attributes.get(attr)
        if vals is None or len(vals) != len(y):
            continue
        vals = np.asarray(vals).astype(str)
        for code in codes:
            mask = vals == code
            out[f"n_{code}"] = float(mask.sum())
            out[f"auc_{code}"] = float(roc_auc(y[mask], np.asarray(probs)[mask])) if mask.any() else float("nan")
    return out


def fairness_report(metrics: pd.DataFrame, split: str = "local_test") -> dict[str, Any]:
    """Eq. 16 on the last evaluated round of ``metrics`` (a run's ``metrics.csv``).

    Returns:
        ``{}`` when the split has no subgroup columns; else ``{"split", "round",
        "auc_M", "auc_F"`` (means over clients), ``"avg"`` (their mean), ``"delta_auc"``
        (eq. 16), ``"clients_M"``, ``"clients_F"`` (clients that entered each mean),
        ``"per_client": {client_id: {"auc_M", "auc_F", "n_M", "n_F"}}}``.
    """
    if metrics.empty or "auc_M" not in metrics.columns or "auc_F" not in metrics.columns:
        return {}
    df = metrics[metrics["split"] == split]
    if df.empty:
        return {}
    last = int(df["round"].max())
    df = df[df["round"] == last]
    m = df["auc_M"].astype(float).dropna()
    f = df["auc_F"].astype(float).dropna()
    mean_m = float(m.mean()) if len(m) else float("nan")
    mean_f = float(f.mean()) if len(f) else float("nan")
    per_client = {str(r["client_id"]): {k: float(r[k]) for k in ("auc_M", "auc_F", "n_M", "n_F") if k in r}
                  for _, r in df.iterrows()}
    return {"split": split, "round": last, "auc_M": mean_m, "auc_F": mean_f,
            "avg": float(np.mean([mean_m, mean_f])), "delta_auc": float(abs(mean_m - mean_f)),
            "clients_M": int(len(m)), "clients_F": int(len(f)), "per_client": per_client}
