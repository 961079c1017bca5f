"""Evaluation metrics (NumPy) and per-client summaries."""

from __future__ import annotations

from medfl.metrics.classification import (
    METRICS,
    accuracy,
    classification_metrics,
    macro_f1,
    macro_precision,
    macro_recall,
    macro_specificity,
    micro_f1,
    roc_auc,
    summarize,
)

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
