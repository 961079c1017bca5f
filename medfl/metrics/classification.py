"""Classification metrics in NumPy, and a per-client summary table.

All metric functions take integer labels ``y_true`` of shape ``(N,)`` and class
probabilities ``probs`` of shape ``(N, C)``; the predicted class is ``argmax(probs, axis=1)``
(the first maximum on ties). A 1-D ``probs`` of shape ``(N,)`` is read as the probability of
class 1 of a binary problem, i.e. ``[1 - p, p]``.

Conventions (chosen to agree with scikit-learn where it defines the value):

* **Macro averages** (precision, recall/sensitivity, F1, and multi-class specificity) are
  taken over the classes present in ``y_true`` *or* predicted, as scikit-learn does when no
  ``labels`` are given. A class that never occurs in either is ignored (it says nothing
  about this client). This also holds for binary problems: precision, recall and F1 are
  macro averages over both classes, **not** scikit-learn's default ``average="binary"``.
* **Zero division** gives 0, like scikit-learn's ``zero_division=0``: a class that is never
  predicted has precision 0; F1 is 0 when precision + recall is 0; a specificity with no
  negatives (TN + FP = 0) is 0.
* **Specificity**: multi-class (C > 2) is the macro average over classes of
  TN / (TN + FP) (one-vs-rest). Binary (C == 2) is the specificity of the positive class 1,
  TN / (TN + FP) with class 0 as negative, which equals the recall of class 0.
* **AUC**: binary is the ROC AUC of ``probs[:, 1]``; multi-class is the macro one-vs-rest
  ROC AUC over the classes present in ``y_true``. It is computed with the Mann-Whitney U
  statistic using average ranks, so ties score 1/2, exactly like
  :func:`sklearn.metrics.roc_auc_score`. It is NaN when ``y_true`` holds a single class.
* **Empty input** (N == 0): every metric is NaN and ``n`` is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "METRICS",
    "accuracy",
    "classification_metrics",
    "macro_f1",
    "macro_precision",
    "macro_recall",
    "macro_specificity",
    "micro_f1",
    "roc_auc",
    "summarize",
]


# --------------------------------------------------------------------------------- input handling


def _prepare(
    y_true: Any, probs: Any, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate inputs; return ``(y_true int64 (N,), probs float64 (N, C), C)``."""
    y = np.asarray(y_true)
    p = np.asarray(probs, dtype=np.float64)
    if y.ndim != 1:
        raise ValueError(f"y_true must have shape (N,), got {y.shape}")
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    if p.ndim != 2:
        raise ValueError(f"probs must have shape (N, C) or (N,), got {p.shape}")
    if p.shape[0] != y.shape[0]:
        raise ValueError(f"y_true has {y.shape[0]} samples but probs has {p.shape[0]}")
    n_classes = p.shape[1] if num_classes is None else num_classes
    if num_classes is not None and p.shape[1] != num_classes:
        raise ValueError(f"num_classes={num_classes} but probs has {p.shape[1]} columns")
    if n_classes < 1:
        raise ValueError(f"probs must have at least one column, got {p.shape}")
    if y.size:
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
            if not np.all(np.mod(y, 1) == 0):
                raise ValueError("y_true must hold integer class labels")
        y = y.astype(np.int64)
        if y.min() < 0 or y.max() >= n_classes:
            raise ValueError(
                f"y_true labels must lie in [0, {n_classes}), got [{y.min()}, {y.max()}]"
            )
        if not np.all(np.isfinite(p)):
            raise ValueError("probs must be finite")
    else:
        y = y.astype(np.int64)
    return y, p, n_classes


