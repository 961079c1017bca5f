"""A third-party medfl plugin: two methods and a reply filter written from docs/plugins.md alone.

``median``: FedAvg with coordinate-wise median aggregation (Yin et al., "Byzantine-Robust
Distributed Learning: Towards Optimal Statistical Rates", ICML 2018): the global model is
the coordinate-wise median of the clients' models, which tolerates a minority of arbitrary
(faulty or malicious) updates. Integer buffers take the median too (lower median for an even
count, so the value is one a client sent). It overrides one ``HubAndSpoke`` piece.

``median_snapshots``: the same training, evaluated as an ensemble of the best recent global
models. It shows the rest of the contract: coordinator state that is checkpointed, a profile
exchange before round 1 (``configure_profile`` / ``client_profile`` / ``server_profile``:
each client says how many validation samples it has, so only clients that have some are
asked to validate), a validation exchange (``configure_validate`` / ``client_validate`` /
``server_validate``: only scalars leave the clients), an evaluation model that returns
probabilities (``ProbabilityModel``), which the Global Test (``cross_test``) scores over
Flower too, client groups (``client_groups``), a report in ``summary.json`` (``report``) and
a final model the run scores at every client (``final_models``: the best snapshot).

``half``: a reply filter (``"filters": [{"name": "half"}]``) that sends every
floating-point tensor of a reply's model state in float16 (half the bytes of float32) and
turns it back into the dtype the coordinator sent. It shows the filter contract: ``apply`` at
the client, ``undo`` at the coordinator, checking what a site sent.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from medfl import Instruction, hookimpl
from medfl.engine.hub import HubAndSpoke
from medfl.engine.training import predict_proba
from medfl.filters import Filter, FilterContext
from medfl.messages import PayloadError
from medfl.models import ProbabilityModel

__all__ = ["FedMedian", "MedianSnapshots", "MeanProbability", "Half", "register_methods", "register_filters"]


class FedMedian(HubAndSpoke):
    """Coordinate-wise median of the client models (unweighted)."""

    name = "median"
    description = "Coordinate-wise median aggregation (Yin et al., 2018)"

    def aggregate(self, states, weights):
        """Median of each coordinate over clients; ``weights`` are ignored."""
        out = {}
        for k in states[0]:
            stacked = torch.stack([s[k] for s in states])
            if stacked.is_floating_point():
                out[k] = stacked.quantile(0.5, dim=0) if len(states) % 2 == 0 else stacked.median(dim=0).values
            else:
                out[k] = stacked.median(dim=0).values
        return out


class MeanProbability(ProbabilityModel):
    """An ensemble whose output is the mean of its members' softmax probabilities."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mean class probabilities ``(B, K)``."""
        return torch.stack([torch.softmax(m(x), dim=1) for m in self.members]).mean(dim=0)


