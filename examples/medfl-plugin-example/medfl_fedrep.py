"""A medfl method plugin: ``fedrep`` (Collins et al., "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021): a body averaged by the coordinator, a head per client.
"""

from __future__ import annotations

from torch import nn

from medfl import ClientContext, Instruction, MethodConfigError, Reply, hookimpl
from medfl.hub import HubAndSpoke
from medfl.training import get_state, make_optimizer, train_epochs

__all__ = ["FedRep", "register_methods", "requires_medfl_api"]

requires_medfl_api = ">=1.0,<2"


class FedRep(HubAndSpoke):
    """FedRep, Alg. 1: each client trains its head (body frozen), then the body (head frozen),
    keeps the head in ``client.state`` and replies the body; the coordinator averages the bodies.

    ``HubAndSpoke`` does the rest: ``setup`` leaves the :meth:`local_keys` out of the global
    model, so every instruction's ``"model"`` is the body; ``client_model``, which evaluation
    scores too, loads it with the client's head (a fresh seeded one before its first update).
    Deviations: a phase is epochs of ``fl.train``'s optimizer, not Alg. 1's gradient steps
    (``fl.train.epochs`` is unused); BatchNorm's running statistics follow the data in both.

    Args:
        head_epochs: epochs on the head, body frozen (default 10).
        body_epochs: epochs on the body, head frozen (default 1).
    """

    name = "fedrep"
    description = "FedRep: the body averaged, a personal head kept at each client (Collins et al., 2021)"
    supports_dp_sgd = False   # its two phases are plain training, not DP-SGD
    train_metrics = HubAndSpoke.train_metrics | {"head_loss"}   # every name a reply's metrics carry

    def __init__(self, head_epochs: int = 10, body_epochs: int = 1) -> None:
        super().__init__()
        if min(head_epochs, body_epochs) < 0 or head_epochs + body_epochs == 0:
            raise MethodConfigError(f"fedrep: head_epochs and body_epochs must be >= 0 and not both 0, got "
                                    f"{head_epochs} and {body_epochs}")
        self.head_epochs, self.body_epochs = int(head_epochs), int(body_epochs)

    def local_keys(self, model: nn.Module) -> set[str]:
        """The head's state-dict keys: they never leave the client (asked in ``setup`` too)."""
        if not hasattr(model, "head_keys"):
            raise MethodConfigError(f"fedrep: model {type(model).__name__} has no head_keys(); FedRep needs its head")
        return set(model.head_keys())

    def client_weights(self, replies: dict[str, Reply]) -> list[float]:
        """Alg. 1 averages the sampled clients' bodies unweighted."""
        return [1.0] * len(replies)

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """Alg. 1 at one client: the head for ``head_epochs`` (body frozen), then the body for
        ``body_epochs`` (head frozen); keep the head, reply the body (the keys it was sent)."""
        model = self.client_model(client, instruction)
        sent = instruction.payload["model"]
        head = self._train(client, model, self.local_keys(model), self.head_epochs)
        body = self._train(client, model, set(sent), self.body_epochs)
        state = get_state(model)
        client.state["local"] = {k: v for k, v in state.items() if k not in sent}
        return Reply(payload={"model": {k: state[k] for k in sent}}, num_examples=client.num_examples("train"),
                     metrics={"loss": body["loss"], "head_loss": head["loss"], "steps": head["steps"] + body["steps"]})

    @staticmethod
    def _train(client: ClientContext, model: nn.Module, keys: set[str], epochs: int) -> dict[str, float]:
        """``epochs`` on the client's training split of the parameters in ``keys``, the others frozen."""
        if epochs == 0:
            return {"loss": 0.0, "steps": 0.0}
        for name, p in model.named_parameters():
            p.requires_grad_(name in keys)
        trained = [p for p in model.parameters() if p.requires_grad]
        return train_epochs(model, client.loader("train"), make_optimizer(trained, client.train), epochs,
                            device=client.device, clip_grad_norm=client.train.get("clip_grad_norm"))


@hookimpl
def register_methods(register):
    """Register ``fedrep``."""
    register(FedRep)
