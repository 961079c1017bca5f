"""A third-party medfl plugin: four methods and a reply filter written from docs/plugins.md alone.

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
``server_validate``: only scalars leave the clients, under the names the method declares:
``profile_metrics`` and ``reported_names``), an evaluation model that returns
probabilities (``ProbabilityModel``), which the Global Test (``cross_test``) scores over
Flower too, client groups (``client_groups``), a report in ``summary.json`` (``report``) and
a final model the run scores at every client (``final_models``: the best snapshot), a table
written after the run (``final_tables``: ``snapshots.csv``, each kept snapshot's last mean
validation accuracy), what its ranking did each round (``mechanisms``: ``mechanisms.csv``)
with a warning when it cannot act (``mechanism_warnings``), and a named preset (``presets``:
``{"name": "median_snapshots", "preset": "wide"}``) whose every value cites its source.

``dp_shared_images``: FedAvg on each client's data plus a shared set of every client's
training images, each released once under per-sample differential privacy in round 1. It
shows how a method sends per-sample data at all: it declares the release in ``release_plan``
(a ``SampleRelease``: the reply keys, the clip, the noise; the run's ``privacy.csv`` records
each client's epsilon) and ``round_releases`` (who was asked when), asks for it with
``"dp_release": True`` in the instruction's config, and returns the images *unnoised*:
medfl clips and noises them at the client after ``client_update`` returned, and the content
guard checks what leaves. Each release is checked in ``check_reply`` (a bad one is dropped
from the round). Labels travel in the clear.
It declares where its own mechanism (the shared set) starts to shape the model it is scored
by (``scored_from``: the first round whose training used the shared set, round 1's second
step when the release succeeds), so early stopping and ``medfl.arm_report`` never score it
by a model trained before the shared set existed. The other methods keep the default (round
1): their mechanism (the median, the snapshot ensemble, DP-SGD) acts from the first round.
It is the "share DP raw data" baseline FedTPF argues against: the same epsilon drowns whole
images in noise.

``dp_fedavg_opacus``: DP-FedAvg with the privacy in the method's own client step: each
local epoch is Opacus's DP-SGD (``PrivacyEngine.make_private``: Poisson batches, per-sample
gradients clipped to ``max_grad_norm``, Gaussian noise ``noise_multiplier``), its noise drawn
from a generator seeded with the site's ``client.noise_key``. The method declares it with
``own_dp`` (a :class:`medfl.OwnDp`: per client the sampling rate and steps of one local
update), so the run accounts it with Opacus's accountant (``privacy.csv``, ``summary.json``:
``"performed_by": "method"``) and checks the steps each client reports in ``dp_steps``.
The model must have no BatchNorm (``"model": {"name": "two_block_cnn"}``).

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

from medfl import Instruction, OwnDp, hookimpl
from medfl.method import MethodConfigError, Preset
from medfl.hub import HubAndSpoke
from medfl.training import predict_proba
from medfl.training import get_state, make_optimizer, train_epochs
from medfl.filters import Filter, FilterContext
from medfl.messages import PayloadError, Reply
from medfl.privacy.accounting import noise_for_epsilon
from medfl.privacy.feature_release import SampleRelease
from medfl.models import ProbabilityModel

__all__ = ["FedMedian", "MedianSnapshots", "MeanProbability", "DpSharedImages", "DpFedAvgOpacus", "Half",
           "register_methods", "register_filters", "requires_medfl_api"]

#: The medfl plugin API this plugin is written against (``medfl.PLUGIN_API_VERSION``, MAJOR.MINOR):
#: any 1.x. medfl skips the plugin with a warning, naming both versions, when it does not match.
requires_medfl_api = ">=1.0,<2"


class FedMedian(HubAndSpoke):
    """Coordinate-wise median of the client models (unweighted).

    The median needs every client's own model, so it leaves ``secure_aggregation`` off
    (``fl.secure_aggregation`` is refused for it, naming the reason); a ``HubAndSpoke``
    subclass that keeps the default weighted mean could set it ``True``."""

    name = "median"
    description = "Coordinate-wise median aggregation (Yin et al., 2018)"
    secure_aggregation = False   # the coordinator needs each client's model, not only their mean

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
        top: how many of them form the evaluated ensemble (1..keep, and at most ``fl.rounds``:
            a run of fewer rounds never has ``top`` global models; ``setup`` refuses it).

    Raises:
        MethodConfigError: ``keep`` or ``top`` out of range (``__init__``), or ``top`` above the
            run's rounds (``setup``, where the method first sees them): the run stops with that
            one line and leaves no run directory.
    """

    name = "median_snapshots"
    description = "Median aggregation; ensemble of the best recent global models by validation accuracy"
    # every value cites where it comes from, "<kind>: <citation>" (kinds: paper, authors_code,
    # reading, open; medfl plugins median_snapshots prints them, config.json records them)
    presets = {"wide": Preset(source="this example's docstring", values={"keep": 5, "top": 3},
                              sources={"keep": "open: no paper behind this example; five recent global models, "
                                               "wider than the default 3 at the cost of two more snapshots a round",
                                       "top": "open: no source states it; three of the five, a majority of the "
                                              "snapshots kept"},
                              description="the best 3 of the last 5 global models")}
    # every name a client reports, declared before round 1 (a name is a string leaving the
    # site): the profile's count here, the validation's acc_<i> per snapshot in reported_names
    profile_metrics = frozenset({"val_samples"})

    def __init__(self, keep: int = 3, top: int = 2) -> None:
        if int(keep) < 1 or not 1 <= int(top) <= int(keep):
            raise MethodConfigError(f"median_snapshots: need keep >= 1 and 1 <= top <= keep, got keep={keep}, "
                                    f"top={top}")
        self.keep, self.top = int(keep), int(top)

    # ---------------------------------------------------------------- coordinator
    def setup(self, federation) -> None:
        """The global model (``HubAndSpoke``), no snapshots yet; a run too short for ``top``
        global models is refused here, where the method first sees its rounds."""
        if self.top > federation.rounds:
            raise MethodConfigError(f"median_snapshots: top={self.top} needs at least {self.top} global models, the "
                                    f"run has {federation.rounds} round(s); lower top or raise fl.rounds")
        super().setup(federation)
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.chosen: list[int] = []
        self.val_means: list[float] = []
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
        self.val_means = []

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

    def final_tables(self) -> dict[str, list[dict[str, Any]]]:
        """``snapshots.csv``: each kept snapshot (0 the oldest), its last mean validation
        accuracy (empty when it was never ranked) and whether the ensemble keeps it."""
        return {"snapshots": [{"snapshot": i, "val_accuracy": self.val_means[i] if i < len(self.val_means) else None,
                               "chosen": int(i in self.chosen)} for i in range(len(self.snapshots))]}

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """The ranking of this round (``mechanisms.csv``): each snapshot's mean validation
        accuracy (empty when nothing was ranked) and whether the ensemble keeps it."""
        return [{"mechanism": "snapshot_ranking", "scope": "snapshot", "id": str(i),
                 "val_accuracy": self.val_means[i] if i < len(self.val_means) else None,
                 "chosen": float(i in self.chosen)} for i in range(len(self.snapshots))]

    def mechanism_warnings(self, round: int) -> list[str]:
        """Say once (the first round with two snapshots) when no client can rank them."""
        if len(self.snapshots) == 2 and self.val_sizes and not any(self.val_sizes.values()):
            return ["no client has a validation split: the snapshots cannot be ranked, the newest are kept"]
        return []

    def report(self) -> dict[str, Any]:
        """Which snapshots form the ensemble, and the clients' validation sizes."""
        return {"kept_snapshots": len(self.snapshots), "chosen": list(self.chosen),
                "validation_sizes": dict(self.val_sizes)}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the global model, the snapshots, which are chosen, validation sizes."""
        return {"global": self.global_state, "snapshots": self.snapshots, "chosen": list(self.chosen),
                "val_means": list(self.val_means), "val_sizes": {k: torch.tensor(v) for k, v in self.val_sizes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote."""
        self.global_state = state["global"]
        self.snapshots = list(state["snapshots"])
        self.chosen = [int(i) for i in state["chosen"]]
        self.val_means = [float(v) for v in state.get("val_means", [])]
        self.val_sizes = {k: int(v) for k, v in state.get("val_sizes", {}).items()}

    def reported_names(self, exchange: str, instruction: Instruction) -> frozenset[str]:
        """``acc_<i>`` for each snapshot the validation instruction sends (numbered after the
        instruction, never after the client's data)."""
        names = super().reported_names(exchange, instruction)
        if exchange == "validate":
            names |= {f"acc_{i}" for i in range(len(instruction.payload.get("snapshots") or []))}
        return names

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


