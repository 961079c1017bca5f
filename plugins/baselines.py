"""Baseline methods: Centralized, Local, FedAvg, FedProx, FedAvgM, FedBN, the adaptive server
optimizers FedAdam, FedYogi and FedAdagrad (one implementation), and FedDisco."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from medfl import hookimpl
from medfl.hub import HubAndSpoke, norm_keys
from medfl.training import coordinate_median, get_state, make_optimizer, train_epochs, trimmed_mean
from medfl.messages import Instruction, Reply
from medfl.method import ClientContext, Method

__all__ = ["Centralized", "Local", "FedAvg", "FedProx", "FedAvgM", "FedBN", "FedAdam", "FedYogi", "FedAdagrad",
           "FedDisco", "HeldModel", "disco_discrepancy", "disco_weights"]

State = dict[str, torch.Tensor]


class _OwnModel(Method):
    """A model kept in the client's persistent state and trained there."""

    def _own_model(self, client: "ClientContext") -> nn.Module:
        model = client.build_model()
        if "model" in client.state:
            model.load_state_dict(client.state["model"])
        return model

    def _train_own(self, client: "ClientContext") -> tuple[nn.Module, dict[str, float]]:
        model = self._own_model(client)
        opt = make_optimizer(model.parameters(), client.train)
        stats = train_epochs(model, client.loader("train"), opt, int(client.train.get("epochs", 1)),
                             device=client.device, clip_grad_norm=client.train.get("clip_grad_norm"))
        client.state["model"] = get_state(model)
        return model, stats


