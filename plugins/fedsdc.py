"""FedSDC and FedSDC+ (paper 002): a shared body aggregated with FedAvgM, N heads of diverse
width shuffled among the clients every round, and an ensemble of the heads at test time.

The method is :class:`FedSDC`; its docstring gives the equations, the ablation switches and
the choices the paper leaves open.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from medfl import hookimpl
from medfl.engine.training import get_state, make_optimizer, predict_proba, train_epochs, weighted_average
from medfl.messages import Instruction, Reply
from medfl.method import Federation, Method, MethodConfigError, derive_seed
from medfl.metrics.classification import micro_f1
from medfl.models.outputs import ProbabilityModel
from medfl.models.registry import build_model

if TYPE_CHECKING:  # pragma: no cover
    from medfl.context import ClientContext

__all__ = ["FedSDC", "HeadEnsemble", "make_head", "head_widths", "head_assignment", "register_methods"]

State = dict[str, torch.Tensor]
VOTES = ("majority", "mean")


def make_head(embed_dim: int, hidden: int, num_classes: int, dropout: float) -> nn.Sequential:
    """A FedSDC head: ``Linear(embed_dim, hidden) -> ReLU -> Dropout -> Linear(hidden, K)``."""
    return nn.Sequential(nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes))


def head_widths(n: int, embed_dim: int, seed: int, rho_min: float, rho_max: float, diversity: bool) -> list[int]:
    """Each head's first-layer width ``round(rho_i * embed_dim)``, ``rho_i ~ U[rho_min, rho_max]``
    seeded per head (``diversity``), else ``embed_dim`` for every head (rho = 1)."""
    out = []
    for i in range(n):
        rho = float(np.random.default_rng(derive_seed(seed, "rho", i)).uniform(rho_min, rho_max)) if diversity else 1.0
        out.append(max(1, int(round(rho * embed_dim))))
    return out


def head_assignment(client_ids: list[str], seed: int, round: int, shuffle: bool) -> dict[str, int]:
    """Eq. 6: which head each client trains in ``round``: a permutation seeded by (seed,
    round) when ``shuffle``, else client ``i`` keeps head ``i``."""
    n = len(client_ids)
    order = np.random.default_rng(derive_seed(seed, "heads", round)).permutation(n) if shuffle else np.arange(n)
    return {cid: int(order[i]) for i, cid in enumerate(client_ids)}


class _BodyHead(nn.Module):
    """The body (a FeatureModel; its own head unused) followed by one FedSDC head."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.sdc_head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the head on the body's embedding."""
        return self.sdc_head(self.body.embed(x))


