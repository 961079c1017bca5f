"""FedSDC's models (paper 002, sec. 2.2): the heads of diverse width, their shuffle among the
clients, and the ensemble that votes at test time."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from medfl.method import derive_seed
from medfl.models.outputs import ProbabilityModel
from medfl.seeding import round_half_up
from medfl.training import autocast

__all__ = ["HeadEnsemble", "BodyHead", "make_head", "head_widths", "head_assignment", "kept_heads", "vote_counts",
           "tied", "ensemble_probabilities", "labels_and_logits", "VOTES", "TIE_BREAKS", "HEADS",
           "HEAD_ACTIVATIONS", "KEEP_ROUNDINGS", "RHO_SAMPLINGS", "PAPER_EMBED_DIM", "DEFAULT_MIN_HIDDEN"]

VOTES = ("majority", "mean")
#: how a tied majority vote is decided: the tied class with the highest mean softmax
#: probability over the heads, the lowest tied class index, or (the authors' code) the
#: argmax of the heads' summed logits over all classes
TIE_BREAKS = ("mean_probability", "lowest", "logit_sum")
HEADS = ("mlp", "linear")
HEAD_ACTIVATIONS = ("relu", "none")
KEEP_ROUNDINGS = ("floor", "round", "ceil")
RHO_SAMPLINGS = ("uniform", "stratified")
#: the embedding of the paper's body (ResNet-50): its heads are rho x 2048 = 819-2048 units wide
PAPER_EMBED_DIM = 2048
#: medfl's default ``min_hidden``: rho scales at least the paper's 2048 units (ResNet-50's
#: embedding), so every body gets the paper's head widths (docs/plugins.md has the measurement)
DEFAULT_MIN_HIDDEN = PAPER_EMBED_DIM


def make_head(embed_dim: int, hidden: int, num_classes: int, dropout: float, kind: str = "mlp",
              activation: str = "relu") -> nn.Sequential:
    """A FedSDC head (section 2.2).

    Args:
        embed_dim: length of the body's embedding.
        hidden: width of the first FC layer (``kind="mlp"``; ignored for ``"linear"``).
        num_classes: number of classes K.
        dropout: dropout rate between the two FC layers (``"mlp"``).
        kind: ``"mlp"``: ``Linear(embed_dim, hidden) -> act -> Dropout -> Linear(hidden, K)``
            (the paper's two FC layers with dropout between them); ``"linear"``:
            ``Linear(embed_dim, K)`` (no hidden layer, no dropout).
        activation: ``"relu"`` or ``"none"`` (an identity: the authors' code has no
            activation between the layers); the state's keys are the same either way.

    Returns:
        The head as an ``nn.Sequential`` mapping ``(B, embed_dim)`` to logits ``(B, K)``.
    """
    if kind == "linear":
        return nn.Sequential(nn.Linear(embed_dim, num_classes))
    act: nn.Module = nn.ReLU() if activation == "relu" else nn.Identity()
    return nn.Sequential(nn.Linear(embed_dim, hidden), act, nn.Dropout(dropout), nn.Linear(hidden, num_classes))


def head_widths(n: int, embed_dim: int, seed: int, rho_min: float, rho_max: float, diversity: bool, *,
                min_hidden: int | None = None, sampling: str = "uniform") -> list[int]:
    """Each head's first-layer width ``round(rho_i * base)`` with ``base = max(embed_dim,
    min_hidden)`` (Diversity); ``base`` for every head (rho = 1) without ``diversity``.

    Args:
        n: number of heads.
        embed_dim: length of the body's embedding (the paper: 2048).
        seed: run seed; head ``i`` draws its rho from ``derive_seed(seed, "rho", i)``.
        rho_min, rho_max: the compression factor's range (the paper: [0.4, 1]).
        diversity: draw rho per head (else every head is ``base`` wide).
        min_hidden: the least width rho scales (``None``: the embedding's, the paper's
            rule); a body narrower than it gets heads ``rho_min`` to ``rho_max`` times
            ``min_hidden`` wide instead of heads of a few units.
        sampling: ``"uniform"``: ``rho_i ~ U[rho_min, rho_max]`` independently;
            ``"stratified"`` (the authors' code): ``rho_i ~ U`` on the i-th of ``n`` equal
            parts of the range, so the widths spread over the whole range.

    Returns:
        ``n`` widths, each at least 1.
    """
    base = max(int(embed_dim), int(min_hidden or 0))
    step = (rho_max - rho_min) / max(n, 1)

    def rho(i: int) -> float:
        lo, hi = (rho_min + i * step, rho_min + (i + 1) * step) if sampling == "stratified" else (rho_min, rho_max)
        return float(np.random.default_rng(derive_seed(seed, "rho", i)).uniform(lo, hi)) if diversity else 1.0

    return [max(1, int(round(rho(i) * base))) for i in range(n)]


def head_assignment(client_ids: list[str], seed: int, round: int, shuffle: bool) -> dict[str, int]:
    """Eq. 6: which head each client trains in ``round``: a permutation seeded by (seed,
    round) when ``shuffle``, else client ``i`` keeps head ``i``."""
    n = len(client_ids)
    order = np.random.default_rng(derive_seed(seed, "heads", round)).permutation(n) if shuffle else np.arange(n)
    return {cid: int(order[i]) for i, cid in enumerate(client_ids)}


def kept_heads(gamma: float, n: int, rounding: str = "ceil") -> int:
    """FedSDC+'s number of kept heads: ``gamma * n`` rounded down, half up or up, at least 1
    and at most ``n``."""
    x = float(gamma) * n
    k = math.floor(x + 1e-9) if rounding == "floor" else round_half_up(x) if rounding == "round" else math.ceil(x - 1e-9)
    return min(n, max(1, int(k)))


def vote_counts(logits: torch.Tensor) -> torch.Tensor:
    """How many heads vote for each class: ``(B, K)`` counts from the heads' logits
    ``(H, B, K)`` (each head votes for its softmax's argmax)."""
    probs = torch.softmax(logits.float(), dim=2)
    return nn.functional.one_hot(probs.argmax(2), probs.shape[2]).to(probs.dtype).sum(0)


def tied(counts: torch.Tensor) -> torch.Tensor:
    """``(B,)``: whether the most votes are shared by two or more classes."""
    return (counts == counts.max(dim=1, keepdim=True).values).sum(1) > 1


def ensemble_probabilities(logits: torch.Tensor, vote: str = "majority",
                           tie_break: str = "mean_probability") -> torch.Tensor:
    """The ensemble's class probabilities ``(B, K)`` from its heads' logits ``(H, B, K)``.

    ``vote="mean"``: the mean of the heads' softmaxes. ``vote="majority"``: the vote
    fractions ``f`` (the fraction of heads whose argmax is each class), with the tie rule
    encoded so that the row's argmax is the decided vote and every row sums to 1:

    * ``"lowest"``: ``f`` itself (``argmax`` picks the lowest tied index);
    * ``"mean_probability"``: ``(1 - w) f + w m`` with ``m`` the mean softmax and
      ``w = 1 / (2 (H + 1))``: two vote counts differ by ``1/H`` in ``f``, more than
      ``w / (1 - w) < 1/H`` can move them, so the vote order stands and a tie goes to the
      tied class of highest mean probability (AUC then ranks samples by votes, then by mean
      probability);
    * ``"logit_sum"``: ``f`` where the vote is not tied, ``softmax(sum of logits)`` where
      it is (the authors' code: a tie goes to the argmax of the summed logits over all
      classes, tied or not).
    """
    probs = torch.softmax(logits.float(), dim=2)
    if vote == "mean":
        return probs.mean(0)
    h = probs.shape[0]
    counts = vote_counts(logits)
    frac = counts / h
    if tie_break == "lowest":
        return frac
    if tie_break == "mean_probability":
        w = 1.0 / (2.0 * (h + 1))
        return (1.0 - w) * frac + w * probs.mean(0)
    return torch.where(tied(counts)[:, None], torch.softmax(logits.float().sum(0), dim=1), frac)


class BodyHead(nn.Module):
    """The body (a FeatureModel; its own head unused) followed by one FedSDC head."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body, self.sdc_head = body, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the head on the body's embedding."""
        return self.sdc_head(self.body.embed(x))


class HeadEnsemble(ProbabilityModel):
    """Test time (section 2.2): the body's embedding through every head, combined by
    :func:`ensemble_probabilities` (``vote`` ``"majority"`` with ``tie_break``, or ``"mean"``)."""

    def __init__(self, body: nn.Module, heads: list[nn.Module], vote: str, tie_break: str = "mean_probability") -> None:
        super().__init__()
        self.body, self.heads, self.vote, self.tie_break = body, nn.ModuleList(heads), vote, tie_break

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's logits on the body's embedding of ``x``: ``(H, B, K)``."""
        z = self.body.embed(x)
        return torch.stack([h(z) for h in self.heads])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``(B, K)`` (rows sum to 1; the argmax is the ensemble's decision)."""
        return ensemble_probabilities(self.head_logits(x), self.vote, self.tie_break)


def labels_and_logits(ens: HeadEnsemble, loader: "DataLoader", device: str) -> tuple[np.ndarray, torch.Tensor]:
    """Labels ``(N,)`` and every head's logits ``(H, N, K)`` (CPU, float32) over ``loader``,
    the body run once per batch."""
    ys, outs = [], []
    with torch.no_grad():
        for x, y in loader:
            with autocast():
                out = ens.head_logits(x.to(device, non_blocking=True))
            outs.append(out.float().cpu())
            ys.append(torch.as_tensor(y))
    if not ys:
        return np.zeros(0, dtype=np.int64), torch.zeros(len(ens.heads), 0, 0)
    return torch.cat(ys).numpy(), torch.cat(outs, dim=1)