class MedianSnapshots(FedMedian):
    """FedMedian, evaluated as the mean probability of its best recent global models.

    The coordinator keeps the last ``keep`` global models (snapshots). After each round's
    training, every client scores each snapshot on its own ``val`` split and returns one
    accuracy per snapshot (scalars); the coordinator keeps the ``top`` snapshots with the best
    mean validation accuracy over the clients that have validation data (ties: the newer
    snapshot). Each client is evaluated with the mean probability of the kept snapshots.

    Args:
        keep: how many recent global models to keep (>= 1).
        top: how many of them form the evaluated ensemble (1..keep).
    """

    name = "median_snapshots"
    description = "Median aggregation; ensemble of the best recent global models by validation accuracy"

    def __init__(self, keep: int = 3, top: int = 2) -> None:
        if int(keep) < 1 or not 1 <= int(top) <= int(keep):
            raise ValueError(f"median_snapshots: need keep >= 1 and 1 <= top <= keep, got keep={keep}, top={top}")
        self.keep, self.top = int(keep), int(top)

    # ---------------------------------------------------------------- coordinator
    def setup(self, federation) -> None:
        """The global model (``HubAndSpoke``), no snapshots yet."""
        super().setup(federation)
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.chosen: list[int] = []
        self.val_sizes: dict[str, int] = {}

    def configure_profile(self) -> dict[str, Instruction]:
        """Before round 1, every client says how many validation samples it has."""
        return {cid: Instruction() for cid in self.federation.eval_client_ids}

    def server_profile(self, results: dict[str, dict[str, float]]) -> None:
        """Remember each client's validation size (a client that did not answer: 0)."""
        self.val_sizes = {cid: int(results.get(cid, {}).get("val_samples", 0))
                          for cid in self.federation.eval_client_ids}

    def client_groups(self) -> dict[str, str]:
        """Clients that validate snapshots and those without a validation split."""
        return {cid: "validates" if n > 0 else "no_val" for cid, n in self.val_sizes.items()}
    def server_update(self, round: int, replies) -> None:
        """Median-aggregate, then remember the new global model as the newest snapshot."""
        super().server_update(round, replies)
        self.snapshots = (self.snapshots + [dict(self.global_state)])[-self.keep:]
        self.chosen = list(range(len(self.snapshots)))[-self.top:]

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """Every client scores every snapshot (nothing to rank with a single one)."""
        if len(self.snapshots) < 2:
            return {}
        ins = Instruction(payload={"snapshots": self.snapshots})
        return {cid: ins for cid in self.federation.eval_client_ids if self.val_sizes.get(cid, 1) > 0}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Keep the ``top`` snapshots of best mean validation accuracy."""
        means = []
        for i in range(len(self.snapshots)):
            accs = [r[f"acc_{i}"] for r in results.values() if math.isfinite(r.get(f"acc_{i}", math.nan))]
            means.append(sum(accs) / len(accs) if accs else -1.0)
        ranked = sorted(range(len(means)), key=lambda i: (means[i], i), reverse=True)
        self.chosen = sorted(ranked[: self.top])
        self.val_means = means

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Send the chosen snapshots (the global model before any round has run)."""
        models = [self.snapshots[i] for i in self.chosen] or [self.global_state]
        ins = Instruction(payload={"models": models})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def final_models(self) -> dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """The newest chosen snapshot, as a model of the run's spec: the run scores it at
        every client (and on the public test split when the run has one)."""
        if not self.snapshots:
            return {}
        best = self.snapshots[(self.chosen or [len(self.snapshots) - 1])[-1]]
        return {"best_snapshot": (self.federation.model_spec(), best)}

    def report(self) -> dict[str, Any]:
        """Which snapshots form the ensemble, and the clients' validation sizes."""
        return {"kept_snapshots": len(self.snapshots), "chosen": list(self.chosen),
                "validation_sizes": dict(self.val_sizes)}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the global model, the snapshots, which are chosen, validation sizes."""
        return {"global": self.global_state, "snapshots": self.snapshots, "chosen": list(self.chosen),
                "val_sizes": {k: torch.tensor(v) for k, v in self.val_sizes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote."""
        self.global_state = state["global"]
        self.snapshots = list(state["snapshots"])
        self.chosen = [int(i) for i in state["chosen"]]
        self.val_sizes = {k: int(v) for k, v in state.get("val_sizes", {}).items()}

    # ---------------------------------------------------------------- client
    def client_profile(self, client, instruction: Instruction) -> dict[str, float]:
        """How many validation samples this client has (a count, no sample)."""
        return {"val_samples": float(client.num_examples("val"))}

    def client_validate(self, client, instruction: Instruction) -> dict[str, float]:
        """Accuracy of each snapshot on this client's ``val`` split (NaN when it has none)."""
        out = {}
        for i, snapshot in enumerate(instruction.payload["snapshots"]):
            y, p = predict_proba(client.load_model(snapshot), client.loader("val"), client.device)
            out[f"acc_{i}"] = float((p.argmax(1) == y).mean()) if len(y) else math.nan
        return out

    def client_eval_model(self, client, instruction: Instruction) -> nn.Module:
        """The mean probability of the snapshots in the instruction."""
        return MeanProbability([client.load_model(s) for s in instruction.payload["models"]])


@hookimpl
def register_methods(register):
    """Register ``median`` and ``median_snapshots``."""
    register(FedMedian)
    register(MedianSnapshots)


class Half(Filter):
    """Send floating-point tensors in float16; the coordinator restores the dtype it sent.

    float16 keeps about 3 significant digits (relative error below 2**-11) and values up to
    65504; a tensor outside that range is refused at the client rather than sent as inf.
    """

    name = "half"
    description = "Send floating-point tensors of the model state in float16 (half the bytes)"

    def apply(self, state: dict[str, torch.Tensor], ctx: FilterContext) -> dict[str, torch.Tensor]:
        """Every floating-point tensor as float16 (integer tensors as they are)."""
        out = {}
        for k, v in state.items():
            if v.is_floating_point():
                if v.numel() and float(v.abs().max()) > 65504.0:
                    raise ValueError(f"{ctx.where}[{k!r}]: values beyond float16's range (65504)")
                v = v.half()
            out[k] = v
        return out

    def undo(self, value: Any, ctx: FilterContext) -> dict[str, torch.Tensor]:
        """Back to the dtype of the state the coordinator sent (float32 when it sent none)."""
        if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
            raise PayloadError(f"{ctx.where}: expected a dict of tensors from the half filter")
        ref = ctx.reference or {}
        out = {}
        for k, v in value.items():
            if v.is_floating_point() and v.dtype != torch.float16:
                raise PayloadError(f"{ctx.where}[{k!r}]: expected float16, got {v.dtype}")
            out[k] = v.to(ref[k].dtype) if k in ref else (v.float() if v.is_floating_point() else v)
        return out


@hookimpl
def register_filters(register):
    """Register ``half``."""
    register(Half)
