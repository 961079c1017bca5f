"""How an evaluation model tells the engine what its outputs are.

The engine scores a client's evaluation model (``Method.client_eval_model``) from class
probabilities. By default a model returns logits ``(B, K)`` and the engine applies a softmax.
A model that computes probabilities itself (an ensemble's mean of softmaxes, the vote
fractions of a majority vote) says so with the attribute ``returns_probabilities = True``;
:class:`ProbabilityModel` is a base class that sets it, and :func:`as_probabilities` turns
a model's outputs into probabilities either way, checking what a probability model returns.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ProbabilityModel", "returns_probabilities", "as_probabilities"]


class ProbabilityModel(nn.Module):
    """Base class of evaluation modules whose ``forward`` returns class probabilities
    ``(B, K)`` (non-negative rows summing to 1), not logits."""

    returns_probabilities: bool = True


def returns_probabilities(model: nn.Module) -> bool:
    """Whether ``model`` declares that it returns probabilities rather than logits."""
    return bool(getattr(model, "returns_probabilities", False))


def as_probabilities(model: nn.Module, outputs: Tensor, *, atol: float = 1e-3) -> Tensor:
    """Class probabilities ``(B, K)`` (float32) from ``model``'s ``outputs`` on one batch.

    Logits go through a softmax; a probability model's outputs are checked and passed on.

    Raises:
        ValueError: a probability model returned something that is not a probability
            vector per row (negative, non-finite, or rows not summing to 1 within ``atol``).
    """
    if outputs.ndim != 2:
        raise ValueError(f"{type(model).__name__}: an evaluation model must return a (batch, classes) tensor, "
                         f"got shape {tuple(outputs.shape)}")
    if not returns_probabilities(model):
        return torch.softmax(outputs.float(), dim=1)
    p = outputs.float()
    sums = p.sum(dim=1)
    if len(p) and (not torch.isfinite(p).all() or (p < 0).any() or (sums - 1).abs().max() > atol):
        raise ValueError(f"{type(model).__name__} declares returns_probabilities, but its outputs are not "
                         f"probabilities (min {float(p.min()):.4g}, row sums {float(sums.min()):.4g}.."
                         f"{float(sums.max()):.4g}); return softmax-like rows, or drop returns_probabilities "
                         "and return logits")
    return p
