"""FedSKD (paper 004) and the paper's peer-to-peer baselines FedCross and FedCross-dagger.

* :class:`FedSKD` (``fedskd``): aggregation-free, model-heterogeneous P2P learning. Each round a
  random one-to-one permutation routes every client's domain-adaptive model (DAM) to another
  client, where it becomes a knowledge-transit model (KTM); the two learn mutually with
  multi-dimensional similarity distillation (:mod:`medfl.losses.skd`).
* :class:`FedCross` (``fedcross``): one model circulated sequentially through every client
  each round (homogeneous).
* :class:`FedCrossHet` (``fedcross_het``, the paper's FedCross-dagger): every client holds a
  model of its own architecture; models circulate P2P along the same permutations as FedSKD
  and are plainly fine-tuned where they arrive; no distillation.

The coordinator of all three only routes models: it aggregates nothing.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from medfl import hookimpl
from medfl.training import StepMeans, autocast, backward_step, get_state, grad_scaler, make_optimizer
from medfl.losses.skd import SKD_TERMS, RegionMasks, region_masks, skd_loss
from medfl.messages import Instruction, Reply
from medfl.method import (ENGINE_TRAIN_METRICS, ClientContext, Federation, Method, MethodConfigError, Preset,
                          derive_seed)
from medfl.models.registry import build_seeded
from medfl_plugins.baselines import HeldModel

__all__ = ["FedSKD", "FedCross", "FedCrossHet", "PRESETS", "permutation", "load_region_masks", "register_methods"]

State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- shared pieces

def permutation(client_ids: list[str], seed: int, round: int) -> dict[str, str]:
    """The round's transfer order O^t: receiving client -> sending client, one-to-one.

    A uniformly random permutation of ``client_ids`` seeded by ``(seed, "perm", round)``;
    a client mapped to itself consolidates its own model that round.
    """
    ids = list(client_ids)
    order = np.random.default_rng(derive_seed(seed, "perm", round)).permutation(len(ids))
    return {ids[k]: ids[int(order[k])] for k in range(len(ids))}


def _load(spec: dict[str, Any], seed: int, state: State | None, device: str) -> nn.Module:
    """A model of ``spec`` initialised from ``seed`` (the same on any site), then holding
    ``state`` if one is given, in training mode."""
    model = build_seeded(spec, seed, device)
    if state:
        model.load_state_dict(state)
    return model.train()


def _batches(client: "ClientContext", iterations: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The client's training batches: ``iterations`` optimizer steps (cycling the loader as
    often as needed), or ``train.epochs`` passes when ``iterations`` is None. Batches of one
    sample are skipped (BatchNorm cannot train on them)."""
    loader = client.loader("train")
    passes = itertools.count() if iterations is not None else range(int(client.train.get("epochs", 1)))
    done = 0
    for p in passes:
        got = False
        for x, y in loader:
            if x.shape[0] < 2:
                continue
            got = True
            yield x, y
            done += 1
            if iterations is not None and done >= iterations:
                return
        if not got and iterations is not None and p > 0:
            raise MethodConfigError(f"client {client.client_id}: no training batch of two or more samples; "
                                    f"use a train.batch_size of 2 or more, or give the client more cases")


def _check_iterations(iterations: Any) -> int | None:
    if iterations is None:
        return None
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise MethodConfigError(f"iterations: expected a positive integer or null, got {iterations!r}")
    return iterations