class HeldModel(Method):
    """A method whose coordinator holds one model (``model_state``): each reply's ``model``
    replaces it, and every client evaluates it."""

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Keep the model replied (a missing reply: keep the one held)."""
        for reply in replies.values():
            self.model_state = reply.payload["model"]

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Every client evaluates the held model."""
        ins = Instruction(payload={"model": self.model_state})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The held model."""
        return client.load_model(instruction.payload["model"])

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the held model."""
        return {"model": self.model_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the held model."""
        self.model_state = state["model"]


class Local(_OwnModel):
    """Local training only: every client trains its own model; nothing is communicated.

    Each client's model is initialised from a seed of (run seed, client id), lives in its
    persistent state, and is what that client is evaluated with. Replies carry metrics only.
    """

    name = "local"
    description = "Local training only, no communication (lower reference)"

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Train the client's own model for ``epochs``."""
        _, stats = self._train_own(client)
        return Reply(metrics=stats, num_examples=client.num_examples("train"))

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The client's own model."""
        return self._own_model(client)


class Centralized(_OwnModel, HeldModel):
    """Centralized training on the pooled data of every client (upper reference).

    Not a federated method: the engine pools every client's training split into one
    ``pooled`` client (``pools_data``). One round is ``epochs`` passes over the pooled data;
    every client then evaluates the pooled model on its own test split. In-process only.
    """

    name = "centralized"
    description = "Centralized training on pooled data (upper reference, not federated)"
    pools_data = True
    reply_state = {"model": None}   # quantization applies; nothing is an update of what was sent

    def setup(self, federation: Any) -> None:
        """Start without a model: the pooled client builds it."""
        super().setup(federation)
        self.model_state: State = {}

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Train on the pooled data and send the model for evaluation."""
        model, stats = self._train_own(client)
        return Reply(payload={"model": get_state(model)}, metrics=stats,
                     num_examples=client.num_examples("train"))


class FedAvg(HubAndSpoke):
    """FedAvg (McMahan et al., AISTATS 2017): average of local models weighted by sample count.

    Args:
        aggregation: ``"mean"`` (FedAvg's weighted mean, the default), or a robust,
            unweighted rule for federations where some sites may send arbitrary models (Yin et
            al., ICML 2018): ``"median"`` (coordinate-wise median) or ``"trimmed_mean"``
            (coordinate-wise mean without the ``trim`` fraction of largest and smallest values).
        trim: the fraction trimmed at each end by ``"trimmed_mean"`` (0.1), in [0, 0.5).

    With ``"mean"`` it takes ``fl.secure_aggregation`` (the coordinator sees only the weighted
    mean); the robust rules need every client's model and refuse it.
    """

    name = "fedavg"
    description = "Federated averaging weighted by local sample counts (robust median / trimmed mean optional)"

    def __init__(self, aggregation: str = "mean", trim: float = 0.1) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"fedavg: aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
        if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim < 0.5:
            raise ValueError(f"fedavg: trim must be a number in [0, 0.5), got {trim!r}")
        self.aggregation, self.trim = aggregation, float(trim)
        self.secure_aggregation = aggregation == "mean"

    def aggregate(self, states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
        """The weighted mean, or the robust rule ``aggregation`` names (weights unused)."""
        if self.aggregation == "median":
            return coordinate_median(states)
        if self.aggregation == "trimmed_mean":
            return trimmed_mean(states, self.trim)
        return super().aggregate(states, weights)


#: FedAvg's aggregation rules
AGGREGATIONS = ("mean", "median", "trimmed_mean")


class FedProx(HubAndSpoke):
    """FedProx (Li et al., MLSys 2020): FedAvg with a proximal term on the local loss.

    Local loss: ``CE + mu / 2 * ||w - w_global||^2`` over all parameters; the proximal term
    is :meth:`local_regularizer`. Under DP-SGD (``train.dp``) only the cross-entropy goes
    through per-sample clipping and noise; the proximal term's gradient, which does not
    depend on the data, is added to the noised gradient before each step (post-processing,
    no privacy cost).

    Args:
        mu: proximal coefficient (default 0.01).
    """

    name = "fedprox"
    description = "FedAvg with a proximal term mu/2 ||w - w_global||^2"
    secure_aggregation = True

    def __init__(self, mu: float = 0.01) -> None:
        if mu < 0:
            raise ValueError(f"fedprox: mu must be >= 0, got {mu}")
        self.mu = float(mu)

    def local_regularizer(self, client: "ClientContext", model: nn.Module, instruction: Instruction
                          ) -> Callable[[nn.Module], torch.Tensor]:
        """The proximal term ``mu / 2 * sum_p ||p - p_global||^2`` to the received weights.

        The anchors follow ``model.parameters()``'s order and are matched by position, so the
        term works on the model or on a wrapper of it (Opacus's) whose names differ."""
        anchor = [p.detach().clone() for p in model.parameters()]
        mu = self.mu

        def proximal(m: nn.Module) -> torch.Tensor:
            params = list(m.parameters())
            if len(params) != len(anchor):
                raise ValueError(f"fedprox: the model has {len(params)} parameters, the proximal "
                                 f"anchor {len(anchor)}")
            prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            return 0.5 * mu * prox

        return proximal


class FedAvgM(HubAndSpoke):
    """FedAvgM (Hsu et al., 2019): FedAvg with server momentum.

    With ``delta = w_old - avg(w_k)``: ``v <- beta * v + delta``; ``w <- w_old - server_lr * v``
    for parameters; buffers (BatchNorm statistics) take the plain average.

    Args:
        beta: server momentum (default 0.9).
        server_lr: server learning rate (default 1.0).
    """

    name = "fedavgm"
    description = "FedAvg with server momentum (beta)"
    secure_aggregation = True

    def __init__(self, beta: float = 0.9, server_lr: float = 1.0) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"fedavgm: beta must be in [0, 1), got {beta}")
        self.beta, self.server_lr = float(beta), float(server_lr)
        self.velocity: State = {}

    def server_step(self, round: int, old: State, aggregated: State) -> State:
        """Apply momentum to the pseudo-gradient of the parameters."""
        new = dict(aggregated)
        for k in self.param_keys:
            if k not in old:
                continue
            delta = old[k] - aggregated[k]
            v = self.beta * self.velocity.get(k, torch.zeros_like(delta)) + delta
            self.velocity[k] = v
            new[k] = old[k] - self.server_lr * v
        return new

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: global model and momentum."""
        return {"global": self.global_state, "velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore global model and momentum."""
        self.global_state, self.velocity = state["global"], state["velocity"]


class FedAdam(HubAndSpoke):
    """FedAdam (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2).

    With ``delta = avg(w_k) - w_old``: ``m <- b1 m + (1 - b1) delta``;
    ``v <- b2 v + (1 - b2) delta^2``; ``w <- w_old + eta * m / (sqrt(v) + tau)``, without
    bias correction as in the paper. Buffers (BatchNorm statistics) take the plain average.
    FedYogi and FedAdagrad (:class:`FedYogi`, :class:`FedAdagrad`) are this class with another
    second-moment update (:meth:`second_moment`). ``v`` starts at 0 (Algorithm 2 allows any
    ``v_-1 >= tau^2``; with 0 the first step is ``eta * m / (|m| / sqrt(1 - b2) + tau)``-like,
    bounded by ``tau``).

    Args:
        eta: server learning rate (default 0.01).
        beta1: first-moment decay (default 0.9).
        beta2: second-moment decay (default 0.99; FedAdagrad does not use it).
        tau: adaptivity (default 1e-3).
    """

    name = "fedadam"
    description = "FedAvg with an Adam server optimizer"
    secure_aggregation = True

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Adam's ``v <- b2 v + (1 - b2) delta^2``."""
        return self.beta2 * v + (1 - self.beta2) * delta**2

    def __init__(self, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        if eta <= 0 or tau <= 0:
            raise ValueError(f"fedadam: eta and tau must be > 0, got eta={eta}, tau={tau}")
        self.eta, self.beta1, self.beta2, self.tau = float(eta), float(beta1), float(beta2), float(tau)
        self.m: State = {}
        self.v: State = {}

    def server_step(self, round: int, old: State, aggregated: State) -> State:
        """One adaptive step on the pseudo-gradient of the parameters."""
        new = dict(aggregated)
        for k in self.param_keys:
            if k not in old:
                continue
            delta = aggregated[k] - old[k]
            m = self.beta1 * self.m.get(k, torch.zeros_like(delta)) + (1 - self.beta1) * delta
            v = self.second_moment(self.v.get(k, torch.zeros_like(delta)), delta)
            self.m[k], self.v[k] = m, v
            new[k] = old[k] + self.eta * m / (v.sqrt() + self.tau)
        return new

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: global model and both moments."""
        return {"global": self.global_state, "m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore global model and both moments."""
        self.global_state, self.m, self.v = state["global"], state["m"], state["v"]


class FedYogi(FedAdam):
    """FedYogi (Reddi et al., ICLR 2021, Algorithm 2): FedAdam with Yogi's second moment,
    ``v <- v - (1 - b2) delta^2 sign(v - delta^2)``, which grows ``v`` additively and keeps
    it from shrinking as fast as Adam's when updates get small. Same parameters as FedAdam."""

    name = "fedyogi"
    description = "FedAvg with a Yogi server optimizer"

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Yogi's ``v - (1 - b2) delta^2 sign(v - delta^2)``."""
        d2 = delta**2
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)


class FedAdagrad(FedAdam):
    """FedAdagrad (Reddi et al., ICLR 2021, Algorithm 2): FedAdam with Adagrad's second moment,
    ``v <- v + delta^2`` (``beta2`` unused). Same parameters as FedAdam."""

    name = "fedadagrad"
    description = "FedAvg with an Adagrad server optimizer"

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Adagrad's ``v + delta^2``."""
        return v + delta**2


def disco_discrepancy(hist: Any, metric: str = "l2") -> float:
    """FedDisco's discrepancy ``d_k`` between a client's label distribution and the uniform
    one (the balanced target distribution FedDisco assumes): the L2 distance of the
    normalised histogram from ``1/K`` (``metric="l2"``) or ``KL(uniform || local)`` with a
    1e-12 floor (``"kl"``). An empty histogram gives the uniform's distance 0."""
    h = torch.as_tensor(hist, dtype=torch.float64).reshape(-1)
    if h.numel() == 0 or float(h.sum()) <= 0:
        return 0.0
    p = h / h.sum()
    u = torch.full_like(p, 1.0 / p.numel())
    if metric == "l2":
        return float(torch.linalg.vector_norm(p - u))
    if metric == "kl":
        return float((u * (u.log() - p.clamp_min(1e-12).log())).sum())
    raise ValueError(f"feddisco: metric must be 'l2' or 'kl', got {metric!r}")


def disco_weights(sizes: list[float], discrepancies: list[float], a: float = 0.5, b: float = 0.1) -> list[float]:
    """FedDisco's aggregation weights (Ye et al., ICML 2023, eq. 5): ``p_k ∝ ReLU(n_k - a d_k
    + b)`` with ``n_k`` the client's share of the samples; normalised to sum 1. If every
    term is 0, the weights fall back to the sample shares (FedAvg)."""
    total = float(sum(sizes))
    shares = [float(n) / total if total > 0 else 1.0 / len(sizes) for n in sizes]
    raw = [max(0.0, n - a * d + b) for n, d in zip(shares, discrepancies)]
    if sum(raw) <= 0:
        return shares
    return [r / sum(raw) for r in raw]


class FedDisco(HubAndSpoke):
    """FedDisco (Ye et al., ICML 2023, "Discrepancy-Aware Collaboration"): FedAvg whose
    aggregation weights are ``ReLU(n_k - a d_k + b)``, normalised (:func:`disco_weights`):
    dataset share ``n_k`` and discrepancy ``d_k`` between the client's label distribution and
    the global one, so clients whose labels are skewed count less.

    What leaves a client: the model and one scalar, ``d_k``. FedDisco's global distribution is
    the uniform one (the balanced test distribution it targets), so each client computes
    ``d_k`` from its own label histogram (:func:`disco_discrepancy`) and the histogram itself
    never leaves it: ``d_k`` alone says how far from balanced the client is, not which classes
    it holds. (A global target estimated from every client's histogram would need the
    histograms at the coordinator; we do not offer it.) ``d_k`` is not covered by a reply
    filter's noise (the run lists it under ``not_covered``), like FedKPer's score.

    Args:
        a: the discrepancy's weight (FedDisco's default 0.5).
        b: the offset (default 0.1).
        metric: ``"l2"`` (FedDisco's default) or ``"kl"``.
    """

    name = "feddisco"
    description = "FedAvg weighted by dataset share and label-distribution discrepancy (FedDisco)"

    def __init__(self, a: float = 0.5, b: float = 0.1, metric: str = "l2") -> None:
        if metric not in ("l2", "kl"):
            raise ValueError(f"feddisco: metric must be 'l2' or 'kl', got {metric!r}")
        if a < 0:
            raise ValueError(f"feddisco: a must be >= 0, got {a}")
        self.a, self.b, self.metric = float(a), float(b), str(metric)

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """FedAvg's local training; the reply adds ``discrepancy`` (one scalar)."""
        reply = super().client_update(client, instruction)
        hist = client.label_histogram(int(client.model_spec["num_classes"]))
        reply.payload["discrepancy"] = disco_discrepancy(hist, self.metric)
        return reply

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """FedAvg's ``model`` and the ``discrepancy``."""
        return super().reply_keys(instruction) | {"discrepancy"}

    def client_weights(self, replies: dict[str, Reply]) -> list[float]:
        """Eq. 5's weights from ``num_examples`` and each reply's ``discrepancy``."""
        sizes = [float(r.num_examples) for r in replies.values()]
        d = [float(r.payload.get("discrepancy", 0.0)) for r in replies.values()]
        return disco_weights(sizes, d, self.a, self.b)


class FedBN(HubAndSpoke):
    """FedBN (Li et al., ICLR 2021): FedAvg that keeps every normalisation layer local.

    The weights, biases and running statistics of BatchNorm (and other norm) layers never
    leave the client; each client is evaluated with the global model plus its own norm layers.
    """

    name = "fedbn"
    description = "FedAvg with client-local BatchNorm layers"
    secure_aggregation = True

    def local_keys(self, model: nn.Module) -> set[str]:
        """Keys of normalisation layers stay local."""
        return norm_keys(model)


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register the baseline methods."""
    for cls in (Centralized, Local, FedAvg, FedProx, FedAvgM, FedBN, FedAdam, FedYogi, FedAdagrad, FedDisco):
        register(cls)
