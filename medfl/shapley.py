"""Shapley values for PFedCDP's post-hoc refinement (paper 000, section III-D, eqs. 16 and 19).

Two different Shapley quantities appear in the refinement stage:

* **Teacher contributions.** The teachers (one prototype per cluster) are the players of a
  cooperative game whose value ``v(S)`` is the score of the ensemble of the teachers in ``S``
  on class-balanced public samples (:func:`ensemble_game`, :func:`balanced_subset`). Their
  exact Shapley values (:func:`shapley_values`) become ensemble weights
  (:func:`teacher_weights`) for :func:`medfl.losses.distill.ensemble_logits`.
* **Feature importance.** ``psi^(k)`` (eq. 16) is the mean absolute SHAP value of each input
  feature for teacher ``k`` (:func:`feature_importance`, via the optional ``shap`` package's
  ``GradientExplainer``, i.e. expected gradients); the teachers' maps are averaged
  (:func:`mean_importance`) and turned into per-feature weights with mean 1
  (:func:`importance_weights`) for eq. 19.

The value of the empty coalition is the score of a predictor with no information: it outputs
uniform probabilities (all-zero logits) with ties broken uniformly at random, so its expected
accuracy and balanced accuracy are ``1/K`` and its AUC is ``0.5``. The same tie rule applies
to every coalition (a sample whose ensemble logits tie between ``m`` classes including the
true one counts ``1/m`` correct), so the empty coalition is simply the ensemble of no teacher.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from medfl.metrics.classification import roc_auc

__all__ = [
    "MAX_PLAYERS",
    "SCORES",
    "shapley_values",
    "ensemble_game",
    "balanced_subset",
    "teacher_weights",
    "feature_importance",
    "mean_importance",
    "importance_weights",
]

#: The largest game :func:`shapley_values` enumerates exactly (``2^12 = 4096`` coalitions).
MAX_PLAYERS = 12

#: The scores :func:`ensemble_game` can use as the coalition value.
SCORES = ("accuracy", "balanced_accuracy", "auc")


# ------------------------------------------------------------------------------------ the game

def shapley_values(n_players: int, value: Callable[[frozenset[int]], float]) -> list[float]:
    """Exact Shapley values of an ``n_players`` game by enumerating every coalition.

    ``phi_i = sum_{S not containing i} |S|! (n - |S| - 1)! / n! * (v(S + {i}) - v(S))``.
    ``value`` is called exactly once per coalition (``2^n`` calls, the results are cached).

    Args:
        n_players: number of players ``n`` (players are ``0 .. n-1``), at most
            :data:`MAX_PLAYERS`.
        value: the characteristic function, called with a ``frozenset`` of player indices.

    Returns:
        ``[phi_0, ..., phi_{n-1}]``; they sum to ``v(all) - v(empty)`` (efficiency).

    Raises:
        ValueError: ``n_players`` negative or above :data:`MAX_PLAYERS` (exact enumeration
            needs ``2^n`` evaluations), or ``value`` returns a non-finite number.
    """
    n = int(n_players)
    if n != n_players or n < 0:
        raise ValueError(f"n_players must be a non-negative integer, got {n_players!r}")
    if n > MAX_PLAYERS:
        raise ValueError(f"exact Shapley values need 2^n coalition evaluations; n_players={n} is "
                         f"above the limit of {MAX_PLAYERS} (2^{n} = {2 ** n} evaluations)")
    if n == 0:
        return []
    values: list[float] = []
    for mask in range(1 << n):  # every coalition once, as a bit mask
        coalition = frozenset(i for i in range(n) if mask >> i & 1)
        v = float(value(coalition))
        if not math.isfinite(v):
            raise ValueError(f"value({sorted(coalition)}) = {v} is not finite")
        values.append(v)
    fact = [math.factorial(s) for s in range(n + 1)]
    coef = [fact[s] * fact[n - s - 1] / fact[n] for s in range(n)]  # by |S|, S without i
    phi = [0.0] * n
    for mask in range(1 << n):
        size = bin(mask).count("1")
        for i in range(n):
            if not mask >> i & 1:
                phi[i] += coef[size] * (values[mask | 1 << i] - values[mask])
    return phi


def _as_numpy(x: Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def _credit(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-sample expected correctness of the argmax with ties broken uniformly at random."""
    tied = logits == logits.max(axis=1, keepdims=True)
    return tied[np.arange(len(labels)), labels] / tied.sum(axis=1)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ensemble_game(
    teacher_logits: Sequence[Tensor | np.ndarray],
    labels: Tensor | np.ndarray | Sequence[int],
    score: str = "accuracy",
    num_classes: int | None = None,
) -> Callable[[frozenset[int]], float]:
    """The teacher game: ``v(S)`` = score of the ensemble of the teachers in ``S``.

    The ensemble of ``S`` predicts with the mean of its members' logits. Scores:

    * ``"accuracy"``: fraction of samples whose argmax is the label;
    * ``"balanced_accuracy"``: mean over the classes present in ``labels`` of their recall;
    * ``"auc"``: ROC AUC of the softmax of the mean logits, by the rank (Mann-Whitney)
      formula; binary: AUC of class 1; more classes: mean one-vs-rest AUC over the classes
      that have both positive and negative samples.

    The empty coalition is the ensemble of no teacher: all-zero logits, i.e. uniform
    probabilities. Argmax ties are broken uniformly at random in expectation (a sample tied
    between ``m`` classes including its label counts ``1/m``) and tied scores get average
    ranks, so ``v(empty) = 1/K`` for accuracy and balanced accuracy and ``0.5`` for AUC.

    Args:
        teacher_logits: each teacher's logits ``(N, K)`` on the same ``N`` samples.
        labels: ``(N,)`` integer labels in ``[0, K)``.
        score: one of :data:`SCORES` (default ``"accuracy"``).
        num_classes: ``K``; inferred from the logits when ``None`` (required when there is no
            teacher), checked against them otherwise.

    Returns:
        ``v``, a function of a ``frozenset`` of teacher indices, for :func:`shapley_values`.

    Raises:
        ValueError: unknown score, inconsistent shapes or class counts, labels out of range,
            no sample, or an AUC that is undefined (binary labels of one class only).
    """
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; valid: {', '.join(SCORES)}")
    y = _as_numpy(labels).astype(np.int64).reshape(-1)
    zs = [_as_numpy(z).astype(np.float64) for z in teacher_logits]
    if num_classes is None:
        if not zs:
            raise ValueError("num_classes is needed when there is no teacher")
        num_classes = int(zs[0].shape[-1])
    k = int(num_classes)
    if k < 2:
        raise ValueError(f"num_classes must be at least 2, got {k}")
    n = len(y)
    if n == 0:
        raise ValueError("ensemble_game needs at least one sample")
    for i, z in enumerate(zs):
        if z.shape != (n, k):
            raise ValueError(f"teacher {i}'s logits have shape {z.shape}, expected ({n}, {k})")
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"labels must lie in [0, {k}), got range [{y.min()}, {y.max()}]")
    present = np.unique(y)
    auc_classes: list[int] = []
    if score == "auc":
        auc_classes = [1] if k == 2 else [int(c) for c in present if (y != c).any()]
        if (k == 2 and len(present) < 2) or not auc_classes:
            raise ValueError("AUC is undefined: the samples hold a single class")

    def value(coalition: frozenset[int]) -> float:
        members = sorted(coalition)
        bad = [m for m in members if not 0 <= m < len(zs)]
        if bad:
            raise ValueError(f"no teacher {bad} among {len(zs)} teachers")
        mean = (np.mean([zs[m] for m in members], axis=0) if members
                else np.zeros((n, k), dtype=np.float64))
        if score == "accuracy":
            return float(_credit(mean, y).mean())
        if score == "balanced_accuracy":
            credit = _credit(mean, y)
            return float(np.mean([credit[y == c].mean() for c in present]))
        prob = _softmax(mean)
        return float(np.mean([roc_auc(y == c, prob[:, c]) for c in auc_classes]))

    return value