def load_region_masks(atlas: str | Path, labels: list[int] | None = None) -> RegionMasks:
    """Region masks from an atlas file: a label volume (NIfTI, ``.npy``) on the input grid, or
    a prepared manifest CSV whose ``atlas`` column names one (``data_prep/abide.py``).

    Raises:
        MethodConfigError: the file is missing or unreadable, naming it.
    """
    path = Path(atlas)
    if not path.exists():
        raise MethodConfigError(f"atlas: {path} not found (a label volume or a prepared manifest.csv)")
    try:
        if path.suffix.lower() == ".csv":
            from medfl.prep.abide import atlas_for_manifest

            volume, _ = atlas_for_manifest(path)
        elif path.suffix.lower() == ".npy":
            volume = np.load(path, allow_pickle=False)
        else:
            from medfl.prep.abide import load_atlas

            volume = load_atlas(path)
    except MethodConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - every reader error becomes one message
        raise MethodConfigError(f"atlas: cannot read {path}: {exc}") from exc
    try:
        return region_masks(np.asarray(volume), labels)
    except ValueError as exc:
        raise MethodConfigError(f"atlas {path}: {exc}") from exc


_MASKS: dict[tuple[str, str], RegionMasks] = {}


def _masks(atlas: str | None, labels: list[int] | None) -> RegionMasks | None:
    if not atlas:
        return None
    key = (str(atlas), json.dumps(labels))
    if key not in _MASKS:
        _MASKS[key] = masks = load_region_masks(atlas, labels)
        if masks.dropped:
            warnings.warn(f"atlas {atlas}: {len(masks.dropped)} requested region(s) have no voxel on the atlas "
                          f"grid and are left out of the region term: {masks.dropped[:10]}", stacklevel=2)
    return _MASKS[key]


# --------------------------------------------------------------------------- presets

_SKD_SOURCE = ("Weng, Cai, Zhou, FedSKD (paper 004), sec. II (eq. 2, KTM head frozen), III-B3 (Adam 1e-4, batch 8, "
               "5 iterations a round x N clients in P2P, gamma), Tables IV-VI (all SKD terms, all four stages, SKD "
               "from round 0)")
_SKD_TRAIN: dict[str, Any] = {"optimizer": "adam", "lr": 1e-4, "batch_size": 8, "weight_decay": 0.0}
_SKD_ITERATIONS = ("reading: sec. III-B3, 'Each round consisted of 5 training iterations. Notably, in P2P training "
                   "scenarios, the number of training iterations per round was scaled to 5xN', read as 5 x N optimizer "
                   "steps (batches of 8) at each client a round ({}); other reading: an iteration is a pass over the "
                   "client's data (5 x N epochs a round)")
#: where each value of both presets comes from (paper 004); ``terms`` and ``iterations``
#: differ between the tasks and are added per preset
_SKD_SOURCES: dict[str, str] = {
    "stages": "paper: sec. III-C2, Table V (all four ResNet-10 layers: 'The full configuration ... achieves peak "
              "performance')",
    "skd_start": "paper: sec. III-C2, Table VI (SKD from 0 % of the rounds, 'at training onset': the best row)",
    "freeze_ktm_head": "paper: sec. II-B, step 3 ('we freeze the parameters of the received model's prediction "
                       "header and only finetuning the feature extractor')",
    "train.optimizer": "paper: sec. III-B3 ('Optimization was performed using the Adam optimizer')",
    "train.lr": "paper: sec. III-B3 ('with a learning rate of 1 x 10^-4')",
    "train.batch_size": "paper: sec. III-B3 ('All methods were trained to converge using a batch size of 8')",
    "train.weight_decay": "open: sec. III-B3 states none; none (Adam's default)",
}
_SKD_EXPERIMENT: dict[str, Any] = {"cv": {"folds": 5}, "model": "resnet10, first-stage width 64, 62, 60, ... "
                                   "(one per client, decreasing by 2)", "metric": "auc",
                                   "augment": "random flips, rotation, translation, scaling"}


