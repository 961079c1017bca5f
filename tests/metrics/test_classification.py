"""Tests for medfl.metrics.classification against scikit-learn, edge cases and summarize."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_score,
    recall_score,
    roc_auc_score,
)

from medfl.metrics import (
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

KEYS = [
    "accuracy", "precision", "recall", "sensitivity", "specificity", "f1", "micro_f1", "auc", "n",
]


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _random_case(seed: int, n: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, size=n)
    # informative but noisy scores
    logits = rng.normal(size=(n, c)) + 1.5 * np.eye(c)[y]
    return y, _softmax(logits)


def _ties_case(seed: int, n: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities quantised to few levels: many tied scores."""
    y, p = _random_case(seed, n, c)
    p = np.round(p * 4) + 0.5  # levels 0.5 .. 4.5
    return y, p / p.sum(axis=1, keepdims=True)


def _never_predicted_case(seed: int, n: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Class ``c - 1`` occurs in y_true but is never the argmax."""
    y, p = _random_case(seed, n, c)
    y[:3] = c - 1
    p[:, c - 1] *= 0.01
    return y, p / p.sum(axis=1, keepdims=True)


def _absent_class_case(seed: int, n: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Class 0 never occurs in y_true (label-skewed client)."""
    y, p = _random_case(seed, n, c)
    y = np.where(y == 0, 1, y)
    return y, p


CASES = [
    pytest.param(*_random_case(0, 50, 2), id="binary"),
    pytest.param(*_random_case(1, 7, 2), id="binary-small"),
    pytest.param(*_random_case(2, 60, 3), id="3-class"),
    pytest.param(*_random_case(3, 80, 5), id="5-class"),
    pytest.param(*_ties_case(4, 40, 2), id="binary-ties"),
    pytest.param(*_ties_case(5, 60, 3), id="3-class-ties"),
    pytest.param(*_never_predicted_case(6, 40, 2), id="binary-never-predicted"),
    pytest.param(*_never_predicted_case(7, 60, 4), id="4-class-never-predicted"),
]

# multi-class cases where some class of the probability columns is absent from y_true
ABSENT_CASES = [
    pytest.param(*_absent_class_case(8, 40, 3), id="3-class-absent"),
    pytest.param(*_absent_class_case(9, 60, 5), id="5-class-absent"),
]


def _sk_specificity(y: np.ndarray, pred: np.ndarray, c: int) -> float:
    if c == 2:
        cm = confusion_matrix(y, pred, labels=[0, 1])
        tn, fp = cm[0, 0], cm[0, 1]
        return tn / (tn + fp) if tn + fp else float("nan")
    cm = confusion_matrix(y, pred)  # labels: union of y and pred, as the macro averages use
    n = cm.sum()
    specs = []
    for k in range(cm.shape[0]):
        tp = cm[k, k]
        fp = cm[:, k].sum() - tp
        fn = cm[k, :].sum() - tp
        tn = n - tp - fp - fn
        if tn + fp:  # classes without negatives have no specificity and are left out
            specs.append(tn / (tn + fp))
    return float(np.mean(specs)) if specs else float("nan")


def _sk_auc(y: np.ndarray, p: np.ndarray) -> float:
    c = p.shape[1]
    if c == 2:
        return roc_auc_score(y, p[:, 1])
    present = np.unique(y)
    if len(present) == c:
        return roc_auc_score(y, p, multi_class="ovr", average="macro")
    return float(np.mean([roc_auc_score(y == k, p[:, k]) for k in present]))


def _sk_all(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    pred = p.argmax(axis=1)
    macro = {"average": "macro", "zero_division": 0}
    recall = recall_score(y, pred, **macro)
    return {
        "accuracy": accuracy_score(y, pred),
        "precision": precision_score(y, pred, **macro),
        "recall": recall,
        "sensitivity": recall,
        "specificity": _sk_specificity(y, pred, p.shape[1]),
        "f1": f1_score(y, pred, **macro),
        "micro_f1": f1_score(y, pred, average="micro", zero_division=0),
        "auc": _sk_auc(y, p),
        "n": float(len(y)),
    }


@pytest.mark.parametrize(("y", "p"), CASES + ABSENT_CASES)
def test_matches_sklearn(y: np.ndarray, p: np.ndarray) -> None:
    got = classification_metrics(y, p)
    assert list(got) == KEYS
    assert all(isinstance(v, float) for v in got.values())
    expected = _sk_all(y, p)
    for key in KEYS:
        assert got[key] == pytest.approx(expected[key], abs=1e-12), key


@pytest.mark.parametrize(("y", "p"), CASES + ABSENT_CASES)
def test_individual_functions_agree(y: np.ndarray, p: np.ndarray) -> None:
    got = classification_metrics(y, p)
    for name, func in METRICS.items():
        assert func(y, p) == pytest.approx(got[name], abs=1e-12), name


def test_metrics_registry() -> None:
    assert set(METRICS) == set(KEYS) - {"n"}
    assert METRICS["accuracy"] is accuracy
    assert METRICS["precision"] is macro_precision
    assert METRICS["recall"] is METRICS["sensitivity"] is macro_recall
    assert METRICS["specificity"] is macro_specificity
    assert METRICS["f1"] is macro_f1
    assert METRICS["micro_f1"] is micro_f1
    assert METRICS["auc"] is roc_auc


def test_binary_specificity_is_recall_of_class_0() -> None:
    y, p = _random_case(10, 30, 2)
    pred = p.argmax(axis=1)
    expected = recall_score(y, pred, labels=[0], average=None, zero_division=0)[0]
    assert macro_specificity(y, p) == pytest.approx(expected)


def test_never_predicted_class_gets_zero_precision() -> None:
    y = np.array([0, 0, 1, 1, 2, 2])
    p = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.1, 0.9, 0.0],
                  [0.2, 0.8, 0.0], [0.6, 0.3, 0.1], [0.3, 0.6, 0.1]])
    # per-class precision: 2/3, 2/3, 0 (never predicted)
    assert macro_precision(y, p) == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)
    assert macro_recall(y, p) == pytest.approx((1 + 1 + 0) / 3)


