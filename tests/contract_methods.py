"""Methods that exercise the method contract's extension points, shared by the in-process
tests (tests/engine/test_method_hooks.py) and the same checks over Flower
(tests/flower/test_contract_over_flower.py). ``register_test_methods`` is a fixture body."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from medfl import hookimpl
from medfl.context import ClientContext
from medfl.hub import HubAndSpoke
from medfl.training import make_optimizer, predict_proba, train_epochs
from medfl.messages import Instruction, Reply
from medfl.method import Method, Preset
from medfl.models import ProbabilityModel
from medfl.plugins import get_plugin_manager

__all__ = ["StepCounter", "ValidatingAvg", "MeanOfTwo", "EnsembleLocal", "Stray", "Observed", "NoisedFrom",
           "methods_registered", "registered"]


class StepCounter(Method):
    """Two training steps a round; each client counts its updates in its persistent state."""

    name = "test_step_counter"
    train_metrics = frozenset({"count"})    # declared before round 1, as every reported name
    seen: list[tuple[int, str, int]] = []   # (round, client, counter before the update)

    def round_steps(self, round: int) -> int:
        return 2

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        before = int(client.state.get("count", 0))
        client.state["count"] = before + 1
        return Reply(metrics={"count": float(before + 1)}, num_examples=client.num_examples())

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        return client.build_model()


class ValidatingAvg(HubAndSpoke):
    """FedAvg whose coordinator ranks clients by validation accuracy (a validation exchange)
    and keeps what every evaluation reported."""

    name = "test_validating_avg"
    validate_metrics = frozenset({"val_accuracy", "val_n"})
    received: dict[str, Any] = {}

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        return {cid: Instruction(payload={"model": self.global_state}, config={"tag": "val"})
                for cid in self.federation.eval_client_ids}

    def client_validate(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
        assert instruction.config["tag"] == "val"
        y, p = predict_proba(self.client_model(client, instruction), client.loader("val"), client.device)
        client.state["validated"] = torch.tensor(client.round)
        return {"val_accuracy": float((p.argmax(1) == y).mean()), "val_n": float(len(y))}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        self.best = max(results, key=lambda c: results[c]["val_accuracy"])
        ValidatingAvg.received.setdefault("validate", []).append((round, results))

    def server_evaluate(self, round: int, results: dict[str, dict[str, dict[str, float]]]) -> None:
        ValidatingAvg.received.setdefault("evaluate", []).append((round, results))


class MeanOfTwo(ProbabilityModel):
    """An ensemble returning the mean of two models' softmaxes."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(self.a(x), 1) + torch.softmax(self.b(x), 1)) / 2


class EnsembleLocal(Method):
    """Each client trains two models of its own; its evaluation model is their mean probability."""

    name = "test_ensemble_local"

    def _models(self, client: ClientContext) -> tuple[nn.Module, nn.Module]:
        a, b = client.build_model(), client.build_model(width=3)
        if "a" in client.state:
            a.load_state_dict(client.state["a"])
            b.load_state_dict(client.state["b"])
        return a, b

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        a, b = self._models(client)
        for m, key in ((a, "a"), (b, "b")):
            train_epochs(m, client.loader("train"), make_optimizer(m.parameters(), client.train))
            client.state[key] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        return Reply(num_examples=client.num_examples())

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        return MeanOfTwo(*self._models(client))


class Stray(ValidatingAvg):
    """Addresses a client that does not exist in its validation exchange."""

    name = "test_stray"

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        return {"nobody": Instruction()}


class Observed(HubAndSpoke):
    """FedAvg with presets, that logs what it saw as mechanism rows and warns once (round 2)."""

    name = "test_observed"
    presets = {
        "paper": Preset(source="a test paper, Table 1", values={"scale": 2.0, "tag": "p"},
                        train={"lr": 0.02},
                        sources={"scale": "paper: Table 1", "tag": "open: the paper gives none; ours",
                                 "train.lr": "reading: 'a small step'; other reading: 0.01"},
                        experiment={"rounds": 50, "num_clients": 3}, description="the test paper's settings"),
        "bare": Preset(source="nothing at all"),
    }

    def __init__(self, scale: float = 1.0, tag: str = "default", unused: int = 0) -> None:
        self.scale, self.tag, self.unused = float(scale), str(tag), int(unused)

    def setup(self, federation: Any) -> None:
        super().setup(federation)
        self.seen: dict[str, float] = {}

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        super().server_update(round, replies)
        self.seen = {cid: float(r.num_examples) * self.scale for cid, r in replies.items()}

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = [{"mechanism": "count", "scope": "client", "id": cid, "scaled": v}
                                      for cid, v in sorted(self.seen.items())]
        rows.append({"mechanism": "count", "scope": "run", "total": sum(self.seen.values()),
                     "state": "even" if round % 2 == 0 else "odd", "missing": None})
        return rows

    def mechanism_warnings(self, round: int) -> list[str]:
        return ["the count cannot act in round 2"] if round == 2 else []

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seen": dict(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.seen = dict(state["seen"])


class NoisedFrom(HubAndSpoke):
    """FedAvg whose own "mechanism" acts from round ``start``: from then on it adds Gaussian
    noise of std ``sigma`` (seeded by the round) to the aggregate's weights, as a DP method
    does, and says so through ``scored_from`` (``None`` before: still in a first stage).
    ``answer`` makes it answer wrongly (``"zero"``, ``"moves"``), for the engine's checks
    (tests/engine/test_scored_from.py, and over Flower tests/flower/test_coordinator.py)."""

    name = "test_noised_from"

    def __init__(self, start: int = 3, sigma: float = 1.0, answer: str = "right") -> None:
        self.start, self.sigma, self.answer = int(start), float(sigma), answer

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        super().server_update(round, replies)
        if round >= self.start and self.sigma > 0:
            gen = torch.Generator().manual_seed(round)
            self.global_state = {k: v + self.sigma * torch.randn(v.shape, generator=gen)
                                 if v.is_floating_point() and "running_" not in k else v
                                 for k, v in self.global_state.items()}

    def scored_from(self, round: int) -> int | None:
        if self.answer == "zero":
            return 0
        if self.answer == "moves":
            return round
        return None if round < self.start else self.start


@contextmanager
def methods_registered(*classes: type[Method], name: str = "test-methods") -> Iterator[None]:
    """Register method ``classes`` as one plugin named ``name`` while the block runs."""

    class Plugin:
        @hookimpl
        def register_methods(self, register: Any) -> None:
            for cls in classes:
                register(cls)

    pm = get_plugin_manager()
    pm.register(Plugin(), name=name)
    try:
        yield
    finally:
        pm.unregister(name=name)


def registered() -> Iterator[None]:
    """Register these methods for the duration of a test (use as a fixture body)."""
    with methods_registered(StepCounter, ValidatingAvg, EnsembleLocal, Stray, Observed, name="method-hooks-test"):
        yield