def _confusion(y: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """Confusion matrix ``cm[true, pred]`` of shape ``(C, C)``."""
    return np.bincount(y * n_classes + pred, minlength=n_classes * n_classes).reshape(
        n_classes, n_classes
    )


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


class _Counts:
    """Per-class counts shared by the metric functions."""

    def __init__(self, y_true: Any, probs: Any, num_classes: int | None = None) -> None:
        y, p, c = _prepare(y_true, probs, num_classes)
        self.y, self.p, self.c = y, p, c
        self.n = y.shape[0]
        self.pred = np.argmax(p, axis=1) if self.n else np.zeros(0, dtype=np.int64)
        cm = _confusion(y, self.pred, c)
        self.tp = np.diag(cm).astype(np.float64)
        self.fp = cm.sum(axis=0) - self.tp  # predicted k, true not k
        self.fn = cm.sum(axis=1) - self.tp  # true k, predicted not k
        self.tn = self.n - self.tp - self.fp - self.fn
        # classes taking part in macro averages: present in y_true or predicted
        self.active = (cm.sum(axis=0) + cm.sum(axis=1)) > 0

    def macro(self, values: np.ndarray) -> float:
        if self.n == 0:
            return float("nan")
        return float(np.mean(values[self.active]))

    def accuracy(self) -> float:
        return float(self.tp.sum() / self.n) if self.n else float("nan")

    def precision(self) -> float:
        return self.macro(_safe_div(self.tp, self.tp + self.fp))

    def recall(self) -> float:
        return self.macro(_safe_div(self.tp, self.tp + self.fn))

    def f1(self) -> float:
        return self.macro(_safe_div(2.0 * self.tp, 2.0 * self.tp + self.fp + self.fn))

    def micro_f1(self) -> float:
        tp, fp, fn = self.tp.sum(), self.fp.sum(), self.fn.sum()
        return float(_safe_div(2.0 * tp, 2.0 * tp + fp + fn)) if self.n else float("nan")


# ---------------------------------------------------------------------------------------- ROC AUC


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x`` with ties given their average rank (``scipy.stats.rankdata``)."""
    n = x.shape[0]
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    new_group = np.empty(n, dtype=bool)
    new_group[0] = True
    new_group[1:] = xs[1:] != xs[:-1]
    starts = np.flatnonzero(new_group)
    counts = np.diff(np.append(starts, n))
    group_rank = starts + (counts + 1) / 2.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.repeat(group_rank, counts)
    return ranks


def _binary_auc(positive: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC via Mann-Whitney U; NaN if ``positive`` is all True or all False."""
    n_pos = int(positive.sum())
    n_neg = positive.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(scores)
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _auc(y: np.ndarray, p: np.ndarray, n_classes: int) -> float:
    if y.shape[0] == 0 or np.unique(y).shape[0] < 2:
        return float("nan")
    if n_classes == 2:
        return _binary_auc(y == 1, p[:, 1])
    present = np.unique(y)
    return float(np.mean([_binary_auc(y == k, p[:, k]) for k in present]))


# --------------------------- public metric functions (plugin signature: (y_true, probs) -> float)


def accuracy(y_true: Any, probs: Any) -> float:
    """Fraction of samples whose argmax class equals the label; NaN if empty."""
    return _Counts(y_true, probs).accuracy()


def macro_precision(y_true: Any, probs: Any) -> float:
    """Macro precision over present-or-predicted classes; unpredicted classes count 0."""
    return _Counts(y_true, probs).precision()


def macro_recall(y_true: Any, probs: Any) -> float:
    """Macro recall (= sensitivity) over present-or-predicted classes."""
    return _Counts(y_true, probs).recall()


def _specificity(c: _Counts) -> float:
    if c.n == 0:
        return float("nan")
    neg = c.tn + c.fp
    spec = np.where(neg > 0, c.tn / np.maximum(neg, 1), np.nan)
    if c.c == 2:
        return float(spec[1])
    vals = spec[c.active]
    vals = vals[~np.isnan(vals)]
    return float(vals.mean()) if len(vals) else float("nan")


def macro_specificity(y_true: Any, probs: Any) -> float:
    """Specificity TN/(TN+FP): macro over classes for C > 2; for C == 2 that of class 1
    (the recall of class 0).

    Undefined where a class has no negatives (a test set of one class): such classes are left
    out of the macro average, and the result is NaN when none is left. Unlike precision's
    zero-division 0, a 0 here would read as "every negative misclassified".
    """
    return _specificity(_Counts(y_true, probs))


def macro_f1(y_true: Any, probs: Any) -> float:
    """Macro F1 over present-or-predicted classes."""
    return _Counts(y_true, probs).f1()


def micro_f1(y_true: Any, probs: Any) -> float:
    """Micro F1 (pooled TP/FP/FN over classes; equals accuracy for single-label data)."""
    return _Counts(y_true, probs).micro_f1()


def roc_auc(y_true: Any, probs: Any) -> float:
    """Binary ROC AUC of class 1, or macro one-vs-rest AUC over classes in ``y_true``.

    NaN when ``y_true`` holds a single class or is empty.
    """
    y, p, n_classes = _prepare(y_true, probs)
    return _auc(y, p, n_classes)


#: Metric name -> ``func(y_true, probs) -> float``, as registered by the metrics plugin.
METRICS: dict[str, Callable[[Any, Any], float]] = {
    "accuracy": accuracy,
    "precision": macro_precision,
    "recall": macro_recall,
    "sensitivity": macro_recall,
    "specificity": macro_specificity,
    "f1": macro_f1,
    "micro_f1": micro_f1,
    "auc": roc_auc,
}


def classification_metrics(
    y_true: Any, probs: Any, num_classes: int | None = None
) -> dict[str, float]:
    """All metrics of :data:`METRICS` plus the sample count, computed in one pass.

    Args:
        y_true: Integer labels, shape ``(N,)``, values in ``[0, C)``.
        probs: Class probabilities, shape ``(N, C)`` (or ``(N,)`` for binary class-1
            probabilities).
        num_classes: Expected ``C``; if given, ``probs`` must have that many columns.
            Default: ``probs.shape[1]``.

    Returns:
        ``{"accuracy", "precision", "recall", "sensitivity", "specificity", "f1",
        "micro_f1", "auc", "n"}`` as Python floats (``n`` = N). See the module docstring
        for averaging and edge-case conventions.

    Raises:
        ValueError: On mismatched shapes, labels out of range or non-finite probabilities.
    """
    c = _Counts(y_true, probs, num_classes)
    if c.n == 0:
        return {**{name: float("nan") for name in METRICS}, "n": 0.0}
    recall = c.recall()
    return {
        "accuracy": c.accuracy(),
        "precision": c.precision(),
        "recall": recall,
        "sensitivity": recall,
        "specificity": _specificity(c),
        "f1": c.f1(),
        "micro_f1": c.micro_f1(),
        "auc": _auc(c.y, c.p, c.c),
        "n": float(c.n),
    }


# --------------------------------------------------------------------------- per-client summaries


def summarize(
    rows: pd.DataFrame,
    metrics: Sequence[str],
    by: Sequence[str],
    *,
    lower_is_better: Sequence[str] = (),
) -> pd.DataFrame:
    """Summarise per-client metrics per group (e.g. per round and split).

    Args:
        rows: One row per client and group, with columns ``client_id``, every column in
            ``by`` and every column in ``metrics``.
        metrics: Metric columns to summarise.
        by: Grouping columns (e.g. ``["round", "split"]``); may be empty for one group.
        lower_is_better: Metrics for which *worst* is the maximum and *best* the minimum
            (e.g. a loss). Default: none, higher is better for every metric.

    Returns:
        One row per group, sorted by ``by``, with the ``by`` columns, ``n_clients`` and for
        each metric ``m``: ``m_mean``, ``m_std`` (population std, ``ddof=0``), ``m_worst``,
        ``m_best`` and ``m_worst_client`` (the ``client_id`` of the worst value; the first
        such row on ties). NaN values (e.g. AUC of a single-class client) are skipped; a
        metric that is NaN for every client of a group gives NaN statistics and a ``None``
        worst client.

    Raises:
        ValueError: If a required column is missing.
    """
    metrics = list(metrics)
    by = list(by)
    needed = ["client_id", *by, *metrics]
    missing = [col for col in needed if col not in rows.columns]
    if missing:
        raise ValueError(f"summarize: rows lacks column(s) {missing}")
    unknown = [m for m in lower_is_better if m not in metrics]
    if unknown:
        raise ValueError(f"summarize: lower_is_better names metrics not in metrics: {unknown}")

    records: list[dict[str, Any]] = []
    groups = rows.groupby(by, sort=True, dropna=False) if by else [((), rows)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        rec: dict[str, Any] = dict(zip(by, key))
        rec["n_clients"] = int(len(group))
        for m in metrics:
            values = pd.to_numeric(group[m], errors="coerce").to_numpy(dtype=np.float64)
            ok = ~np.isnan(values)
            if not ok.any():
                rec.update({f"{m}_{k}": np.nan for k in ("mean", "std", "worst", "best")})
                rec[f"{m}_worst_client"] = None
                continue
            v = values[ok]
            ids = group["client_id"].to_numpy()[ok].tolist()   # Python scalars, not NumPy's
            low = m in lower_is_better
            worst_i = int(np.argmax(v)) if low else int(np.argmin(v))
            rec[f"{m}_mean"] = float(v.mean())
            rec[f"{m}_std"] = float(v.std(ddof=0))
            rec[f"{m}_worst"] = float(v[worst_i])
            rec[f"{m}_best"] = float(v.min() if low else v.max())
            rec[f"{m}_worst_client"] = ids[worst_i]
        records.append(rec)

    columns = [*by, "n_clients"]
    for m in metrics:
        columns += [f"{m}_mean", f"{m}_std", f"{m}_worst", f"{m}_best", f"{m}_worst_client"]
    return pd.DataFrame.from_records(records, columns=columns)
