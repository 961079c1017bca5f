"""FedTPF (paper 003), Algorithm 1: the coordinator's and the clients' steps, each named after
its line of the algorithm box (the package's docstring lists the other parts)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader

from medfl.losses.feature_distill import (class_prototypes, decay_weights, performance_change, residual_cosine,
                                          stop_condition_check)
from medfl.messages import RELEASE_CLIP, RELEASE_FLAG, Instruction, Reply, state_mismatch
from medfl.method import ENGINE_TRAIN_METRICS, ClientContext, Federation, Method, derive_seed
from medfl.models.feature_distill import distill_step, parameters_of
from medfl.privacy.feature_release import perturb_features
from medfl.training import StepMeans, get_state, make_optimizer, train_epochs, weighted_average
from medfl_plugins.fedtpf.models import (IntLabels, MixedBatches, SharedSet, State, client_nets, client_scale,
                                         distill_nets, input_scale, own_statistics, pack, residuals, standardized)
from medfl_plugins.fedtpf.presets import PAPER_PRESET, Settings
from medfl_plugins.fedtpf.records import VALIDATION_KEYS, as_float
from medfl_plugins.fedtpf.release import FeatureRelease

__all__ = ["FedTPF", "STAGES"]

#: the stages an instruction's ``config["stage"]`` names
STAGES = ("distill", "release", "train")


def _size(client: ClientContext, split: str) -> int:
    """Samples in the client's ``split``; 0 when it has no such split."""
    try:
        return int(client.num_examples(split))
    except KeyError:
        return 0


def _noise_to_signal(noise: torch.Tensor, signal: torch.Tensor) -> float:
    """The mean per-sample L2 norm of ``noise`` over ``signal``'s (``(N, ...)`` each; a mean
    is 0 without samples), NaN when the signal's is 0 (no finite ratio to report)."""
    noise_norm, signal_norm = (float(t.flatten(1).double().norm(dim=1).mean()) if t.shape[0] else 0.0
                               for t in (noise, signal))
    return noise_norm / signal_norm if signal_norm > 0 else math.nan


def _accuracy(cls: nn.Module, x: torch.Tensor, y: torch.Tensor, device: Any) -> float:
    """The classifier's accuracy (eval mode) on ``x`` against ``y``, in batches of 256."""
    cls.eval()
    with torch.no_grad():
        pred = torch.cat([cls(b.to(device)).argmax(1).cpu() for b in x.split(256)])
    return float((pred == y).float().mean())