def test_auc_ties_exact() -> None:
    # all scores tied -> 0.5; sklearn agrees
    y = np.array([0, 1, 0, 1, 1])
    p1 = np.full(5, 0.5)
    assert roc_auc(y, np.stack([1 - p1, p1], axis=1)) == 0.5
    # 1-D probabilities are class-1 probabilities
    s = np.array([0.1, 0.4, 0.4, 0.8, 0.4])
    assert roc_auc(y, s) == pytest.approx(roc_auc_score(y, s))


def test_single_class_auc_nan() -> None:
    y = np.zeros(6, dtype=int)
    p = _softmax(np.random.default_rng(0).normal(size=(6, 3)))
    out = classification_metrics(y, p)
    assert math.isnan(out["auc"]) and math.isnan(roc_auc(y, p))
    assert out["n"] == 6.0
    assert out["accuracy"] == pytest.approx(accuracy_score(y, p.argmax(1)))
    y2 = np.ones(4, dtype=int)
    p2 = np.tile([0.3, 0.7], (4, 1))
    out2 = classification_metrics(y2, p2)
    assert math.isnan(out2["auc"])
    assert out2["accuracy"] == 1.0 and out2["precision"] == 1.0
    assert math.isnan(out2["specificity"])  # no negatives: undefined, not 0