def _skd_preset(task: str, gamma: float, terms: list[str], iterations: int, sources: dict[str, str],
                experiment: dict[str, Any], description: str) -> Preset:
    """One task's preset: its ``gamma``, SKD ``terms`` and ``iterations`` (with their
    ``sources``) on the settings both tasks share."""
    return Preset(source=f"{_SKD_SOURCE}; {task}", train=dict(_SKD_TRAIN), description=description,
                  values={"gamma": gamma, "terms": terms, "stages": [1, 2, 3, 4], "skd_start": 0.0,
                          "iterations": iterations, "freeze_ktm_head": True},
                  sources={**_SKD_SOURCES, **sources}, experiment={**_SKD_EXPERIMENT, **experiment})


#: FedSKD's presets, one per task of the paper (its gamma, SKD terms, N and rounds differ);
#: no code by the authors was found, so there is no ``authors`` preset.
PRESETS: dict[str, Preset] = {
    "paper_asd": _skd_preset(
        "FedASD (ABIDE, Table I)", 1.0, ["batch", "pixel", "region"], 20,
        {"gamma": "paper: sec. III-B3 ('the balancing hyperparameter was empirically set to 1 for the ASD "
                  "classification task')",
         "terms": "paper: sec. III-C2, Table IVa (batch, voxel and region: the complete SKD, the best row); the "
                  "region term needs the entry's atlas, which the paper does not name (medfl's ABIDE bundle: CC200)",
         "iterations": _SKD_ITERATIONS.format("N = 4 regional clients, Table I: 20")},
        {"rounds": 40, "num_clients": 4, "partition": "natural: four geographic regions (Table I)",
         "input": "ReHo, DC, LFCD, VMHC stacked, resized to 48 x 48 x 48"},
        "the paper's autism task (FedASD: 4 regional clients, gamma 1, 5 x 4 iterations a round)"),
    "paper_skin": _skd_preset(
        "FedSkin (Derm7pt, Fig. 4)", 100.0, ["batch", "pixel"], 15,
        {"gamma": "paper: sec. III-B3 ('... and 100 for the skin lesion classification task')",
         "terms": "paper: sec. II-C ('if the dataset does not have predefined region masks, the region-wise "
                  "similarity loss is optional': Derm7pt has none) and Table IVb (batch and pixel, the best row)",
         "iterations": _SKD_ITERATIONS.format("N = 3 clients: 15")},
        {"rounds": 45, "num_clients": 3, "partition": {"name": "dirichlet", "alpha": "1.0 or 0.5"},
         "input": "dermoscopy at 224 x 224"},
        "the paper's skin task (FedSkin: 3 Dirichlet clients, gamma 100, 5 x 3 iterations a round)"),
}


# --------------------------------------------------------------------------- FedSKD