class DpSharedImages(HubAndSpoke):
    """FedAvg on local data plus every client's images, released once with per-sample DP.

    Round 1 has two steps: every client releases its training images (clip to L2 norm
    ``clip``, Gaussian noise for ``(epsilon, delta)``, one release per image) with their
    labels; the coordinator keeps them as the shared set. From then on each sampled client
    trains on its own data and the shared set, shuffled together; the first round that does
    is the first one the method is scored by (``scored_from``).
    """

    name = "dp_shared_images"
    description = "FedAvg plus a shared set of DP-noised images (one per-sample release)"

    def __init__(self, epsilon: float = 8.0, clip: float = 5.0, delta: float = 1e-5) -> None:
        if not (epsilon > 0 and clip > 0 and 0 < delta < 1):
            raise MethodConfigError("dp_shared_images: epsilon and clip must be > 0, delta in (0, 1)")
        self.epsilon, self.clip, self.delta = float(epsilon), float(clip), float(delta)

    def release_plan(self) -> SampleRelease:
        """One Gaussian release per image (sample rate 1), asked once; medfl performs it on
        the reply's ``shared_x`` and sends ``shared_y`` (the labels) in the clear."""
        z = noise_for_epsilon(self.epsilon, self.delta, 1.0, 1, "rdp")
        return SampleRelease("shared_images", z, self.clip, 1.0, self.delta, "rdp", keys=("shared_x",),
                             labels="shared_y")

    def setup(self, federation) -> None:
        super().setup(federation)
        self.shared: dict[str, torch.Tensor] = {}
        self.asked = 0
        self.trained_from: int | None = None   # the first round trained with the shared set

    def round_steps(self, round: int) -> int:
        return 2 if round == 1 and not self.shared else 1

    def round_releases(self, round: int) -> list[str]:
        return list(self.federation.client_ids) if round == self.asked else []

    def configure_round(self, round: int) -> dict[str, Instruction]:
        if not self.shared:   # the release step: every client, flagged as the declared DP release
            self.asked = round
            ins = Instruction(config={"dp_release": True})
            return {cid: ins for cid in self.federation.client_ids}
        return {cid: Instruction(payload={"model": self.global_state, **self.shared})
                for cid in self.federation.sample(round)}

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """Every payload key a reply carries, declared from the instruction alone (the engine
        refuses a reply missing one or carrying another, at both ends): the release step's
        images and labels, then the trained model. This is also what the default derives
        from ``reply_state`` and ``release_plan``; a method whose replies carry more (a score,
        a second state) adds it here."""
        if instruction.config.get("dp_release") is True:
            return frozenset({"shared_x", "shared_y"})
        return frozenset({"model"})

    def check_reply(self, client_id: str, instruction: Instruction, reply) -> str:
        """A release must hold finite float images and labels in range, one per training
        sample; a site that sends anything else is dropped from the round (not the run)."""
        if instruction.config.get("dp_release") is not True:
            return ""
        x, y = reply.payload.get("shared_x"), reply.payload.get("shared_y")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point()
                and len(x) == len(y) == reply.num_examples and bool(torch.isfinite(x).all())
                and bool(((y >= 0) & (y < self.federation.num_classes)).all())):
            return (f"expected finite float images and labels in [0, {self.federation.num_classes}), one per "
                    "training sample")
        return ""

    def scored_from(self, round: int) -> int | None:
        """The first round whose training used the shared set (``None`` until one did): the
        rounds before it are plain FedAvg, not this method's."""
        return self.trained_from

    def server_update(self, round: int, replies) -> None:
        if self.shared:
            if self.trained_from is None and replies:
                self.trained_from = round
            return super().server_update(round, replies)
        kept = list(replies.values())   # every reply passed check_reply
        if kept:
            self.shared = {"shared_x": torch.cat([r.payload["shared_x"].float() for r in kept]),
                           "shared_y": torch.cat([r.payload["shared_y"].long() for r in kept])}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "shared": self.shared, "asked": self.asked, "trained_from": self.trained_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.shared, self.asked = dict(state["shared"]), int(state["asked"])
        self.trained_from = state.get("trained_from")

    def client_update(self, client, instruction: Instruction) -> Reply:
        if instruction.config.get("dp_release") is True:
            # the images as they are: medfl clips and noises them (release_plan) before they leave
            data = client.dataset("train", augment=False)
            x = torch.stack([data[i][0] for i in range(len(data))])
            y = torch.tensor([int(data[i][1]) for i in range(len(data))])
            return Reply(payload={"shared_x": x, "shared_y": y}, num_examples=len(y))
        model = self.client_model(client, instruction)
        shared = torch.utils.data.TensorDataset(instruction.payload["shared_x"], instruction.payload["shared_y"])
        both = torch.utils.data.ConcatDataset([client.dataset("train"), _Labelled(shared)])
        loader = torch.utils.data.DataLoader(both, batch_size=int(client.train.get("batch_size", 16)), shuffle=True,
                                             generator=torch.Generator().manual_seed(client.seed))
        stats = train_epochs(model, loader, make_optimizer(model.parameters(), client.train),
                             int(client.train.get("epochs", 1)), device=client.device)
        return Reply(payload={"model": get_state(model)}, metrics=stats, num_examples=client.num_examples())


