"""Local training and evaluation helpers shared by method plugins."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = [
    "NonFiniteError",
    "coordinate_median",
    "trimmed_mean",
    "make_optimizer",
    "train_epochs",
    "with_regularizer",
    "predict_proba",
    "get_state",
    "weighted_average",
    "state_fingerprint",
]

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Regularizer = Callable[[nn.Module], torch.Tensor]


def make_optimizer(params: Iterable[torch.nn.Parameter], train: dict[str, Any]) -> torch.optim.Optimizer:
    """Build the local optimizer named by ``train["optimizer"]`` (``sgd``, ``adam``, ``adamw``).

    Defaults, when ``train`` does not say: ``sgd`` with ``lr`` 0.01, ``momentum`` 0.9 and
    ``weight_decay`` 0 (Adam/AdamW: ``lr`` 0.01, ``weight_decay`` 0, torch's betas).

    Raises:
        ValueError: an unknown optimizer name.
    """
    name = str(train.get("optimizer", "sgd")).lower()
    lr = float(train.get("lr", 0.01))
    wd = float(train.get("weight_decay", 0.0))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(train.get("momentum", 0.9)), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    raise ValueError(f"train.optimizer: unknown optimizer {name!r}; valid: sgd, adam, adamw")


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def with_regularizer(loss_fn: LossFn | None, regularizer: Regularizer | None) -> LossFn | None:
    """The local loss plus a data-independent term, for plain (non-DP) training.

    What it is for: :meth:`medfl.engine.hub.HubAndSpoke.local_regularizer` (FedProx's proximal
    term) in :func:`train_epochs`; DP-SGD instead adds the term's gradient after clipping and
    noise (:func:`medfl.privacy.dp_sgd.train_epochs_dp`).

    Args:
        loss_fn: ``loss_fn(model, x, y) -> loss``; ``None`` means cross-entropy of ``model(x)``.
        regularizer: ``regularizer(model) -> scalar tensor``, or ``None``.

    Returns:
        ``loss_fn`` itself (``None`` stays ``None``) when there is no regularizer; otherwise
        ``f(model, x, y) = loss_fn(model, x, y) + regularizer(model)``, the loss computed
        first.
    """
    if regularizer is None:
        return loss_fn
    base = loss_fn or _ce

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return base(model, x, y) + regularizer(model)

    return loss


def train_epochs(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    epochs: int = 1,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    clip_grad_norm: float | None = None,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Train ``model`` for ``epochs`` passes over ``loader``.

    Batches without a sample (Opacus's Poisson sampling draws them) are skipped, and so
    are batches of one sample when the model has BatchNorm (it cannot train on them):
    neither runs the loss nor steps the optimizer, so neither turns the loss into NaN.

    Args:
        loss_fn: ``loss_fn(model, x, y) -> loss``; default cross-entropy of ``model(x)``.
        clip_grad_norm: clip the global gradient norm to this value when given.
        max_steps: stop after this many optimizer steps when given.

    Returns:
        ``{"loss": mean training loss over the samples trained on (0 when none),
        "steps": optimizer steps}``.
    """
    model.to(device).train()
    loss_fn = loss_fn or _ce
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    total, count, steps = 0.0, 0, 0
    for _ in range(epochs):
        for x, y in loader:
            if x.shape[0] == 0 or (x.shape[0] < 2 and has_bn):
                continue  # nothing to learn from; BatchNorm cannot train on a batch of one
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteError(f"the training loss became {value} at optimizer step {steps + 1}; lower "
                                     "train.lr or set train.clip_grad_norm")
            loss.backward()
            if clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            optimizer.step()
            total += value * x.shape[0]
            count += x.shape[0]
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return {"loss": total / max(count, 1), "steps": float(steps)}
    return {"loss": total / max(count, 1), "steps": float(steps)}


class NonFiniteError(ValueError):
    """Training produced a NaN or infinite loss or weights: the run stops, naming the client
    and round (:func:`medfl.engine.client.run_client_update` adds them)."""


@torch.no_grad()
def predict_proba(model: nn.Module, loader: DataLoader, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Return ``(labels (N,), class probabilities (N, K))`` of ``model`` over ``loader``.

    The model's outputs are logits, turned into probabilities with a softmax, unless the
    model declares ``returns_probabilities`` (:func:`medfl.models.as_probabilities`)."""
    from medfl.models.outputs import as_probabilities

    model.to(device).eval()
    ys, ps = [], []
    for x, y in loader:
        ps.append(as_probabilities(model, model(x.to(device))).cpu())
        ys.append(torch.as_tensor(y))
    if not ys:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
    return torch.cat(ys).numpy(), torch.cat(ps).numpy()


def get_state(model: nn.Module, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s state dict (only ``keys`` when given)."""
    state = model.state_dict()
    wanted = set(keys) if keys is not None else None
    return {k: v.detach().cpu().clone() for k, v in state.items() if wanted is None or k in wanted}


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts with the same keys.

    Floating tensors are averaged in float64 and cast back; integer tensors (BatchNorm's
    ``num_batches_tracked``) take the weighted average rounded to the nearest integer.

    Raises:
        ValueError: no states, mismatched keys, or weights that do not sum to a positive number.
    """
    if not states:
        raise ValueError("weighted_average: no states to average")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(states),) or w.sum() <= 0 or (w < 0).any():
        raise ValueError(f"weighted_average: need {len(states)} non-negative weights with a positive sum, got {weights}")
    w = w / w.sum()
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys:
            raise ValueError("weighted_average: state dicts have different keys")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        acc = sum(float(wi) * s[k].double() for wi, s in zip(w, states))
        ref = states[0][k]
        out[k] = acc.round().to(ref.dtype) if not ref.is_floating_point() else acc.to(ref.dtype)
    return out


def coordinate_median(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median of state dicts (Yin et al., ICML 2018), unweighted: with an
    even count the mean of the two middle values for floating tensors, the lower one for
    integer tensors (a value some client sent). Tolerates fewer than half the clients sending
    arbitrary values.

    Raises:
        ValueError: no states, or mismatched keys.
    """
    return _coordinatewise(states, 0.0, "coordinate_median")


def trimmed_mean(states: list[dict[str, torch.Tensor]], trim: float) -> dict[str, torch.Tensor]:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): drop the ``floor(trim * n)``
    largest and smallest values of each coordinate and average the rest (float64), unweighted;
    integer tensors round. ``trim`` in [0, 0.5); 0 is the plain mean.

    Raises:
        ValueError: no states, mismatched keys, or ``trim`` outside [0, 0.5).
    """
    if not 0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean: trim must be in [0, 0.5), got {trim}")
    return _coordinatewise(states, trim, "trimmed_mean")


def _coordinatewise(states: list[dict[str, torch.Tensor]], trim: float, what: str) -> dict[str, torch.Tensor]:
    if not states:
        raise ValueError(f"{what}: no states to aggregate")
    keys = list(states[0])
    if any(list(s) != keys for s in states[1:]):
        raise ValueError(f"{what}: state dicts have different keys")
    n = len(states)
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ref = states[0][k]
        stacked = torch.stack([s[k] for s in states]).double().sort(dim=0).values
        if what == "coordinate_median":
            if n % 2 or not ref.is_floating_point():
                agg = stacked[(n - 1) // 2]
            else:
                agg = (stacked[n // 2 - 1] + stacked[n // 2]) / 2
        else:
            cut = int(math.floor(trim * n))
            agg = stacked[cut:n - cut].mean(dim=0)
        out[k] = agg.to(ref.dtype) if ref.is_floating_point() else agg.round().to(ref.dtype)
    return out


def state_fingerprint(model: nn.Module) -> str:
    """A hash of a model's state (to reuse evaluation of identical models)."""
    import hashlib

    h = hashlib.sha1()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
