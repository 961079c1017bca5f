"""Outside plugins that declare a per-sample release and return raw images (issue 38,
item 1), shared by the in-process tests (tests/privacy/test_release_by_medfl.py) and the
same checks over Flower (tests/flower/test_release_flower.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Iterator

import torch

from medfl.hub import HubAndSpoke
from medfl.filters import Release
from medfl.messages import Instruction, Reply
from medfl.privacy.accounting import noise_for_epsilon

from contract_methods import methods_registered

__all__ = ["EPSILON", "CLIP", "DELTA", "RawRelease", "OldContract", "probes_registered", "noise_std"]

EPSILON, CLIP, DELTA = 4.0, 1000.0, 1e-5      # a clip above every image's norm: nothing is clipped


def _train_images(client: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's training images and labels in the train split's order."""
    data = client.dataset("train", augment=False)
    return (torch.stack([torch.as_tensor(data[i][0]) for i in range(len(data))]),
            torch.tensor([int(data[i][1]) for i in range(len(data))]))


class RawRelease(HubAndSpoke):
    """FedAvg whose round 1 first asks every client for a release of its training images,
    which the client step returns raw (or with ``own_noise`` std of its own noise); with
    ``stray``, every training reply also carries lightly noised images under the release key."""

    name = "raw_release_probe"
    raw: ClassVar[dict[str, torch.Tensor]] = {}          # each client's features (its images)
    sent: ClassVar[dict[str, torch.Tensor]] = {}         # what each client step returned
    received: ClassVar[dict[str, torch.Tensor]] = {}     # what the coordinator's method received

    def __init__(self, epsilon: float | None = EPSILON, own_noise: float = 0.0, stray: bool = False,
                 features: str = "images") -> None:
        self.epsilon, self.own_noise, self.stray, self.features = epsilon, own_noise, stray, features

    def release_plan(self) -> Any:
        from medfl.privacy.feature_release import SampleRelease   # the contract medfl performs

        z = 0.0 if self.epsilon is None else noise_for_epsilon(self.epsilon, DELTA, 1.0, 1, "rdp")
        return SampleRelease("raw_images", z, CLIP, 1.0, DELTA, "rdp", keys=("shared_x",), labels="shared_y")

    def setup(self, federation: Any) -> None:
        super().setup(federation)
        self.asked = False

    def round_steps(self, round: int) -> int:
        return 2 if round == 1 else 1

    def round_releases(self, round: int) -> list[str]:
        return list(self.federation.client_ids) if round == 1 else []

    def configure_round(self, round: int) -> dict[str, Instruction]:
        if round == 1 and not self.asked:
            self.asked = True
            return {cid: Instruction(config={"dp_release": True}) for cid in self.federation.client_ids}
        return super().configure_round(round)

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        if replies and all("shared_x" in r.payload for r in replies.values()):
            type(self).received.update({cid: r.payload["shared_x"] for cid, r in replies.items()})
            return
        super().server_update(round, replies)

    def client_update(self, client: Any, instruction: Instruction) -> Reply:
        x, y = _train_images(client)
        g = torch.Generator().manual_seed(client.seed)
        if instruction.config.get("dp_release") is True:
            if self.features == "projection":   # 8 numbers per image, not the image
                x = x.flatten(1) @ torch.randn(x[0].numel(), 8, generator=g)
            elif self.features == "other labels":   # something else under the labels key
                y = 1 - y
            sent = x + self.own_noise * torch.randn(x.shape, generator=g) if self.own_noise else x
            type(self).raw[client.client_id] = x.clone()
            type(self).sent[client.client_id] = sent.clone()
            return Reply(payload={"shared_x": sent, "shared_y": y}, num_examples=len(y))
        reply = super().client_update(client, instruction)
        if self.stray:
            reply.payload["shared_x"] = x + 0.01 * torch.randn(x.shape, generator=g)
        return reply


class OldContract(RawRelease):
    """The contract before issue 38: ``payload_exemptions``, the flag, a plain ledger
    ``Release``, and the images returned unchanged."""

    name = "old_release_probe"
    payload_exemptions = frozenset({"shared_x", "shared_y"})

    def release_plan(self) -> Any:
        return Release("raw_images", noise_for_epsilon(EPSILON, DELTA, 1.0, 1, "rdp"), CLIP, 1.0, DELTA, "rdp",
                       unit="sample")


def probes_registered() -> Iterator[None]:
    """Register the two probe methods, with empty records, while the block runs (a fixture body)."""
    for record in (RawRelease.raw, RawRelease.sent, RawRelease.received):
        record.clear()
    with methods_registered(RawRelease, OldContract, name="release-probes"):
        yield


def noise_std(client_ids: list[str], than: dict[str, torch.Tensor] = RawRelease.raw) -> float:
    """The std of (what the coordinator received - ``than``: the clients' images by default)."""
    diff = torch.cat([(RawRelease.received[c].double() - than[c].double()).flatten() for c in client_ids])
    return float(diff.std())
