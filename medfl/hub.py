"""Hub-and-spoke methods: a global model broadcast, trained locally, aggregated.

:class:`HubAndSpoke` is the shared skeleton of FedAvg and its relatives (FedProx, FedAvgM,
FedAdam, FedBN, FedKPer, median aggregation...). A subclass changes one piece: the local
loss (:meth:`HubAndSpoke.local_loss`), which keys stay at the client
(:meth:`HubAndSpoke.local_keys`), the client weights (:meth:`HubAndSpoke.client_weights`),
the aggregation (:meth:`HubAndSpoke.aggregate`) or the server step
(:meth:`HubAndSpoke.server_step`); docs/plugins.md lists their signatures and defaults. A
data-independent term of the local objective goes in :meth:`HubAndSpoke.local_regularizer`,
which keeps it out of DP-SGD's per-sample gradients.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from medfl.context import ClientContext
from medfl.training import (
    get_state,
    make_optimizer,
    train_epochs,
    weighted_average,
    with_regularizer,
)
from medfl.messages import Instruction, Reply
from medfl.method import Federation, Method


__all__ = ["HubAndSpoke", "norm_keys"]

State = dict[str, torch.Tensor]


def norm_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every normalisation layer (BatchNorm, InstanceNorm, GroupNorm, LayerNorm)."""
    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    keys: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, norm_types):
            prefix = f"{mod_name}." if mod_name else ""
            keys.update(prefix + k for k in mod.state_dict())
    return keys


class HubAndSpoke(Method):
    """FedAvg skeleton (McMahan et al., 2017): broadcast, local epochs, weighted average.

    Coordinator state: ``global_state`` (the shared part of the model). Client state:
    ``local`` (the keys :meth:`local_keys` keeps at the client), if any.

    Sample-level DP: when the run's local-training settings carry a resolved ``dp`` section
    (``client.train["dp"]``: ``noise_multiplier``, ``max_grad_norm``...), the local epochs are
    DP-SGD (:func:`medfl.privacy.dp_sgd.train_epochs_dp`: Poisson sampling, per-sample
    clipping and Gaussian noise with Opacus) on a DP-compatible model; ``train.clip_grad_norm``
    does not apply then (per-sample clipping replaces it), and :meth:`local_regularizer`'s
    gradient is added after the noise.
    """

    #: reply key carrying model state -> instruction key holding the state it started from
    reply_state: ClassVar[dict[str, str | None]] = {"model": "model"}
    supports_dp_sgd: ClassVar[bool] = True

    global_state: State

    def setup(self, federation: Federation) -> None:
        """Initialise the global model from the run seed."""
        super().setup(federation)
        model = federation.build_model()
        self.param_keys = [n for n, _ in model.named_parameters()]
        local = self.local_keys(model)
        self.global_state = {k: v for k, v in get_state(model).items() if k not in local}

    # ------------------------------------------------------------ overridable pieces
    def local_keys(self, model: nn.Module) -> set[str]:
        """State-dict keys that stay at the client (never sent). Default: none."""
        return set()

    def local_loss(self, client: ClientContext, model: nn.Module, instruction: Instruction
                   ) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The local training loss ``f(model, x, y)``; ``None`` means cross-entropy.

        Under DP-SGD it must be the mean over the batch of per-sample losses (a term that
        does not depend on the data belongs in :meth:`local_regularizer`)."""
        return None

    def local_regularizer(self, client: ClientContext, model: nn.Module, instruction: Instruction
                          ) -> Callable[[nn.Module], torch.Tensor] | None:
        """A data-independent term ``r(model) -> scalar tensor`` added to the local loss
        (FedProx's proximal term); ``None`` (the default) means none.

        Plain training minimises ``local_loss(m, x, y) + r(m)``. Under DP-SGD, ``r``'s
        gradient is added to the clipped, noised gradient before each step (post-processing:
        it costs no privacy and is never clipped). Called once per :meth:`client_update`,
        with the model it starts from; ``r`` may receive that model or a wrapper of it, so
        it should walk ``m.parameters()`` rather than rely on parameter names."""
        return None

    def client_weights(self, replies: dict[str, Reply]) -> list[float]:
        """Aggregation weight of each reply (in ``replies`` order). Default: ``num_examples``."""
        return [float(r.num_examples) for r in replies.values()]

    def aggregate(self, states: list[State], weights: list[float]) -> State:
        """Combine client states. Default: weighted average."""
        return weighted_average(states, weights)

    def server_step(self, round: int, old: State, aggregated: State) -> State:
        """Turn the aggregate into the next global state. Default: take it as is."""
        return aggregated

    # ------------------------------------------------------------ coordinator side
    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Send the global model to the sampled clients."""
        return {cid: Instruction(payload={"model": self.global_state})
                for cid in self.federation.sample(round)}

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Aggregate the replies' models into the global model."""
        if not replies:
            return
        states = [r.payload["model"] for r in replies.values()]
        aggregated = self.aggregate(states, self.client_weights(replies))
        self.global_state = self.server_step(round, self.global_state, aggregated)

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Every client evaluates the global model (with its own local keys)."""
        ins = Instruction(payload={"model": self.global_state})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the global model."""
        return {"global": self.global_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the global model."""
        self.global_state = state["global"]

    # ------------------------------------------------------------ client side
    def client_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """At the client: the received global model with this client's local keys (what
        both :meth:`client_update` and :meth:`client_eval_model` start from)."""
        return client.load_model({**instruction.payload["model"], **client.state.get("local", {})})

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """Load the global model (plus local keys), train ``epochs``, send the shared part.

        With ``client.train["dp"]`` (a dict), the epochs are DP-SGD
        (:func:`medfl.privacy.dp_sgd.train_epochs_dp`, seeded by the client's
        :meth:`~medfl.context.ClientContext.noise_seed`) and the
        metrics add ``dp_steps``, ``dp_sample_rate`` and ``dp_noise_multiplier``."""
        model = self.client_model(client, instruction)
        train = client.train
        opt = make_optimizer(model.parameters(), train)
        dp = train.get("dp")
        if isinstance(dp, dict):
            from medfl.privacy.dp_sgd import train_epochs_dp  # imports Opacus: only under DP

            stats = train_epochs_dp(
                model, client.dataset("train"), opt, int(train.get("epochs", 1)),
                batch_size=int(train.get("batch_size", 16)),
                noise_multiplier=float(dp["noise_multiplier"]),
                max_grad_norm=float(dp["max_grad_norm"]),
                seed=client.noise_seed("dp_sgd", noise_multiplier=float(dp["noise_multiplier"]),
                                       max_grad_norm=float(dp["max_grad_norm"])), device=client.device,
                loss_fn=self.local_loss(client, model, instruction),
                num_workers=int(train.get("num_workers", 0)),
                regularizer=self.local_regularizer(client, model, instruction))
        else:
            loss_fn = self.local_loss(client, model, instruction)
            regularizer = self.local_regularizer(client, model, instruction)
            stats = train_epochs(model, client.loader("train"), opt, int(train.get("epochs", 1)),
                                 device=client.device, loss_fn=with_regularizer(loss_fn, regularizer),
                                 clip_grad_norm=train.get("clip_grad_norm"))
        full = get_state(model)
        local = self.local_keys(model)
        shared = {k: v for k, v in full.items() if k not in local}
        if local:
            client.state["local"] = {k: v for k, v in full.items() if k in local}
        return Reply(payload={"model": shared}, metrics=stats,
                     num_examples=client.num_examples("train"))

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """The global model with this client's local keys."""
        return self.client_model(client, instruction)