def balanced_subset(labels: Tensor | np.ndarray | Sequence[int], per_class: int | None,
                    seed: int) -> np.ndarray:
    """Indices of a class-balanced subset of ``labels``, the samples the games are played on.

    Every class present gets the same number of samples, ``min(per_class, smallest class
    count)`` (``per_class=None``: the smallest class count), drawn without replacement with
    ``numpy.random.default_rng(seed)``.

    Args:
        labels: ``(N,)`` integer labels.
        per_class: samples wanted per class (``>= 1``), or ``None`` for as many as possible.
        seed: random seed.

    Returns:
        Sorted ``int64`` indices into ``labels``.

    Raises:
        ValueError: ``per_class < 1``.
    """
    y = _as_numpy(labels).reshape(-1)
    if per_class is not None and int(per_class) < 1:
        raise ValueError(f"per_class must be at least 1 (or None), got {per_class!r}")
    if len(y) == 0:
        return np.zeros(0, dtype=np.int64)
    classes, counts = np.unique(y, return_counts=True)
    m = int(counts.min()) if per_class is None else min(int(per_class), int(counts.min()))
    rng = np.random.default_rng(seed)
    picked = [rng.choice(np.flatnonzero(y == c), size=m, replace=False) for c in classes]
    return np.sort(np.concatenate(picked)).astype(np.int64)