class FedTPF(FeatureRelease, Settings, Method):
    """FedTPF (paper 003), Algorithm 1: two stages keyed on the round.

    Stage 1, rounds 1 .. T_d (at most ``distill_rounds``):

    * the server samples C_t and sends phi^r, w^t, theta^t (:meth:`configure_round`);
    * ClientTraining(k, phi^r, D^k), the prototypes omega_k (eq. 5) from the trained phi,
      LocalDisTraining on eq. 7 (eqs. 1-2 and 6) with x_p as the release perturbs it
      (:meth:`client_update`, :meth:`_distill_locally`);
    * AGG: phi by FedAvg, the distillation model (w, theta, the critic) by
      ``n_k * alpha_k(t)`` (eq. 8) (:meth:`server_update`);
    * "if all accuracy[k] >= threshold": each client tests the aggregated model on its own
      validation split against Sec. III-D's stop condition and freezes once it holds; eq. 9's
      ``Delta_perf`` from the accuracies (:meth:`client_validate`, :meth:`server_validate`).

    Transition, "Distribute D^s to all clients" (Sec. III-E, IV-B: ``x_p = x_s + n``): the
    next round's first step; every training client returns ``x_s`` (:meth:`_release`), medfl
    performs the release :meth:`release_plan` declares, the coordinator builds D^s
    (:meth:`_build_shared`).

    Stage 2, t = T_d .. T_r: ClientTraining(k, phi^r, D^k union D^s) (:meth:`_train_stage2`)
    and AGG by FedAvg (:meth:`server_update`).

    Choices and deviations (docs/fedtpf.md gives each with its reasons and numbers, and the
    ablations): T_d is a cap (a client that never meets the stop condition stops at
    ``"cap"``); the stop condition's window counts rounds, its accuracy read on ``stop_on``;
    eq. 8 as printed by default (``decay_reading``), a round late (round t aggregates with
    the ``Delta_perf`` measured after round t - 1); the default release is a DP one (clip and
    Gaussian noise at ``epsilon``; the paper's fixed variance on unclipped ``x_s`` is the
    ``"paper"`` preset); the distillation model works on the ``standardize`` scale and each
    client takes D^s into its own input coordinates in stage 2; the critic is aggregated and
    trained with Adam; small conv VAE and critic, latent size the task model's ``embed_dim``;
    ``distill_steps`` and ``mix`` are not in the paper; D^s travels in every stage-2
    instruction; the run is scored from the release round (:meth:`scored_from`).
    """

    name = "fedtpf"
    description = "FedTPF: prototype-regularised VAE-WGAN-GP feature distillation, adaptive decay, DP shared set"
    presets = {"paper": PAPER_PRESET}
    # stage 1: phi's training, the distillation terms (distill_step's, prefixed) or "frozen";
    # stage 2: the shared set's share; the release: its norms, noise and clipping
    train_metrics = ENGINE_TRAIN_METRICS | {
        *(f"distill_{t}" for t in ("loss", "vae", "wgan_generator", "critic", "prototype", "ce",
                                   "residual_accuracy", "residual_norm_ratio", "steps")),
        "frozen", "shared_samples", "shared_fraction", "shared_mean_gap",
        "released", "x_norm", "x_s_norm", "x_s_norm_ratio", "epsilon", "noise_std", "clipped_fraction",
        "signal_norm", "noise_norm", "noise_to_signal"}
    validate_metrics = frozenset({"converged", *VALIDATION_KEYS})

    def scored_from(self, round: int) -> int | None:
        """The release round, the first whose task model was trained with the shared set
        (the transition round's training step, stage 2's first), once it has happened;
        ``None`` before (stage 1's task model is plain FedAvg)."""
        return self.release_round if self.release_round and round >= self.release_round else None

    def round_releases(self, round: int) -> list[str]:
        """The clients asked for the release in ``round`` (the transition round's first step)."""
        return list(self.released) if self.release_round == round else []

    # ------------------------------------------------------------------ coordinator
    def setup(self, federation: Federation) -> None:
        """Initialization: phi^0 and the distillation model w^0, theta^0 (seeded), the stage-1
        bookkeeping."""
        super().setup(federation)
        self._check_federation(federation)
        phi = federation.build_model()
        self.global_state = get_state(phi)
        cls = federation.build_model(seed_tag="fedtpf_classifier")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(federation.seed, "fedtpf_distill"))
            vae, critic = distill_nets(federation.in_channels, federation.spatial_dims, int(phi.embed_dim),
                                       self.net_sizes)
        self.load_state_dict({"global": self.global_state, "distill": pack(vae, critic, cls), "stage": "distill",
                              "pending_release": False, "stopped_at": {}, "p_prev": {}, "delta_perf": 0.0, "log": [],
                              "release_round": 0, "released": [], "transition": {}, "release_stats": {},
                              "shared_x": torch.zeros(0), "shared_y": torch.zeros(0, dtype=torch.long)})
        self._rows: list[dict[str, Any]] = []
        self._rows_round = 0
        self._update_clip()

    def round_steps(self, round: int) -> int:
        """Two steps in the transition round (the release, then training), one otherwise."""
        return 2 if self.pending_release else 1

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Stage 1: phi and the distillation model to the sampled clients; the transition's
        first step: the distillation model to every training client, asking for the
        release; stage 2: phi and D^s to the sampled clients."""
        if self._rows_round != round:
            self._rows, self._rows_round = [], round
        if self.pending_release:
            self.release_round, self.released = round, list(self.federation.client_ids)
            ins = Instruction(payload={"distill": self.distill_state},
                              config={"stage": "release", RELEASE_FLAG: True, **self._clip_config(),
                                      **({RELEASE_CLIP: self.clip_now} if self.clip == "public_quantile" else {})})
            return {cid: ins for cid in self.released}
        sampled = self.federation.sample(round)
        if self.stage == "distill":
            ins = Instruction(payload={"model": self.global_state, "distill": self.distill_state},
                              config={"stage": "distill", **self._clip_config()})
        else:
            ins = Instruction(payload={"model": self.global_state, "shared_x": self.shared_x,
                                       "shared_y": self.shared_y}, config={"stage": "train"})
        return {cid: ins for cid in sampled}

    def alphas(self, round: int, client_ids: list[str]) -> dict[str, float]:
        """Eq. 8's ``alpha_k`` for ``round`` (1 for every client without ``decay``)."""
        if not self.decay:
            return {cid: 1.0 for cid in client_ids}
        stopped = {cid: self.stopped_at.get(cid) for cid in client_ids}
        return decay_weights(stopped, round, self.delta_perf, self.decay_lambda, self.decay_reading,
                             self.delta_used)

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """AGG. Stage 1: FedAvg of phi, the distillation models averaged by ``n_k *
        alpha_k(t)`` (eq. 8), the end of stage 1 at the cap T_d; the release step: build D^s;
        stage 2: FedAvg of phi."""
        if self.pending_release:
            self._build_shared(round, replies)
            return
        if not replies:
            return
        self.global_state = weighted_average([r.payload["model"] for r in replies.values()],
                                             [float(r.num_examples) for r in replies.values()])
        if self.stage != "distill":
            self._record_mix(replies)
            return
        self.delta_used[round] = self.delta_perf
        alpha = self.alphas(round, list(replies))
        weights = [float(r.num_examples) * alpha[cid] for cid, r in replies.items()]
        if sum(weights) > 0:
            self.distill_state = weighted_average([r.payload["distill"] for r in replies.values()], weights)
        self._update_clip()
        frozen = sorted(cid for cid in replies if self.stopped_at.get(cid, round + 1) <= round)
        self.log.append({"round": round, "alpha": {cid: alpha[cid] for cid in replies},
                         "delta_perf_used": self.delta_perf, "frozen": frozen, **self._clip_config()})
        self._record_decay(replies, alpha, frozen)
        if round >= self.distill_rounds:
            self._transition(round, "round cap (distill_rounds) reached")

    def _transition(self, round: int, reason: str) -> None:
        """Stage 1 ends: the next round releases D^s."""
        if not self.pending_release and self.stage == "distill":
            self.pending_release = True
            self.transition = {"after_round": round, "reason": reason,
                               "converged": sorted(self.stopped_at), "clients": len(self.federation.client_ids)}

    def check_reply(self, client_id: str, instruction: Instruction, reply: Reply) -> str:
        """A site may send anything: stage 1 and 2 replies must return the models they were
        sent (same keys, shapes, dtypes); a release must hold the features and labels
        :meth:`_release_problem` checks. A reply that fails is dropped from the round by the engine."""
        if instruction.config.get("stage") == "release":
            return self._release_problem(reply)
        for key in ("model", "distill"):
            if key in instruction.payload:
                problem = state_mismatch(reply.payload.get(key), instruction.payload[key], key)
                if problem:
                    return problem
        return ""

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """Stage 1 (stop condition or decay on): the aggregated distillation model to every
        training client."""
        if self.stage != "distill" or self.pending_release or not (self.stop_condition or self.decay):
            return {}
        ins = Instruction(payload={"distill": self.distill_state}, config={"stage": "validate", **self._clip_config()})
        return {cid: ins for cid in self.federation.client_ids}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Eq. 9's ``Delta_perf(round)`` over the sampled clients still distilling, the
        clients that stopped, the transition when all did."""
        p_now = {cid: as_float(m.get(self._stop_key())) for cid, m in results.items()}
        p_now = {cid: v for cid, v in p_now.items() if 0.0 <= v <= 1.0}
        sampled = self.federation.sample(round)
        distilling = [cid for cid in sampled if self.stopped_at.get(cid, round + 1) > round]
        self.delta_perf = performance_change(p_now, self.p_prev, distilling)
        self.p_prev = p_now
        if self.stop_condition:
            for cid, m in results.items():
                if as_float(m.get("converged")) == 1.0 and cid not in self.stopped_at:
                    self.stopped_at[cid] = round + 1
        if self.log and self.log[-1]["round"] == round:
            self.log[-1].update({"delta_perf": self.delta_perf,
                                 "mean_residual_accuracy": (sum(p_now.values()) / len(p_now)) if p_now else None,
                                 "converged": len(self.stopped_at)})
        if self.stop_condition and all(cid in self.stopped_at for cid in self.federation.client_ids):
            self._transition(round, "every client met the stop condition")
        self._record_validation(round, results)

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Every client evaluates the global task model phi."""
        ins = Instruction(payload={"model": self.global_state})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def state_dict(self) -> dict[str, Any]:
        """phi, the distillation model, the stage, D^s and the bookkeeping: each client's stop
        round, eq. 9's last accuracies and ``Delta_perf`` (and the one each stage-1 round
        aggregated with, ``delta_used``), each client's validation scalars round by round
        (``history``), the warnings said (each kind once), the release's record."""
        return {"global": self.global_state, "distill": self.distill_state, "stage": self.stage,
                "pending_release": self.pending_release, "stopped_at": dict(self.stopped_at),
                "p_prev": dict(self.p_prev), "delta_perf": self.delta_perf,
                "delta_used": {str(k): v for k, v in self.delta_used.items()}, "log": self.log,
                "release_round": self.release_round, "released": list(self.released),
                "transition": self.transition, "release_stats": self.release_stats,
                "history": self.history, "warned": list(self.warned), "clip_now": self.clip_now,
                "shared_x": self.shared_x, "shared_y": self.shared_y}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.global_state, self.distill_state = state["global"], state["distill"]
        self.stage, self.pending_release = str(state["stage"]), bool(state["pending_release"])
        self.stopped_at = {str(k): int(v) for k, v in state["stopped_at"].items()}
        self.p_prev = {str(k): float(v) for k, v in state["p_prev"].items()}
        self.delta_perf = float(state["delta_perf"])
        self.delta_used = {int(k): float(v) for k, v in state.get("delta_used", {}).items()}
        self.log, self.transition = list(state["log"]), dict(state["transition"])
        self.release_round, self.released = int(state["release_round"]), [str(c) for c in state["released"]]
        self.release_stats = dict(state["release_stats"])
        self.history = {str(k): [dict(r) for r in v] for k, v in state.get("history", {}).items()}
        self.warned = [str(w) for w in state.get("warned", [])]
        self.clip_now = float(state.get("clip_now", self.clip_now))
        self.shared_x, self.shared_y = state["shared_x"], state["shared_y"]

    # ------------------------------------------------------------------ client
    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """By stage: ``distill`` replies the task model and the distillation state, ``train``
        the task model, ``release`` the released features and labels (the default's)."""
        keys = {"distill": {"model", "distill"}, "train": {"model"}}.get(instruction.config.get("stage"))
        return super().reply_keys(instruction) if keys is None else frozenset(keys)

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """The stage the instruction names: ``release`` (:meth:`_release`), ``train`` (stage 2)
        or ``distill``: ClientTraining(k, phi^r, D^k) (``fl.train.epochs`` of SGD), then
        LocalDisTraining unless this client froze its distillation model."""
        stage = instruction.config.get("stage")
        if stage == "release":
            return self._release(client, instruction)
        if stage not in ("distill", "train"):
            raise ValueError(f"method {self.name!r}: instruction stage must be one of {STAGES}, got {stage!r}")
        phi = client.load_model(instruction.payload["model"])
        opt = make_optimizer(phi.parameters(), client.train)
        epochs = int(client.train.get("epochs", 1))
        if stage == "train":
            return self._train_stage2(client, instruction, phi, opt, epochs)
        stats = train_epochs(phi, client.loader("train"), opt, epochs, device=client.device,
                             clip_grad_norm=client.train.get("clip_grad_norm"))
        mine = client.state.get("fedtpf", {})
        if "frozen" in mine:
            distill, dstats = mine["frozen"], {"frozen": 1.0}
        else:
            distill, dstats = self._distill_locally(client, phi, instruction.payload["distill"],
                                                    self._client_clip(instruction))
        return Reply(payload={"model": get_state(phi), "distill": distill}, metrics={**stats, **dstats},
                     num_examples=client.num_examples("train"))

    def _train_stage2(self, client: ClientContext, instruction: Instruction, phi: nn.Module,
                      opt: torch.optim.Optimizer, epochs: int) -> Reply:
        """Stage 2, ClientTraining(k, phi^r, D^k union D^s): phi on the union, shuffled
        together (``mix=None``) or in batches holding a share ``mix`` of shared samples, with
        D^s taken into this client's input coordinates, ``x_shared * std + mean``
        (:func:`~medfl_plugins.fedtpf.models.input_scale`). ``shared_mean_gap``: the mapped
        D^s's per-channel mean's distance from that mean, in this client's stds."""
        shared_x = instruction.payload["shared_x"]
        scale = input_scale(self.standardize, client)
        gap = math.nan
        if scale is not None and shared_x.numel():
            mean, std = scale
            shared_x = shared_x.to(std.device).float() * std + mean
            own = None if isinstance(self.standardize, dict) else own_statistics(client)
            spread = std if own is None else torch.tensor(own["std"]).view_as(std).to(std.device)
            dims = [0, *range(2, shared_x.dim())]
            gap = float(((shared_x.mean(dim=dims, keepdim=True) - mean).abs() / spread).mean())
        shared = SharedSet(shared_x.cpu(), instruction.payload["shared_y"])
        bs = int(client.train.get("batch_size", 16))
        g = torch.Generator().manual_seed(derive_seed(client.seed, "union"))
        clip_grad = client.train.get("clip_grad_norm")
        if self.mix is None:
            union = ConcatDataset([IntLabels(client.dataset("train")), shared])
            loader = DataLoader(union, batch_size=bs, shuffle=True, generator=g,
                                num_workers=int(client.train.get("num_workers", 0)))
            stats = train_epochs(phi, loader, opt, epochs, device=client.device, clip_grad_norm=clip_grad)
            n_local = client.num_examples("train")
            fraction = len(shared) / (len(shared) + n_local) if len(shared) + n_local else 0.0
        else:
            per_batch = int(round(self.mix * bs))
            mixed = MixedBatches(client.loader("train", batch_size=bs - per_batch), shared, per_batch, g)
            stats = train_epochs(phi, mixed, opt, epochs, device=client.device, clip_grad_norm=clip_grad)
            seen = mixed.shared_seen + mixed.local_seen
            fraction = mixed.shared_seen / seen if seen else 0.0
        stats = {**stats, "shared_samples": float(len(shared)), "shared_fraction": fraction}
        if math.isfinite(gap):
            stats["shared_mean_gap"] = gap
        return Reply(payload={"model": get_state(phi)}, metrics=stats, num_examples=client.num_examples("train"))

    def _distill_locally(self, client: ClientContext, phi: nn.Module, distill: State, clip: float | None
                         ) -> tuple[State, dict[str, float]]:
        """The local prototypes omega_k from the trained phi (eq. 5), then LocalDisTraining:
        ``distill_epochs`` of eq. 7 (at least ``distill_steps`` steps)."""
        vae, critic, cls = client_nets(client, distill, self.net_sizes)
        protos = present = None
        if self.lambda_proto > 0:
            phi.eval()
            embs, labels = [], []
            with torch.no_grad():
                for x, y in client.loader("train", augment=False, shuffle=False):
                    embs.append(phi.embed(x.to(client.device)).float())
                    labels.append(torch.as_tensor(y).to(client.device))
            protos, present = class_prototypes(torch.cat(embs), torch.cat(labels), int(cls.head.out_features))
        vae.train(), critic.train(), cls.train()
        params = list(parameters_of(vae, cls))
        opt_model = (torch.optim.Adam(params, lr=self.distill_lr) if self.distill_optimizer == "adam"
                     else torch.optim.SGD(params, lr=self.distill_lr))
        opt_critic = torch.optim.Adam(critic.parameters(), lr=self.distill_lr, betas=(0.5, 0.9))
        g = torch.Generator().manual_seed(derive_seed(client.seed, "distill"))
        perturb = self._perturb(g, clip)
        weights = self.weights()
        log = StepMeans()   # the terms read every few steps, not every step
        loader = client.loader("train")
        scale = client_scale(self.standardize, client)
        epoch = 0
        while epoch < self.distill_epochs or log.steps < self.distill_steps:
            before = log.steps
            for x, y in loader:
                x, y = standardized(x.to(client.device), scale), torch.as_tensor(y).to(client.device)
                out = distill_step(vae, critic, cls, x, y, protos, present, weights, opt_model,
                                   opt_critic if weights.wgan > 0 else None, g, perturb=perturb, read=False)
                log.add(len(y), **out)
                if epoch >= self.distill_epochs and log.steps >= self.distill_steps:
                    break
            epoch += 1
            if log.steps == before:   # no batch at all: nothing to train on
                break
        return pack(vae, critic, cls), {**{f"distill_{key}": v for key, v in log.means().items()},
                                        "distill_steps": float(log.steps), "frozen": 0.0}

    def client_validate(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
        """``p_k``: the global distillation model's residual accuracy on this client's ``val``
        split (``test`` without one) on ``x_s`` and on ``x_p`` (``x_s`` perturbed as the
        release would, a seeded draw), the cosine of ``x_hat`` and ``x_s``, the noise's mean
        norm over the (clipped) signal's, the clipped fraction, the share of the split's most
        common class, and Sec. III-D's stop condition over this client's history
        (``converged`` 1 once met, the model frozen then; ``unmet`` the index in
        :data:`~medfl.losses.feature_distill.STOP_CRITERIA` of the first criterion not met)."""
        split = "val" if _size(client, "val") > 0 else "test"
        if _size(client, split) == 0:
            return {"residual_accuracy": math.nan, "cosine": math.nan, "converged": 0.0}
        distill = instruction.payload["distill"]
        vae, _, cls = client_nets(client, distill, self.net_sizes)
        scale = client_scale(self.standardize, client)
        x, x_hat, y = residuals(client, vae, split, scale)
        x_s = x - x_hat
        clip = self._client_clip(instruction)
        g = torch.Generator().manual_seed(derive_seed(client.seed, "validate_noise"))
        flat = x_s.flatten(1)
        signal = flat if clip is None else perturb_features(flat, clip=clip, noise=0.0, mechanism=self.mechanism)
        x_p = perturb_features(x_s, clip=clip, noise=self.noise_scale(clip), mechanism=self.mechanism, generator=g)
        acc, acc_p = _accuracy(cls, x_s, y, client.device), _accuracy(cls, x_p, y, client.device)
        signed = residual_cosine(x_hat, x_s)
        cos = residual_cosine(x_hat, x_s, absolute=True) if self.cosine_reading == "absolute" else signed
        order = 2 if self.mechanism == "gaussian" else 1
        clipped = 0.0 if clip is None else float((flat.norm(p=order, dim=1) > clip).float().mean())
        noise = x_p.flatten(1) - signal
        # the same ratio on the engine's input scale (x = std * x' + mean: noise and signal times std)
        std = None if scale is None else scale[1].cpu()
        signal_in = signal if std is None else (signal.view_as(x_s) * std).flatten(1)
        noise_in = noise if std is None else (noise.view_as(x_s) * std).flatten(1)
        met, code = self._stop_condition(client, distill, acc_p if self.stop_on == "x_p" else acc, cos, len(y))
        return {"residual_accuracy": acc, "cosine": cos, "cosine_signed": signed, "converged": 1.0 if met else 0.0,
                "residual_accuracy_p": acc_p, "unmet": float(code),
                "noise_to_signal": _noise_to_signal(noise, signal),
                "noise_to_signal_input": _noise_to_signal(noise_in, signal_in),
                "clipped_fraction": clipped,
                "majority_share": float(torch.bincount(y).max()) / len(y)}

    def _stop_condition(self, client: ClientContext, distill: State, accuracy: float, cosine: float,
                        support: int) -> tuple[bool, int]:
        """Sec. III-D's threshold condition on this client's history (kept in its state) with
        this validation's ``accuracy`` and ``cosine`` added: whether it is met (now or
        before; met, the client freezes ``distill``) and the first unmet criterion's index."""
        mine = dict(client.state.get("fedtpf", {}))
        mine["acc"] = [*mine.get("acc", []), accuracy]
        mine["cos"] = [*mine.get("cos", []), cosine]
        met = "frozen" in mine
        code = 0
        if not met:
            code, _ = stop_condition_check(mine["acc"], mine["cos"], target=self.target_accuracy,
                                           tol=self.tolerance, max_cosine=self.max_cosine, window=self.window,
                                           max_change=self.max_change, cosine_reading=self.cosine_reading,
                                           change_reading=self.change_reading,
                                           support=support if self.accuracy_ci == "wilson" else None)
            if code == 0 and self.stop_condition:
                met = True
                mine["frozen"], mine["frozen_round"] = dict(distill), client.round
        client.state["fedtpf"] = mine
        return met, code

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """The global task model phi."""
        return client.load_model(instruction.payload["model"])
