"""FedSDC and FedSDC+ (paper 002): a shared body aggregated with FedAvgM, N heads of diverse
width shuffled among the clients every round, and an ensemble of the heads at test time.

:class:`FedSDC` reads as the paper's Algorithm 1; its parts are in ``models`` (heads, shuffle,
vote), ``presets`` (each value cited) and ``mechanisms`` (what the heads and the vote did)."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import torch
from torch import nn

from medfl import hookimpl
from medfl.messages import Instruction, Reply
from medfl.method import ClientContext, Federation, Method, MethodConfigError, derive_seed
from medfl.metrics.classification import micro_f1
from medfl.models.registry import build_model
from medfl.training import get_state, make_optimizer, train_epochs, weighted_average
from medfl_plugins.baselines import FedAvgM
from medfl_plugins.common import read

from .mechanisms import Mechanisms, vote_record
from .models import (DEFAULT_MIN_HIDDEN, HEAD_ACTIVATIONS, HEADS, KEEP_ROUNDINGS, RHO_SAMPLINGS, TIE_BREAKS, VOTES,
                     BodyHead, HeadEnsemble, head_assignment, head_widths, kept_heads, labels_and_logits, make_head)
from .presets import PRESETS

__all__ = ["FedSDC", "register_methods"]


class FedSDC(Mechanisms, Method):
    """FedSDC (Gao et al., paper 002, sec. 2.2, Algorithm 1) and, with ``gamma``, FedSDC+.

    Each client's model m_i is the shared body phi (``fl.model``: any registered FeatureModel;
    the paper's ResNet-50) followed by one of N heads h_i (N = number of clients): two FC
    layers with dropout between them (``head="mlp"``), the first ``round(rho_i * base)`` wide,
    ``rho_i ~ U[rho_min, rho_max]`` seeded per head (Diversity), ``base`` the embedding's
    length or ``min_hidden`` if larger. Round t, as Algorithm 1:

    * :meth:`configure_round`, eqs. 6-7: the heads go to the clients by a seeded permutation
      (Shuffle; without it client i always trains head i), each with the body;
    * :meth:`client_update`, eq. 8: the client trains both with cross-entropy and returns them;
    * :meth:`server_update`, eqs. 3-5: the bodies are averaged with weights |D_i| / sum |D_j|
      and stepped by the ``fedavgm`` baseline's own ``server_step`` (beta 0.5, server
      learning rate 1); each returned head replaces the head it was sent as;
    * the validation exchange (:meth:`configure_validate`, :meth:`client_validate`,
      :meth:`server_validate`): each evaluated client scores every head and the ensemble's
      vote on its own ``val`` split and returns only scalars (:mod:`.mechanisms`). FedSDC+
      (``gamma`` in (0, 1]) keeps the ``kept_heads(gamma, N, keep_rounding)`` heads of best
      mean micro-F1 over the clients (ties: the lower head index).

    Test time (:meth:`client_eval_model`): the body and every head (FedSDC+: the kept ones) vote
    (``"majority"``: vote fractions, ``tie_break`` encoded so that the argmax is the decision,
    :func:`.models.ensemble_probabilities`) or average their probabilities (``"mean"``).

    Ablations (Table 2): ``diversity=False`` (every head ``base`` wide, rho = 1) and
    ``shuffle=False`` (each client keeps its head); the authors' code builds its heads without
    Diversity as one linear layer (``diversity=False, head="linear"``).

    Choices where the paper is silent, and deviations (measured in docs/plugins.md, FedSDC):

    * Head activation: ReLU between the head's layers (``head_activation``; the authors' code
      has none, so their head is affine at test time). Dropout: 0.5 (the authors' code 0.2).
    * Ties of the majority vote: to the tied class of highest mean probability
      (``tie_break="mean_probability"``; before issue 37 the lowest class index, ``"lowest"``,
      which biases a 2-head FedSDC+ towards class 0; the authors' code: ``"logit_sum"``).
    * Head widths: rho scales ``max(embed_dim, min_hidden)`` units (default 2048), so every
      body gets the paper's 819-2048-unit heads; on ResNet-50 nothing changes. Read literally
      (``min_hidden=None``), a 16-d small CNN gets heads of 6-16 units, which cannot learn
      (issue 37: 20 % micro-F1 against 85 % with 2048). A floor on the width itself would
      make a small body's heads equally wide and switch Diversity off unseen.
    * ``head="linear"``: one linear layer per head; Diversity has nothing to act on (warned).
    * FedSDC+ scores the heads on the clients' validation splits, not "on the target dataset"
      (no test data chooses the ensemble), and ranks them by the unweighted mean of the
      clients' micro-F1; the observables pool by val size.
    * N is the number of clients; with ``fl.fraction`` < 1 a round trains only the sampled
      clients' heads (the authors' code keeps ``int(N * fraction)`` heads: not reproduced).

    Args:
        beta: FedAvgM's momentum (paper 0.5).
        server_lr: FedAvgM's server learning rate.
        rho_min, rho_max: the compression factor's range (paper [0.4, 1]).
        dropout: dropout between the head's layers (the paper gives no rate).
        diversity, shuffle: the ablation switches.
        vote: ``"majority"`` or ``"mean"``.
        gamma: FedSDC+'s fraction of heads kept (paper 0.3); ``None``: FedSDC (all heads).
        tie_break: ``"mean_probability"`` (default), ``"lowest"`` or ``"logit_sum"``.
        head: ``"mlp"`` (default) or ``"linear"``.
        min_hidden: the least width rho scales (default 2048, the paper's); ``None``: the
            embedding's length (the paper's rule on a body narrower than ResNet-50).
        head_activation: ``"relu"`` (default) or ``"none"`` (``head="mlp"`` only).
        keep_rounding: FedSDC+'s rounding of ``gamma * N``: ``"ceil"`` (default),
            ``"round"``, ``"floor"``.
        rho_sampling: ``"uniform"`` (default) or ``"stratified"`` (the authors' code).
    """

    name = "fedsdc"
    description = "FedSDC: shared body with FedAvgM, shuffled heads of diverse width, ensemble vote (+ top-gamma heads)"
    reply_state = {"body": "body", "head": "head"}
    presets = PRESETS
    validate_metrics = frozenset({"n_val", "vote_ties", "vote_disagreements", "vote_correct"})

    def __init__(self, beta: float = 0.5, server_lr: float = 1.0, rho_min: float = 0.4, rho_max: float = 1.0,
                 dropout: float = 0.5, diversity: bool = True, shuffle: bool = True, vote: str = "majority",
                 gamma: float | None = None, tie_break: str = "mean_probability", head: str = "mlp",
                 min_hidden: int | None = DEFAULT_MIN_HIDDEN, head_activation: str = "relu",
                 keep_rounding: str = "ceil", rho_sampling: str = "uniform") -> None:
        if not 0 < rho_min <= rho_max <= 1:
            raise MethodConfigError(f"fedsdc: need 0 < rho_min <= rho_max <= 1, got {rho_min}, {rho_max}")
        read("fedsdc", "vote", vote, VOTES, quote=True)
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float))
                                  or not 0 < float(gamma) <= 1):
            raise MethodConfigError(f"fedsdc: gamma must be in (0, 1] or null, got {gamma!r}")
        if not 0 <= dropout < 1:
            raise MethodConfigError(f"fedsdc: dropout must be in [0, 1), got {dropout}")
        if min_hidden is not None and (isinstance(min_hidden, bool) or not isinstance(min_hidden, int)
                                       or min_hidden < 1):
            raise MethodConfigError(f"fedsdc: min_hidden must be a positive integer (units) or null, got {min_hidden!r}")
        self._avgm = FedAvgM(beta=beta, server_lr=server_lr)
        self.beta, self.server_lr = float(beta), float(server_lr)
        self.rho_min, self.rho_max, self.dropout = float(rho_min), float(rho_max), float(dropout)
        self.diversity, self.shuffle, self.vote = bool(diversity), bool(shuffle), vote
        self.gamma = None if gamma is None else float(gamma)
        self.tie_break = read("fedsdc", "tie_break", tie_break, TIE_BREAKS, quote=True)
        self.head = read("fedsdc", "head", head, HEADS, quote=True)
        self.min_hidden = min_hidden
        self.head_activation = read("fedsdc", "head_activation", head_activation, HEAD_ACTIVATIONS, quote=True)
        self.keep_rounding = read("fedsdc", "keep_rounding", keep_rounding, KEEP_ROUNDINGS, quote=True)
        self.rho_sampling = read("fedsdc", "rho_sampling", rho_sampling, RHO_SAMPLINGS, quote=True)

    # ------------------------------------------------------------------ Algorithm 1
    def setup(self, federation: Federation) -> None:
        """Initialise phi^1 (the body, from the run seed) and h^1 (N heads of seeded widths)."""
        super().setup(federation)
        model = self._checked_body(federation.build_model(), federation.model_spec())
        keys = self._body_keys(model)
        self.body = get_state(model, keys)
        params = {n for n, _ in model.named_parameters()}
        self._avgm.param_keys = [k for k in keys if k in params]
        self._avgm.velocity = {}
        n = len(federation.client_ids)
        self.embed_dim = int(model.embed_dim)
        self.widths = [0] * n if self.head == "linear" else head_widths(   # linear: no hidden layer
            n, self.embed_dim, federation.seed, self.rho_min, self.rho_max, self.diversity,
            min_hidden=self.min_hidden, sampling=self.rho_sampling)
        self.heads = []
        for i, w in enumerate(self.widths):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(federation.seed, "head", i))
                self.heads.append(get_state(self._make_head(self.embed_dim, w, federation.num_classes)))
        self.chosen = list(range(n))
        self.val_means: list[float] = []
        self._load_records()

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Eqs. 6-7: the body and the head the Shuffle gives it to each sampled client."""
        assign = head_assignment(self.federation.client_ids, self.federation.seed, round, self.shuffle)
        return {cid: Instruction(payload={"body": self.body, "head": self.heads[assign[cid]]},
                                 config={"width": self.widths[assign[cid]], "head_index": assign[cid]})
                for cid in self.federation.sample(round)}

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """ClientUpdate, eq. 8: cross-entropy on body and head (``fl.train``'s optimizer; SGD in
        the paper); reply with both."""
        width = int(instruction.config["width"])
        body, (head,) = self._full(client, instruction.payload["body"], [instruction.payload["head"]], [width])
        net = BodyHead(body, head).to(client.device)
        own_head = set(body.head_keys())   # the body model's own head is not trained
        params = [p for n, p in net.named_parameters() if n.removeprefix("body.") not in own_head]
        opt = make_optimizer(params, client.train)
        stats = train_epochs(net, client.loader("train"), opt, int(client.train.get("epochs", 1)), device=client.device,
                             clip_grad_norm=client.train.get("clip_grad_norm"))
        return Reply(payload={"body": get_state(body, self._body_keys(body)), "head": get_state(head)},
                     metrics=stats, num_examples=client.num_examples("train"))

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Eqs. 3-5: FedAvgM on the returned bodies (weights |D_i|); each head back in its slot."""
        self.trained = {}
        if not replies:
            return
        assign = head_assignment(self.federation.client_ids, self.federation.seed, round, self.shuffle)
        weights = [float(r.num_examples) for r in replies.values()]
        avg = weighted_average([r.payload["body"] for r in replies.values()], weights)
        self.body = self._avgm.server_step(round, self.body, avg)
        for cid, r in replies.items():
            self.heads[assign[cid]] = r.payload["head"]
            self.trained[assign[cid]] = cid

    # ------------------------------------------------------------------ FedSDC+: validation
    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """Every head to every evaluated client: each scores them on its ``val`` split, and
        the vote of the ensemble in use (``ensemble``: FedSDC's all heads, FedSDC+'s kept)."""
        ins = Instruction(payload={"body": self.body, "heads": self.heads},
                          config={"widths": json.dumps(self.widths), "ensemble": json.dumps(self.chosen)})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def client_validate(self, client: "ClientContext", instruction: Instruction) -> dict[str, float]:
        """Each head's accuracy and micro-F1 on this client's ``val`` split (NaN without one)
        and, for the heads of ``ensemble``, the counts of tied votes, of samples the heads
        disagree on and of correct ensemble decisions, with the split's size ``n_val``."""
        ens = self._ensemble(client, instruction)
        y, logits = labels_and_logits(ens, client.loader("val", shuffle=False), client.device)
        n = int(len(y))
        out: dict[str, float] = {"n_val": float(n)}
        for i in range(len(ens.heads)):
            p = torch.softmax(logits[i].float(), dim=1).numpy() if n else None
            out[f"micro_f1_{i}"] = float(micro_f1(y, p)) if n else math.nan
            out[f"accuracy_{i}"] = float((p.argmax(1) == y).mean()) if n else math.nan
        out.update(vote_ties=0.0, vote_disagreements=0.0, vote_correct=0.0)
        if n:
            members = [int(i) for i in json.loads(str(instruction.config.get("ensemble", "[]")))] or list(
                range(len(ens.heads)))
            out.update(vote_record(logits[members], y, self.vote, self.tie_break))
        return out

    def reported_names(self, exchange: str, instruction: Instruction) -> frozenset[str]:
        """The validation scalars also hold ``micro_f1_<i>`` and ``accuracy_<i>`` for each
        head ``i`` the instruction sends."""
        names = super().reported_names(exchange, instruction)
        if exchange != "validate":
            return names
        heads = range(len(instruction.payload.get("heads") or []))
        return names | {f"{m}_{i}" for i in heads for m in ("micro_f1", "accuracy")}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Pool the observables; FedSDC+ (sec. 2.2): keep the ``kept_heads(gamma, N)`` heads of
        best mean validation micro-F1."""
        self._observe(round, results)
        if self.gamma is None:
            return
        n = len(self.heads)
        means = []
        for i in range(n):
            vals = [float(r[f"micro_f1_{i}"]) for r in results.values()
                    if math.isfinite(float(r.get(f"micro_f1_{i}", math.nan)))]
            means.append(sum(vals) / len(vals) if vals else -1.0)
        keep = kept_heads(self.gamma, n, self.keep_rounding)
        self.chosen = sorted(sorted(range(n), key=lambda i: (-means[i], i))[:keep])
        self.val_means = means

    # ------------------------------------------------------------------ test time
    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """The body and the ensemble's heads (all, or FedSDC+'s chosen)."""
        ins = Instruction(payload={"body": self.body, "heads": [self.heads[i] for i in self.chosen]},
                          config={"widths": json.dumps([self.widths[i] for i in self.chosen])})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The body with the ensemble's heads (vote fractions with the tie rule, or mean
        probabilities)."""
        return self._ensemble(client, instruction)

    def state_dict(self) -> dict[str, Any]:
        """Body, heads, FedAvgM's velocity, the chosen heads, the observables and warnings."""
        return {"body": self.body, "heads": {str(i): h for i, h in enumerate(self.heads)},
                "velocity": self._avgm.velocity, "chosen": json.dumps(self.chosen),
                "val_means": json.dumps(self.val_means),
                "observed": self._records_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.body = dict(state["body"])
        self.heads = [dict(state["heads"][str(i)]) for i in range(len(state["heads"]))]
        self._avgm.velocity = dict(state["velocity"])
        self.chosen = [int(i) for i in json.loads(state["chosen"])]
        self.val_means = [float(v) for v in json.loads(state["val_means"])]
        self._load_records(state.get("observed", "{}"))

    # ------------------------------------------------------------------ models
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

    def _make_head(self, embed_dim: int, width: int, num_classes: int) -> nn.Sequential:
        return make_head(embed_dim, width, num_classes, self.dropout, self.head, self.head_activation)

    def _full(self, client: "ClientContext", body: dict[str, torch.Tensor], heads: list[dict[str, torch.Tensor]],
              widths: list[int]) -> tuple[nn.Module, list[nn.Module]]:
        """The body model and heads of ``widths`` on ``client``, holding the states sent."""
        spec = client.model_spec
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(client.seed, "model"))
            model = self._checked_body(build_model(dict(spec)), spec)
            built = [self._make_head(int(model.embed_dim), w, int(spec["num_classes"])) for w in widths]
        model.load_state_dict({**model.state_dict(), **body})
        for h, s in zip(built, heads):
            h.load_state_dict(s)
        return model, built

    def _ensemble(self, client: "ClientContext", instruction: Instruction) -> HeadEnsemble:
        widths = [int(w) for w in json.loads(str(instruction.config["widths"]))]
        body, heads = self._full(client, instruction.payload["body"], list(instruction.payload["heads"]), widths)
        return HeadEnsemble(body, heads, self.vote, self.tie_break).to(client.device).eval()


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register FedSDC."""
    register(FedSDC)