def teacher_weights(values: Sequence[float]) -> list[float]:
    """Ensemble weights from the teachers' Shapley values.

    Negative values (teachers that lower the ensemble's score on average) are clipped to 0 and
    the rest normalised to sum to 1. When no value is positive, no teacher helps by the game's
    measure and there is nothing to rank them by, so the weights fall back to the paper's
    plain uniform ensemble ``1/K`` rather than an undefined ``0/0``.

    Args:
        values: one Shapley value per teacher.

    Returns:
        Non-negative weights summing to 1.

    Raises:
        ValueError: no value, or a non-finite one.
    """
    v = [float(x) for x in values]
    if not v:
        raise ValueError("teacher_weights needs at least one value")
    if not all(math.isfinite(x) for x in v):
        raise ValueError(f"Shapley values must be finite, got {v}")
    clipped = [max(x, 0.0) for x in v]
    total = sum(clipped)
    if total <= 0.0:
        return [1.0 / len(v)] * len(v)
    return [x / total for x in clipped]


# --------------------------------------------------------------------------- feature importance

def feature_importance(model: nn.Module, background: Tensor, samples: Tensor, *,
                       batch_size: int | None = None, nsamples: int = 200,
                       seed: int = 0) -> np.ndarray:
    """One teacher's feature importance ``psi^(k)`` (eq. 16) with ``shap.GradientExplainer``.

    Expected-gradients SHAP values of every output class are computed for each of
    ``samples``, against ``background``; their absolute values are averaged over samples and
    classes. The model is put in evaluation mode for the computation and its training flags
    and parameter gradients are restored afterwards. The global torch and numpy random states
    are left untouched (the explainer's sampling runs on ``seed`` inside a forked state).

    shap 0.45+ returns one array ``(N, *input_shape, K)`` for a single-input model (``K = 1``
    included); older versions returned a list of ``K`` arrays ``(N, *input_shape)``. Both are
    accepted.

    Args:
        model: a classifier mapping ``(N, C, H, W[, D])`` to logits ``(N, K)``.
        background: reference inputs ``(M, C, H, W[, D])`` (e.g. public training images).
        samples: inputs to explain ``(N, C, H, W[, D])`` (e.g. a class-balanced subset).
        batch_size: the explainer's batch size (``None``: shap's default, 50).
        nsamples: gradient samples per explained input (shap's default, 200).
        seed: seed of the explainer's sampling of background rows and interpolation points.

    Returns:
        ``psi`` of shape ``(C, H, W[, D])``, non-negative, float64.

    Raises:
        ImportError: ``shap`` is not installed.
        ValueError: background and samples of different per-sample shapes, or an unexpected
            shape of shap's output.
    """
    try:
        import shap
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("feature_importance needs the optional 'shap' package: "
                          "pip install shap") from err
    if tuple(background.shape[1:]) != tuple(samples.shape[1:]):
        raise ValueError(f"background {tuple(background.shape)} and samples "
                         f"{tuple(samples.shape)} differ in per-sample shape")
    param = next(model.parameters(), None)
    device = param.device if param is not None else samples.device
    background = background.detach().to(device).clone()
    samples = samples.detach().to(device).clone()
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda: list[int] = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    np_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            np.random.seed(seed)
            model.eval()
            kwargs = {} if batch_size is None else {"batch_size": int(batch_size)}
            with torch.enable_grad():
                explainer = shap.GradientExplainer(model, background, **kwargs)
                values = explainer.shap_values(samples, nsamples=int(nsamples), rseed=seed)
    finally:
        np.random.set_state(np_state)
        for m, mode in modes:
            m.training = mode
        for p, g in grads:
            p.grad = g
    shape = tuple(samples.shape)
    if isinstance(values, list):  # shap < 0.45: one array per output class
        arr = np.stack([np.asarray(v) for v in values], axis=-1)
    else:
        arr = np.asarray(values)
        if arr.ndim == len(shape):  # a single output without a class axis
            arr = arr[..., None]
    if arr.shape[:-1] != shape:
        raise ValueError(f"unexpected SHAP values of shape {arr.shape} for inputs {shape}")
    return np.abs(arr.astype(np.float64)).mean(axis=(0, arr.ndim - 1))