class DpFedAvgOpacus(HubAndSpoke):
    """DP-FedAvg whose local epochs are Opacus's DP-SGD, run by the method itself and
    declared with :meth:`own_dp` so that the run accounts it.

    Args:
        noise_multiplier: sigma of Opacus's noise, over ``max_grad_norm``.
        max_grad_norm: the per-sample gradient clipping norm.
        delta: the delta the run reports the epsilon at.
    """

    name = "dp_fedavg_opacus"

    def __init__(self, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, delta: float = 1e-5) -> None:
        super().__init__()
        self.noise_multiplier, self.max_grad_norm, self.delta = float(noise_multiplier), float(max_grad_norm), float(delta)

    def own_dp(self, federation) -> OwnDp:
        """Per client: Poisson sampling at ``1 / batches`` for ``epochs * batches`` steps in
        one local update, ``batches = ceil(N_k / batch_size)`` (what Opacus's
        ``make_private`` does with the loader below). ``noised_values`` stays ``None``: Opacus
        noises every trainable parameter, which is the default count."""
        bs, epochs = int(federation.train.get("batch_size", 16)), int(federation.train.get("epochs", 1))
        batches = {cid: max(1, math.ceil(int(n) / bs)) for cid, n in federation.num_examples.items()}
        return OwnDp(mechanism="dp_fedavg_opacus_sgd", unit="sample", noise_multiplier=self.noise_multiplier,
                     sample_rate={cid: 1.0 / b for cid, b in batches.items()},
                     steps={cid: epochs * b for cid, b in batches.items()}, clip=self.max_grad_norm,
                     delta=self.delta, statement="Opacus's DP-SGD (PrivacyEngine.make_private) in each local epoch")

    def client_update(self, client, instruction: Instruction) -> Reply:
        """Train the received model with Opacus's DP-SGD; report the steps taken (``dp_steps``)."""
        from opacus import PrivacyEngine

        model = self.client_model(client, instruction).to(client.device)
        opt = make_optimizer(model.parameters(), client.train)
        loader = torch.utils.data.DataLoader(client.dataset("train"), batch_size=int(client.train.get("batch_size", 16)))
        noise = torch.Generator().manual_seed(client.noise_seed("dp_fedavg_opacus_sgd", noise_multiplier=self.noise_multiplier,
                                                                max_grad_norm=self.max_grad_norm))
        private, opt, loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm, poisson_sampling=True, noise_generator=noise)
        steps, losses = 0, []
        for _ in range(int(client.train.get("epochs", 1))):
            for x, y in loader:
                opt.zero_grad()
                if len(y):   # an empty Poisson batch is still a noise-only step
                    loss = nn.functional.cross_entropy(private(x.to(client.device)), y.long().to(client.device))
                    loss.backward()
                    losses.append(float(loss))
                opt.step()
                steps += 1
        metrics = {"loss": sum(losses) / len(losses) if losses else 0.0, "dp_steps": float(steps)}
        return Reply(payload={"model": get_state(private._module)}, metrics=metrics,
                     num_examples=client.num_examples("train"))


class _Labelled(torch.utils.data.Dataset):
    """``(image, int label)`` items, like a client dataset's, from a TensorDataset."""

    def __init__(self, inner: torch.utils.data.TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        return x, int(y)


@hookimpl
def register_methods(register):
    """Register ``median``, ``median_snapshots``, ``dp_shared_images`` and ``dp_fedavg_opacus``."""
    register(FedMedian)
    register(MedianSnapshots)
    register(DpSharedImages)
    register(DpFedAvgOpacus)


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