class HeadEnsemble(ProbabilityModel):
    """Test time (section 2.2): the body's embedding through every head; ``majority``: the
    fraction of heads voting for each class (the argmax of the fractions breaks a tie by the
    lower class index), ``mean``: the mean of the heads' softmaxes (what AUC is best computed
    from)."""

    def __init__(self, body: nn.Module, heads: list[nn.Module], vote: str) -> None:
        super().__init__()
        self.body = body
        self.heads = nn.ModuleList(heads)
        self.vote = vote

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``(B, K)``: vote fractions or mean probabilities."""
        z = self.body.embed(x)
        probs = torch.stack([torch.softmax(h(z), dim=1) for h in self.heads])
        if self.vote == "mean":
            return probs.mean(0)
        votes = nn.functional.one_hot(probs.argmax(2), probs.shape[2]).to(probs.dtype)
        return votes.mean(0)


class FedSDC(Method):
    """FedSDC (Gao et al.; paper 002) and, with ``gamma``, FedSDC+.

    Each client's model is the shared body (``fl.model``: any registered FeatureModel; the
    paper's ResNet-50) and one of N heads (N = number of clients): a two-layer FC network with
    dropout between the layers, the first layer ``round(rho_i * embed_dim)`` wide,
    ``rho_i ~ U[rho_min, rho_max]`` seeded per head (Diversity). Round t:

    * eq. 6-7: the coordinator assigns the heads to the clients by a seeded permutation
      (Shuffle; without it client i always trains head i) and sends body + head;
    * eq. 8: the client trains both with cross-entropy (``fl.train``'s optimizer; SGD in the
      paper) and returns them;
    * eqs. 4-5: the bodies are averaged with weights |D_i| / sum |D_j| and stepped with server
      momentum by the existing ``fedavgm`` (:class:`medfl_plugins.baselines.FedAvgM`, beta 0.5,
      server learning rate 1); each returned head replaces the head it was sent as.

    Test time: the body feeds every head (or FedSDC+'s top-gamma heads); ``vote="majority"``
    returns the fraction of heads voting for each class (ties: the lower class index wins the
    argmax), ``"mean"`` the mean probabilities. Every client is evaluated with that ensemble.

    FedSDC+ (``gamma`` in (0, 1]): after each round's training, the validation exchange sends
    the body and every head to every client, which returns one micro-F1 per head on its own
    ``val`` split (scalars only; a client without validation data returns NaN and is left
    out); the coordinator keeps the ``ceil(gamma * N)`` heads of best mean micro-F1 (ties: the
    lower head index). The paper scores heads "on the target dataset"; we use the clients'
    validation splits, so no test data chooses the ensemble.

    Ablations (the paper's Table 2): ``diversity=False`` (every head ``embed_dim`` wide),
    ``shuffle=False`` (each client keeps its head).

    Args:
        beta: FedAvgM's momentum (paper 0.5).
        server_lr: FedAvgM's server learning rate.
        rho_min, rho_max: the compression factor's range (paper [0.4, 1]).
        dropout: dropout between the head's layers (the paper gives no rate).
        diversity, shuffle: the ablation switches.
        vote: ``"majority"`` or ``"mean"``.
        gamma: FedSDC+'s fraction of heads kept (paper 0.3); ``None``: FedSDC (all heads).
    """

    name = "fedsdc"
    description = "FedSDC: shared body with FedAvgM, shuffled heads of diverse width, ensemble vote (+ top-gamma heads)"
    reply_state = {"body": "body", "head": "head"}

    def __init__(self, beta: float = 0.5, server_lr: float = 1.0, rho_min: float = 0.4, rho_max: float = 1.0,
                 dropout: float = 0.5, diversity: bool = True, shuffle: bool = True, vote: str = "majority",
                 gamma: float | None = None) -> None:
        if not 0 < rho_min <= rho_max <= 1:
            raise MethodConfigError(f"fedsdc: need 0 < rho_min <= rho_max <= 1, got {rho_min}, {rho_max}")
        if vote not in VOTES:
            raise MethodConfigError(f"fedsdc: vote must be one of {', '.join(VOTES)}, got {vote!r}")
        if gamma is not None and not 0 < float(gamma) <= 1:
            raise MethodConfigError(f"fedsdc: gamma must be in (0, 1] or null, got {gamma!r}")
        if not 0 <= dropout < 1:
            raise MethodConfigError(f"fedsdc: dropout must be in [0, 1), got {dropout}")
        from medfl_plugins.baselines import FedAvgM

        self._avgm = FedAvgM(beta=beta, server_lr=server_lr)
        self.beta, self.server_lr = float(beta), float(server_lr)
        self.rho_min, self.rho_max, self.dropout = float(rho_min), float(rho_max), float(dropout)
        self.diversity, self.shuffle, self.vote = bool(diversity), bool(shuffle), vote
        self.gamma = None if gamma is None else float(gamma)

    # ------------------------------------------------------------------ shared
    @staticmethod
    def _checked_body(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
        """``model`` if it can serve as the body (a FeatureModel: ``embed``, ``embed_dim``,
        ``head_keys``)."""
        for attr in ("embed", "embed_dim", "head_keys"):
            if not hasattr(model, attr):
                raise MethodConfigError(f"fedsdc: {spec.get('name')!r} has no {attr}: the body must be a registered "
                                        "FeatureModel (resnet*, small_cnn, two_block_cnn...)")
        return model

    @staticmethod
    def _body_keys(model: nn.Module) -> list[str]:
        own_head = set(model.head_keys())
        return [k for k in model.state_dict() if k not in own_head]

    def _full(self, spec: dict[str, Any], body: State, heads: list[State], widths: list[int],
              seed: int) -> tuple[nn.Module, list[nn.Module]]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self._checked_body(build_model(dict(spec)), spec)
            built = [make_head(int(model.embed_dim), w, int(spec["num_classes"]), self.dropout) for w in widths]
        model.load_state_dict({**model.state_dict(), **body})
        for h, s in zip(built, heads):
            h.load_state_dict(s)
        return model, built

    # ------------------------------------------------------------------ coordinator
    def setup(self, federation: Federation) -> None:
        """The body from the run seed, N heads of seeded widths."""
        super().setup(federation)
        model = self._checked_body(federation.build_model(), federation.model_spec())
        keys = self._body_keys(model)
        full = get_state(model)
        self.body = {k: full[k] for k in keys}
        params = {n for n, _ in model.named_parameters()}
        self._avgm.param_keys = [k for k in keys if k in params]
        self._avgm.velocity = {}
        n = len(federation.client_ids)
        self.widths = head_widths(n, int(model.embed_dim), federation.seed, self.rho_min, self.rho_max, self.diversity)
        self.heads = []
        for i, w in enumerate(self.widths):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(federation.seed, "head", i))
                self.heads.append(get_state(make_head(int(model.embed_dim), w, federation.num_classes, self.dropout)))
        self.chosen = list(range(n))
        self.val_means: list[float] = []

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Body and the shuffled head (eqs. 6-7) to each sampled client."""
        assign = head_assignment(self.federation.client_ids, self.federation.seed, round, self.shuffle)
        return {cid: Instruction(payload={"body": self.body, "head": self.heads[assign[cid]]},
                                 config={"width": self.widths[assign[cid]], "head_index": assign[cid]})
                for cid in self.federation.sample(round)}

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """FedAvgM on the bodies (eqs. 4-5); each head back in its slot."""
        if not replies:
            return
        assign = head_assignment(self.federation.client_ids, self.federation.seed, round, self.shuffle)
        weights = [float(r.num_examples) for r in replies.values()]
        avg = weighted_average([r.payload["body"] for r in replies.values()], weights)
        self.body = self._avgm.server_step(round, self.body, avg)
        for cid, r in replies.items():
            self.heads[assign[cid]] = r.payload["head"]

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """FedSDC+: every head to every client, to score on its ``val`` split."""
        if self.gamma is None:
            return {}
        ins = Instruction(payload={"body": self.body, "heads": self.heads}, config={"widths": json.dumps(self.widths)})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Keep the ``ceil(gamma * N)`` heads of best mean validation micro-F1."""
        n = len(self.heads)
        means = []
        for i in range(n):
            vals = [float(r[f"micro_f1_{i}"]) for r in results.values()
                    if math.isfinite(float(r.get(f"micro_f1_{i}", math.nan)))]
            means.append(sum(vals) / len(vals) if vals else -1.0)
        keep = max(1, math.ceil(float(self.gamma) * n))
        self.chosen = sorted(sorted(range(n), key=lambda i: (-means[i], i))[:keep])
        self.val_means = means

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """The body and the ensemble's heads (all, or FedSDC+'s chosen)."""
        ins = Instruction(payload={"body": self.body, "heads": [self.heads[i] for i in self.chosen]},
                          config={"widths": json.dumps([self.widths[i] for i in self.chosen])})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def report(self) -> dict[str, Any]:
        """Head widths, the heads in the ensemble and (FedSDC+) their validation micro-F1."""
        return {"head_widths": list(self.widths), "ensemble_heads": list(self.chosen),
                **({"validation_micro_f1": list(self.val_means)} if self.val_means else {})}

    def state_dict(self) -> dict[str, Any]:
        """Body, heads, FedAvgM's velocity, the chosen heads."""
        return {"body": self.body, "heads": {str(i): h for i, h in enumerate(self.heads)},
                "velocity": self._avgm.velocity, "chosen": json.dumps(self.chosen),
                "val_means": json.dumps(self.val_means)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.body = dict(state["body"])
        self.heads = [dict(state["heads"][str(i)]) for i in range(len(state["heads"]))]
        self._avgm.velocity = dict(state["velocity"])
        self.chosen = [int(i) for i in json.loads(state["chosen"])]
        self.val_means = [float(v) for v in json.loads(state["val_means"])]

    # ------------------------------------------------------------------ client
    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Eq. 8: cross-entropy on body and head; reply with both."""
        width = int(instruction.config["width"])
        body, (head,) = self._full(client.model_spec, instruction.payload["body"], [instruction.payload["head"]],
                                   [width], derive_seed(client.seed, "model"))
        net = _BodyHead(body, head).to(client.device)
        params = [p for n, p in net.named_parameters() if not n.startswith("body." + body_head_prefix(body))]
        opt = make_optimizer(params, client.train)
        stats = train_epochs(net, client.loader("train"), opt, int(client.train.get("epochs", 1)), device=client.device,
                             clip_grad_norm=client.train.get("clip_grad_norm"))
        full = get_state(body)
        keys = self._body_keys(body)
        return Reply(payload={"body": {k: full[k] for k in keys}, "head": get_state(head)}, metrics=stats,
                     num_examples=client.num_examples("train"))

    def _ensemble(self, client: "ClientContext", instruction: Instruction) -> HeadEnsemble:
        widths = [int(w) for w in json.loads(str(instruction.config["widths"]))]
        body, heads = self._full(client.model_spec, instruction.payload["body"], list(instruction.payload["heads"]),
                                 widths, derive_seed(client.seed, "model"))
        return HeadEnsemble(body, heads, self.vote).to(client.device).eval()

    def client_validate(self, client: "ClientContext", instruction: Instruction) -> dict[str, float]:
        """FedSDC+: each head's micro-F1 on this client's ``val`` split (NaN without one)."""
        ens = self._ensemble(client, instruction)
        loader = client.loader("val", shuffle=False)
        out = {}
        for i, head in enumerate(ens.heads):
            y, p = predict_proba(_BodyHead(ens.body, head), loader, client.device)
            out[f"micro_f1_{i}"] = float(micro_f1(y, p)) if len(y) else math.nan
        return out

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The body with the ensemble's heads (vote fractions or mean probabilities)."""
        return self._ensemble(client, instruction)


def body_head_prefix(model: nn.Module) -> str:
    """The body model's own (unused) head prefix, e.g. ``"head."``."""
    return str(getattr(model, "head_prefix", "head."))


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register FedSDC."""
    register(FedSDC)