def mean_importance(psis: Sequence[np.ndarray]) -> np.ndarray:
    """The ensemble's feature importance ``psi = 1/K sum_k psi^(k)`` (eq. 16).

    Args:
        psis: the teachers' importance maps, all of the same shape.

    Returns:
        Their element-wise mean (float64).

    Raises:
        ValueError: no map, or shapes differ.
    """
    if len(psis) == 0:
        raise ValueError("mean_importance needs at least one importance map")
    arrays = [np.asarray(p, dtype=np.float64) for p in psis]
    for k, a in enumerate(arrays):
        if a.shape != arrays[0].shape:
            raise ValueError(f"importance map {k} has shape {a.shape}, map 0 {arrays[0].shape}")
    return np.mean(arrays, axis=0)


def importance_weights(psi: np.ndarray, floor: float = 0.1) -> np.ndarray:
    """Per-input-feature multiplicative weights with mean 1 from an importance map ``psi``.

    ``w = floor + (1 - floor) * psi / mean(psi)``: the weights are non-negative, their mean is
    1 (so applying them keeps the loss on its unweighted scale), they are proportional to the
    importance above the floor, and a feature with no importance keeps weight ``floor`` (it is
    damped, not removed). An all-zero ``psi`` carries no information and gives all ones.

    eq. 19 as printed multiplies a scalar loss by ``psi_i`` and averages over features, which
    reduces to ``mean(psi) * L``; with these weights that factor is exactly 1, so the weights
    only matter where they are applied per feature (e.g. to the inputs).

    Args:
        psi: non-negative importance map (e.g. ``(C, H, W[, D])`` from
            :func:`mean_importance`).
        floor: the weight of a feature with zero importance, in ``[0, 1]`` (default 0.1).

    Returns:
        Weights of ``psi``'s shape (float64).

    Raises:
        ValueError: ``floor`` outside ``[0, 1]``, or ``psi`` empty, negative or not finite.
    """
    f = float(floor)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor!r}")
    p = np.asarray(psi, dtype=np.float64)
    if p.size == 0:
        raise ValueError("importance_weights needs a non-empty importance map")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("importance map must be finite and non-negative")
    mean = p.mean()
    if mean <= 0.0:
        return np.ones_like(p)
    return f + (1.0 - f) * p / mean