class FedSKD(Method):
    """FedSKD (Weng, Cai, Zhou; paper 004): P2P mutual learning with similarity distillation.

    Round t (rounds numbered from 1), for the sampled clients (all by default):

    1. Routing: the permutation O^t (:func:`permutation`) sends the latest DAM of client
       O^t(i) to client i, with the sender's model spec (so models may differ in width or
       architecture). The coordinator keeps the last DAM each client returned, only to route
       it; nothing is averaged. In round 1 no DAM exists yet: the instruction carries the
       sender's initialisation seed, and the receiver builds the sender's initial model
       exactly (the same seed the sender uses for its own DAM).
    2. At client i, if O^t(i) = i (self-consolidation): the DAM trains with CE alone.
       Otherwise mutual learning on client i's batches (eq. 2)::

           L = CE(DAM(x), y) + gamma * SKD(DAM, KTM) + CE(KTM(x), y)

       with the KTM's prediction head frozen (its feature extractor trains) and the SKD
       gradient flowing into both models (bidirectional transfer). SKD is eq. 15 on the
       stage outputs listed in ``stages`` (default all four ResNet stages), with the
       ``terms`` switched on; the region term needs ``atlas`` and is skipped without one.
    3. The client keeps its DAM (persistent client state), discards the KTM and sends the
       DAM back for routing in round t + 1.

    Evaluation: each client's own DAM (Local Test on its test split; the paper's Global
    Test is the engine's ``cross_test`` split).

    Args:
        gamma: weight of the SKD term (1 for ABIDE, 100 for Derm7pt in the paper).
        terms: the SKD terms to use (``batch``, ``pixel``, ``region``): the paper's Table IV.
        stages: 1-based stage outputs distilled (default all the model has): Table V.
        skd_start: fraction of the rounds after which SKD switches on (0, 0.25, 0.5, 0.75
            in Table VI). Before it the same mutual learning runs with gamma = 0: the KTM
            is still adapted to the receiving client ("standard P2P transfer with target
            client adaptation") but no similarity knowledge reaches the DAM.
        atlas: an atlas label volume on the input grid (NIfTI or ``.npy``), or a prepared
            manifest CSV naming one; the region term uses its area-fraction masks.
        atlas_labels: the atlas labels to use as regions (default: every label present).
        iterations: optimizer steps per round at each client (the paper: 5 x N); default
            ``train.epochs`` passes over the local training set.
        freeze_ktm_head: freeze the KTM's prediction head (the paper: yes).

    Presets (``{"name": "fedskd", "preset": ...}``): :data:`PRESETS`, one per task of the paper
    (``paper_asd``, ``paper_skin``: each its own gamma). The region term needs ``atlas`` in the
    entry (data, not a setting of the paper).
    """

    name = "fedskd"
    train_metrics = ENGINE_TRAIN_METRICS | {"ce_dam", "ce_ktm", "self_round", "skd_active",
                                            *(f"skd_{t}" for t in SKD_TERMS)}
    description = "FedSKD: P2P mutual learning with batch/pixel/region similarity distillation (paper 004)"
    presets = PRESETS
    # training skips batches of one (BatchNorm): a client needs two samples (checked before the run)
    min_train_samples = 2
    # the DAM it sends was never sent to it: quantization applies, update filters (DP) do not
    reply_state = {"dam": None}

    def __init__(self, gamma: float = 1.0, terms: list[str] | None = None, stages: list[int] | None = None,
                 skd_start: float = 0.0, atlas: str | None = None, atlas_labels: list[int] | None = None,
                 iterations: int | None = None, freeze_ktm_head: bool = True) -> None:
        self.gamma = float(gamma)
        if self.gamma < 0:
            raise MethodConfigError(f"gamma: expected a non-negative number, got {gamma!r}")
        self.terms = list(SKD_TERMS if terms is None else terms)
        bad = sorted(set(self.terms) - set(SKD_TERMS))
        if bad:
            raise MethodConfigError(f"terms: unknown SKD term(s) {bad}; valid: {', '.join(SKD_TERMS)}")
        if stages is not None and (not isinstance(stages, list) or not stages
                                   or not all(isinstance(s, int) and s >= 1 for s in stages)):
            raise MethodConfigError(f"stages: expected a non-empty list of 1-based stage numbers, got {stages!r}")
        self.stages = stages
        if not (0.0 <= float(skd_start) < 1.0):
            raise MethodConfigError(f"skd_start: expected a fraction of the rounds in [0, 1), got {skd_start!r}")
        self.skd_start = float(skd_start)
        self.atlas, self.atlas_labels = atlas, atlas_labels
        self.iterations = _check_iterations(iterations)
        self.freeze_ktm_head = bool(freeze_ktm_head)

    # ---------------------------------------------------------------- coordinator
    def setup(self, federation: Federation) -> None:
        """Nothing global: remember the federation; no client has sent a DAM yet."""
        super().setup(federation)
        self.dams: dict[str, State] = {}
        if "region" in self.terms and self.atlas:
            _masks(self.atlas, self.atlas_labels)  # fail before any training on a bad atlas

    def _init_seed(self, cid: str) -> int:
        return derive_seed(self.federation.seed, "init", cid)

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Route DAMs by the round's permutation (one instruction per sampled client)."""
        ids = self.federation.sample(round)
        order = permutation(ids, self.federation.seed, round)
        skd = round > int(np.floor(self.skd_start * self.federation.rounds + 1e-9))   # after skd_start x rounds
        out = {}
        for cid, sender in order.items():
            config: dict[str, Any] = {"self": sender == cid, "sender": sender, "round": round,
                                      "dam_seed": self._init_seed(cid), "skd": skd}
            payload: dict[str, Any] = {}
            if sender != cid:
                config.update(ktm_spec=json.dumps(self.federation.model_spec(sender), sort_keys=True),
                              ktm_seed=self._init_seed(sender))
                if sender in self.dams:
                    payload["ktm"] = self.dams[sender]
            out[cid] = Instruction(payload=payload, config=config)
        return out

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Keep each returned DAM for routing next round (no aggregation)."""
        for cid, reply in replies.items():
            self.dams[cid] = reply.payload["dam"]

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Each client evaluates its own DAM (the seed rebuilds it if never trained)."""
        return {cid: Instruction(config={"dam_seed": self._init_seed(cid)})
                for cid in self.federation.eval_client_ids}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the last DAM of each client (for routing)."""
        return {"dams": self.dams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the routing table of DAMs."""
        self.dams = dict(state.get("dams", {}))

    # ---------------------------------------------------------------- client
    def _dam(self, client: "ClientContext", config: dict[str, Any]) -> nn.Module:
        return _load(client.model_spec, int(config["dam_seed"]), client.state.get("dam"), client.device)

    def _selected(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.stages is None:
            return list(feats)
        bad = [s for s in self.stages if s > len(feats)]
        if bad:
            raise MethodConfigError(f"stages {bad}: the model has {len(feats)} stages")
        return [feats[s - 1] for s in self.stages]

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Mutual learning of the DAM with the received KTM (or self-consolidation)."""
        cfg = instruction.config
        dam = self._dam(client, cfg)
        ktm = None
        if not cfg["self"]:
            spec = json.loads(cfg["ktm_spec"])
            ktm = _load(spec, int(cfg["ktm_seed"]), instruction.payload.get("ktm"), client.device)
            if self.freeze_ktm_head:
                if getattr(ktm, "head_keys", None) is None:
                    raise MethodConfigError(f"{type(ktm).__name__} has no head_keys(): FedSKD needs a model "
                                            f"with a separable prediction head (the registered ResNets)")
                frozen = set(ktm.head_keys())
                for name, p in ktm.named_parameters():
                    p.requires_grad_(name not in frozen)
        params = list(dam.parameters()) + ([p for p in ktm.parameters() if p.requires_grad] if ktm else [])
        opt = make_optimizer(params, client.train)
        gamma = self.gamma if cfg.get("skd", True) else 0.0
        masks = _masks(self.atlas, self.atlas_labels) if "region" in self.terms else None
        active = [t for t in self.terms if t != "region" or masks is not None]
        names = ["loss", "ce_dam", "ce_ktm", *(f"skd_{t}" for t in active)]
        log = StepMeans()   # read every few steps, not every step: no wait for the GPU each step
        scaler = grad_scaler(client.device)   # train.amp fp16 (None otherwise)
        for x, y in _batches(client, self.iterations):
            x, y = x.to(client.device), y.to(client.device)
            opt.zero_grad(set_to_none=True)
            with autocast():   # train.amp: the forward passes in bf16/fp16; the losses in float32
                logits_d, feats_d = dam.forward_features(x)
                if ktm is not None:
                    logits_k, feats_k = ktm.forward_features(x)
            ce_d = F.cross_entropy(logits_d.float(), y)
            loss = ce_d
            logged: dict[str, torch.Tensor] = {}
            if ktm is not None:
                ce_k = F.cross_entropy(logits_k.float(), y)
                loss = loss + ce_k
                logged["ce_ktm"] = ce_k
                if gamma > 0:
                    skd, parts = skd_loss([f.float() for f in self._selected(feats_d)],
                                          [f.float() for f in self._selected(feats_k)], terms=self.terms, masks=masks,
                                          read=False)
                    loss = loss + gamma * skd
                    logged.update({f"skd_{t}": v for t, v in parts.items()})
            backward_step(loss, opt, scaler)
            log.add(loss=loss, ce_dam=ce_d, **logged)
        client.state["dam"] = state = get_state(dam)
        means = log.means()
        metrics = {k: means.get(k, 0.0) for k in names}
        metrics.update(steps=float(log.steps), self_round=float(bool(cfg["self"])), skd_active=float(gamma > 0))
        return Reply(payload={"dam": state}, metrics=metrics, num_examples=client.num_examples("train"))

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The client's own DAM."""
        return self._dam(client, instruction.config)


# --------------------------------------------------------------------------- FedCross

class _FineTuning(Method):
    """What both FedCross baselines share: the models are fine-tuned with cross-entropy alone
    where they arrive, ``iterations`` steps (default ``train.epochs`` passes) at each client."""

    min_train_samples = 2   # as FedSKD: batches of one are skipped

    def __init__(self, iterations: int | None = None) -> None:
        self.iterations = _check_iterations(iterations)

    def _fine_tune(self, model: nn.Module, client: "ClientContext") -> dict[str, float]:
        """Train ``model`` on the client's batches; its mean loss and the number of steps."""
        opt = make_optimizer(model.parameters(), client.train)
        log = StepMeans()
        model.train()
        scaler = grad_scaler(client.device)
        for x, y in _batches(client, self.iterations):
            x, y = x.to(client.device), y.to(client.device)
            opt.zero_grad(set_to_none=True)
            with autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            backward_step(loss, opt, scaler)
            log.add(loss=loss)
        return {"loss": log.means().get("loss", 0.0), "steps": float(log.steps)}


class FedCross(_FineTuning, HeldModel):
    """FedCross as the FedSKD paper uses it: one model circulated sequentially through the
    clients, each fine-tuning it on its own data; no aggregation.

    Each round visits every sampled client once, in an order drawn from
    ``(seed, "perm", round)``: the engine runs the round as one step per client
    (:meth:`round_steps`), each step sending the current model to the next client and taking
    back its fine-tuned copy. Every client evaluates the model as it is after the round.
    Homogeneous only (one model); per-client model overrides are refused.

    Args:
        iterations: optimizer steps at each visited client (the paper: 5 per client, so
            5 x N per round); default ``train.epochs`` passes.
    """

    name = "fedcross"
    description = "FedCross: one model fine-tuned sequentially through the clients (P2P baseline of paper 004)"
    reply_state = {"model": "model"}

    def setup(self, federation: Federation) -> None:
        """The single circulating model, initialised from the run seed."""
        super().setup(federation)
        if federation.client_models:
            raise MethodConfigError("fedcross circulates one model; client_models (heterogeneous models) "
                                    "needs fedcross_het or fedskd")
        self.model_state = get_state(federation.build_model())
        self._order: list[str] = []
        self._hop = 0

    def round_steps(self, round: int) -> int:
        """One step per sampled client: the model visits them one after another."""
        self._order = [cid for _, cid in sorted(permutation(self.federation.sample(round),
                                                            self.federation.seed, round).items(),
                                                key=lambda kv: (len(kv[0]), kv[0]))]
        self._hop = 0
        return len(self._order)

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Send the model to the next client of this round's order."""
        if not self._order or self._hop >= len(self._order):
            self.round_steps(round)
        cid = self._order[self._hop]
        return {cid: Instruction(payload={"model": self.model_state}, config={"hop": self._hop})}

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Take the fine-tuned model as the circulating model (a missing reply: keep it)."""
        super().server_update(round, replies)
        self._hop += 1

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Fine-tune the received model on the local data and send it on."""
        model = client.load_model(instruction.payload["model"])
        stats = self._fine_tune(model, client)
        return Reply(payload={"model": get_state(model)}, metrics=stats,
                     num_examples=client.num_examples("train"))


class FedCrossHet(_FineTuning):
    """FedCross-dagger of the FedSKD paper: heterogeneous models circulating P2P, plain
    fine-tuning, no distillation.

    Each client starts with a model of its own spec (``client_models``). Every round the same
    permutation as FedSKD (:func:`permutation`) sends the model client O^t(i) holds to client
    i, which fine-tunes it on its own data with cross-entropy, keeps it (persistent client
    state, with its spec) and evaluates it; next round that model moves on. The models
    therefore keep their architectures but change hands, as a single FedCross model does,
    N of them at once. The coordinator holds each client's last model only to route it.

    Args:
        iterations: optimizer steps per round at each client (the paper: 5 x N).
    """

    name = "fedcross_het"
    description = "FedCross-dagger: heterogeneous models circulated P2P and fine-tuned (baseline of paper 004)"
    # a client's first model is built from a seed, not received: no reference for update filters
    reply_state = {"model": None}

    def setup(self, federation: Federation) -> None:
        """Every client's model is its own initial model, not yet sent."""
        super().setup(federation)
        self.models: dict[str, State] = {}
        self.specs = {cid: json.dumps(federation.model_spec(cid), sort_keys=True)
                      for cid in federation.eval_client_ids}
        self.seeds = {cid: derive_seed(federation.seed, "init", cid) for cid in federation.eval_client_ids}

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Send each client the model its sender holds (its spec and seed as config)."""
        order = permutation(self.federation.sample(round), self.federation.seed, round)
        out = {}
        for cid, sender in order.items():
            payload = {"model": self.models[sender]} if sender in self.models else {}
            out[cid] = Instruction(payload=payload, config={"spec": self.specs[sender], "seed": self.seeds[sender],
                                                            "sender": sender, "self": sender == cid})
        return out

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Record who holds which model now (the spec travels with the model)."""
        order = permutation(self.federation.sample(round), self.federation.seed, round)
        specs, seeds = dict(self.specs), dict(self.seeds)
        for cid, reply in replies.items():
            sender = order[cid]
            self.models[cid] = reply.payload["model"]
            specs[cid], seeds[cid] = self.specs[sender], self.seeds[sender]
        self.specs, self.seeds = specs, seeds

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Each client evaluates the model it holds (its spec and seed as config)."""
        return {cid: Instruction(config={"spec": self.specs[cid], "seed": self.seeds[cid]})
                for cid in self.federation.eval_client_ids}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: the routed models and who holds which architecture."""
        return {"models": self.models, "specs": dict(self.specs), "seeds": dict(self.seeds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the routing table."""
        self.models = dict(state["models"])
        self.specs = dict(state["specs"])
        self.seeds = {k: int(v) for k, v in state["seeds"].items()}

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Fine-tune the received model, keep it, send it on."""
        cfg = instruction.config
        spec = json.loads(cfg["spec"])
        state = instruction.payload.get("model")
        if cfg["self"] and "model" in client.state:
            state = client.state["model"]
        model = _load(spec, int(cfg["seed"]), state, client.device)
        stats = self._fine_tune(model, client)
        new = get_state(model)
        client.state.update(model=new, spec=cfg["spec"], seed=int(cfg["seed"]))
        return Reply(payload={"model": new}, metrics=stats, num_examples=client.num_examples("train"))

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The model this client holds."""
        held = client.state if "model" in client.state else instruction.config   # its spec and seed
        return _load(json.loads(held["spec"]), int(held["seed"]), held.get("model"), client.device)


@hookimpl
def register_methods(register: Any) -> None:
    """Register FedSKD and the two FedCross baselines."""
    for cls in (FedSKD, FedCross, FedCrossHet):
        register(cls)