def test_empty_input() -> None:
    out = classification_metrics(np.zeros(0, dtype=int), np.zeros((0, 3)))
    assert list(out) == KEYS
    assert out["n"] == 0.0
    assert all(math.isnan(v) for k, v in out.items() if k != "n")
    for func in METRICS.values():
        assert math.isnan(func(np.zeros(0, dtype=int), np.zeros((0, 2))))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="samples"):
        classification_metrics(np.array([0, 1]), np.ones((3, 2)) / 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        classification_metrics(np.array([0, 2]), np.ones((2, 2)) / 2)
    with pytest.raises(ValueError, match="num_classes"):
        classification_metrics(np.array([0, 1]), np.ones((2, 2)) / 2, num_classes=3)
    with pytest.raises(ValueError, match="finite"):
        classification_metrics(np.array([0, 1]), np.array([[np.nan, 1.0], [0.5, 0.5]]))


# ------------------------------------------------------------------------------ summarize


def _table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "client_id": ["a", "b", "c", "a", "b", "c", "a", "b", "c"],
            "round": [1, 1, 1, 1, 1, 1, 2, 2, 2],
            "split": ["test", "test", "test", "val", "val", "val", "test", "test", "test"],
            "accuracy": [0.9, 0.6, 0.75, 0.5, 0.5, 0.8, 1.0, 0.8, 0.9],
            "auc": [0.8, float("nan"), 0.6, 0.7, 0.9, 0.5, 0.6, 0.6, 0.9],
            "loss": [0.1, 0.4, 0.3, 0.2, 0.2, 0.9, 0.0, 0.5, 0.1],
        }
    )


def test_summarize_hand_computed() -> None:
    out = summarize(_table(), ["accuracy", "auc"], ["round", "split"])
    assert list(out[["round", "split"]].itertuples(index=False, name=None)) == [
        (1, "test"), (1, "val"), (2, "test"),
    ]
    expected_cols = ["round", "split", "n_clients"]
    for m in ["accuracy", "auc"]:
        expected_cols += [f"{m}_mean", f"{m}_std", f"{m}_worst", f"{m}_best", f"{m}_worst_client"]
    assert list(out.columns) == expected_cols
    r = out.iloc[0]  # round 1, test: accuracy 0.9, 0.6, 0.75; auc 0.8, NaN, 0.6
    assert r["n_clients"] == 3
    assert r["accuracy_mean"] == pytest.approx(0.75)
    # population std: sqrt(((0.15)^2 + (0.15)^2 + 0) / 3) = sqrt(0.015)
    assert r["accuracy_std"] == pytest.approx(math.sqrt(0.015))
    assert r["accuracy_worst"] == pytest.approx(0.6) and r["accuracy_best"] == pytest.approx(0.9)
    assert r["accuracy_worst_client"] == "b"
    assert r["auc_mean"] == pytest.approx(0.7)  # NaN skipped
    assert r["auc_std"] == pytest.approx(0.1)
    assert r["auc_worst"] == pytest.approx(0.6) and r["auc_worst_client"] == "c"
    r = out.iloc[1]  # round 1, val: accuracy 0.5, 0.5, 0.8 -> tie for worst: first row
    assert r["accuracy_mean"] == pytest.approx(0.6)
    assert r["accuracy_std"] == pytest.approx(math.sqrt((0.01 + 0.01 + 0.04) / 3))
    assert r["accuracy_worst_client"] == "a"
    assert r["auc_worst_client"] == "c" and r["auc_best"] == pytest.approx(0.9)
    r = out.iloc[2]  # round 2, test
    assert r["accuracy_mean"] == pytest.approx(0.9)
    assert r["accuracy_std"] == pytest.approx(math.sqrt(0.02 / 3))
    assert r["accuracy_worst_client"] == "b" and r["accuracy_best"] == pytest.approx(1.0)


def test_summarize_lower_is_better_and_no_groups() -> None:
    out = summarize(_table(), ["loss"], [], lower_is_better=["loss"])
    assert len(out) == 1 and out.loc[0, "n_clients"] == 9
    assert out.loc[0, "loss_worst"] == pytest.approx(0.9)
    assert out.loc[0, "loss_worst_client"] == "c"
    assert out.loc[0, "loss_best"] == pytest.approx(0.0)
    assert out.loc[0, "loss_std"] == pytest.approx(np.std(_table()["loss"].to_numpy()))


def test_summarize_all_nan_and_missing_column() -> None:
    t = _table()
    t["auc"] = float("nan")
    out = summarize(t, ["auc"], ["round"])
    assert out["auc_mean"].isna().all() and out["auc_worst_client"].isna().all()
    with pytest.raises(ValueError, match="f1"):
        summarize(t, ["f1"], ["round"])
    with pytest.raises(ValueError, match="client_id"):
        summarize(t.drop(columns="client_id"), ["auc"], ["round"])
