"""FedTPF (paper 003) and its baseline FedFed (Yang et al., NeurIPS 2023): a feature-distillation
model trained in federation, then a differentially private shared set of distilled features
that every client trains on beside its own data.

The method is :class:`FedTPF`; its docstring gives the algorithm, every choice the paper
leaves open and every deviation. :class:`FedFed` is the same code with FedTPF's additions
switched off. The pieces are reusable: the loss terms and decay weights
(:mod:`medfl.losses.feature_distill`), the networks and one distillation step
(:mod:`medfl.models.feature_distill`), the release (:mod:`medfl.privacy.feature_release`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from medfl import hookimpl
from medfl.engine.training import StepMeans, get_state, make_optimizer, train_epochs, weighted_average
from medfl.filters import Release
from medfl.losses.feature_distill import (
    class_prototypes,
    decay_weights,
    distillation_converged,
    performance_change,
    residual_cosine,
)
from medfl.messages import RELEASE_FLAG, Instruction, Reply, state_mismatch
from medfl.method import Federation, Method, MethodConfigError, derive_seed
from medfl.models.feature_distill import Critic, DistillVAE, DistillWeights, distill_step, parameters_of
from medfl.privacy.accounting import PrivacyConfigError, check_budget, noise_for_epsilon
from medfl.privacy.feature_release import MECHANISMS, perturb_features, release_features, release_noise

if TYPE_CHECKING:  # pragma: no cover
    from medfl.context import ClientContext

__all__ = ["FedTPF", "FedFed", "SharedSet", "register_methods"]

State = dict[str, torch.Tensor]
#: the stages an instruction's ``config["stage"]`` names
STAGES = ("distill", "release", "train")


class SharedSet(Dataset):
    """The shared set ``D^s`` at a client: ``(x_p, label)`` items like a client dataset's."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x.float(), y.long()

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def _sub(state: State, prefix: str) -> State:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _size(client: ClientContext, split: str) -> int:
    """Samples in the client's ``split``; 0 when it has no such split."""
    try:
        return int(client.num_examples(split))
    except KeyError:
        return 0


def _as_float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


class FedTPF(Method):
    """FedTPF (paper 003, Algorithm 1): two stages keyed on the round.

    **Stage 1** (feature distillation, rounds 1 .. at most ``distill_rounds``). The sampled
    clients receive the task model phi, and the distillation model: the VAE generator q
    (theta), the WGAN-GP critic and the residual classifier w (the task model's architecture,
    a separate instance). Each trains phi for ``fl.train.epochs`` on its data (FedAvg), then
    computes its class prototypes (eq. 5) from the *trained* phi's embeddings of its
    training samples (without augmentation; they never leave the client), then trains the
    distillation model for ``distill_epochs`` on eq. 7: ``lambda_vae`` (reconstruction + KL) +
    ``lambda_wgan`` (WGAN-GP; the critic is trained first on each batch with penalty weight
    ``gp_weight``) + ``lambda_proto`` L_po (eq. 6) + ``lambda_ce`` CE of w on ``x_p = clip(x_s)
    + n``, ``x_s = x - x_hat``, clipped and noised exactly as the release will be (the paper's
    classifier sees the protected features; Adam with ``distill_lr``, the critic with betas
    (0.5, 0.9) as WGAN-GP). It replies phi and the distillation model (``distill``: keys
    ``vae.``, ``critic.``, ``cls.``). The coordinator averages phi by ``num_examples`` and the
    distillation model by ``num_examples * alpha_k(t)`` (eq. 8).

    The validation exchange after each stage-1 round sends the aggregated distillation model
    to every training client, which scores it on its own ``val`` split (``test`` when it has
    none): the residual classifier's accuracy on ``x_s`` and the cosine of ``x_hat`` and ``x_s``
    (eq. 9's ``p_k(t)``; reconstructions from the mean code ``mu``, no sampling, no noise:
    the paper states the condition "on x_s"). The client keeps its own history and applies
    the stop condition (:func:`~medfl.losses.feature_distill.distillation_converged`:
    accuracy >= ``target_accuracy - tolerance``, cosine < ``max_cosine``, each moving at most
    ``max_change`` over the last ``window`` evaluations). A client that meets it freezes
    the distillation model it was sent (it stops training it and computing prototypes and,
    when sampled, replies the frozen model) and reports ``converged``; from the next round
    on its weight is ``alpha_k(t) = exp(-decay_lambda * max(0, Delta_perf))`` (eq. 8),
    ``Delta_perf`` the mean change of ``p_k`` over the clients of the round still distilling
    (eq. 9). Only scalars come back.

    **Transition**: when every training client has reported convergence, or after round
    ``distill_rounds`` at the latest (the paper has a T_d but no rule for clients that never
    converge; we cap stage 1 at it), the next round has two steps. First the release: every
    training client (not only the sampled ones: D^s holds every client's data) computes
    ``x_s`` for its training samples with the global distillation model and releases
    ``x_p = clip(x_s) + n`` once per sample
    (:func:`~medfl.privacy.feature_release.release_features`: L2 clip to ``clip``, Gaussian
    noise from Opacus's accountant at (``epsilon``, ``delta``), or ``mechanism="laplace"``
    with its pure epsilon) with its labels. The coordinator builds ``D^s`` (client order) and
    keeps it in its checkpointed state. Then the round's training step, stage 2's first.

    **Stage 2** (rounds after the transition): FedAvg of phi, each sampled client training on
    ``D^k union D^s`` for ``fl.train.epochs``: one dataset of both, shuffled together (each
    batch mixes local and shared samples in proportion to their sizes; an epoch covers both),
    ``D^s`` sent in every stage-2 instruction (robust to lost messages and restarted sites; the
    paper sends it once, which saves traffic: ``communication.csv`` shows the cost).

    **Privacy.** ``x_p`` and its labels are per-sample data leaving the client by design, so
    ``shared_x`` and ``shared_y`` are ``payload_exemptions``, excused from the per-sample
    check only in replies to the release instruction (``config["dp_release"]``); every other
    reply is checked in full. Each sample is released once: the run's ledger records one
    Gaussian release (sample rate 1) per client, unit one sample, zero-out neighbours, its
    epsilon from the accountant (``privacy.csv``, the summary's ``privacy`` block). Labels are
    not protected. Prototypes never leave a client; the phi and distillation models, the
    training metrics and the validation scalars are not covered by the epsilon (as in the
    paper). ``epsilon=None`` turns the noise off (still clipped): a measurement, recorded as
    infinite epsilon and flagged non-private. The noise seed mixes the site's secret
    (``noise_key``), so over Flower the coordinator cannot remove it; a release repeated
    after a crash draws the same noise (no extra cost).

    **Deviations and choices**: eq. 8 as printed (a larger accuracy change gives a smaller
    weight; the prose says the opposite), with a one-round lag: ``p_k(t)`` is measured after
    round t's aggregation, so round t aggregates with the latest measured ``Delta_perf``
    (t - 1); the critic is part of the aggregated distillation model; the VAE and critic are
    small conv nets (:mod:`medfl.models.feature_distill`), the latent size the task model's
    ``embed_dim`` (eq. 6 needs it).

    Ablations: ``lambda_proto=0`` (no prototypes), ``decay=False`` (plain FedAvg of the
    distillation models), ``lambda_wgan=0`` (no critic), ``epsilon=None`` (noise off,
    non-private). ``stop_condition=False`` never freezes (stage 1 runs ``distill_rounds``).
    """

    name = "fedtpf"
    description = "FedTPF: prototype-regularised VAE-WGAN-GP feature distillation, adaptive decay, DP shared set"
    payload_exemptions = frozenset({"shared_x", "shared_y"})

    def __init__(self, distill_rounds: int = 10, distill_epochs: int = 1, distill_lr: float = 1e-3,
                 lambda_vae: float = 1.0, lambda_wgan: float = 0.1, lambda_proto: float = 0.1,
                 lambda_ce: float = 1.0, gp_weight: float = 10.0, decay: bool = True, decay_lambda: float = 1.0,
                 stop_condition: bool = True, target_accuracy: float = 0.9, tolerance: float = 0.02,
                 max_cosine: float = 0.15, window: int = 3, max_change: float = 0.05,
                 epsilon: float | None = 8.0, delta: float = 1e-5, clip: float = 5.0,
                 mechanism: str = "gaussian", accountant: str = "rdp", vae_width: int = 16, vae_grid: int = 4,
                 critic_width: int = 16) -> None:
        where = f"method {self.name!r}"

        def integer(name: str, value: Any, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MethodConfigError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
            return value

        def number(name: str, value: Any, low: float, high: float = math.inf, open_low: bool = False) -> float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < low or value > high or (open_low and value == low):
                bound = f"{'>' if open_low else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
                raise MethodConfigError(f"{where}: {name} must be a number {bound}, got {value!r}")
            return float(value)

        self.distill_rounds = integer("distill_rounds", distill_rounds, 1)
        self.distill_epochs = integer("distill_epochs", distill_epochs, 1)
        self.distill_lr = number("distill_lr", distill_lr, 0.0, open_low=True)
        self.lambda_vae = number("lambda_vae", lambda_vae, 0.0)
        self.lambda_wgan = number("lambda_wgan", lambda_wgan, 0.0)
        self.lambda_proto = number("lambda_proto", lambda_proto, 0.0)
        self.lambda_ce = number("lambda_ce", lambda_ce, 0.0, open_low=True)
        self.gp_weight = number("gp_weight", gp_weight, 0.0)
        self.decay, self.stop_condition = bool(decay), bool(stop_condition)
        self.decay_lambda = number("decay_lambda", decay_lambda, 0.0)
        self.target_accuracy = number("target_accuracy", target_accuracy, 0.0, 1.0, open_low=True)
        self.tolerance = number("tolerance", tolerance, 0.0, 1.0)
        self.max_cosine = number("max_cosine", max_cosine, -1.0, 1.0)
        self.window = integer("window", window, 1)
        self.max_change = number("max_change", max_change, 0.0)
        if mechanism not in MECHANISMS:
            raise MethodConfigError(f"{where}: mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
        self.mechanism, self.accountant = mechanism, accountant
        self.epsilon = None if epsilon is None else number("epsilon", epsilon, 0.0, open_low=True)
        self.delta = number("delta", delta, 0.0, 1.0, open_low=True)
        self.clip = number("clip", clip, 0.0, open_low=True)
        self.vae_width = integer("vae_width", vae_width, 1)
        self.vae_grid = integer("vae_grid", vae_grid, 1)
        self.critic_width = integer("critic_width", critic_width, 1)
        try:
            #: per-coordinate noise of the release (Gaussian std or Laplace scale); 0: noise off
            self.noise = release_noise(epsilon=self.epsilon, clip=self.clip, delta=self.delta,
                                       mechanism=mechanism, accountant=accountant)
        except PrivacyConfigError as e:
            raise MethodConfigError(f"{where}: {e}") from None

    # ------------------------------------------------------------------ privacy
    def release_plan(self) -> Release:
        """One per-sample release of the shared features (sample rate 1, once per sample)."""
        if self.mechanism == "laplace":
            sigma = 0.0 if self.epsilon is None else 1.0 / self.epsilon
            return Release("feature_laplace", sigma, self.clip, 1.0, 0.0, "laplace", unit="sample")
        sigma = 0.0 if self.epsilon is None else noise_for_epsilon(self.epsilon, self.delta, 1.0, 1, self.accountant)
        return Release("feature_gaussian", sigma, self.clip, 1.0, self.delta, self.accountant, unit="sample")

    def round_releases(self, round: int) -> list[str]:
        """The clients asked for the release in ``round`` (the transition round's first step)."""
        return list(self.released) if self.release_round == round else []

    def weights(self) -> DistillWeights:
        """Eq. 7's coefficients."""
        return DistillWeights(vae=self.lambda_vae, wgan=self.lambda_wgan, proto=self.lambda_proto,
                              ce=self.lambda_ce, gp=self.gp_weight)

    # ------------------------------------------------------------------ coordinator
    def setup(self, federation: Federation) -> None:
        """phi and the distillation model (seeded), the stage-1 bookkeeping."""
        super().setup(federation)
        where = f"method {self.name!r}"
        if federation.rounds <= self.distill_rounds:
            raise MethodConfigError(
                f"{where}: fl.rounds ({federation.rounds}) must exceed distill_rounds ({self.distill_rounds}): "
                "stage 1 may last distill_rounds rounds and stage 2 needs at least one")
        if self.mechanism == "gaussian" and self.epsilon is not None:
            for cid in federation.client_ids:
                try:
                    check_budget(self.epsilon, self.delta, max(int(federation.num_examples.get(cid, 0)), 1),
                                 f"{where} (client {cid})")
                except PrivacyConfigError as e:
                    raise MethodConfigError(str(e)) from None
        phi = federation.build_model()
        self.global_state = get_state(phi)
        cls = federation.build_model(seed_tag="fedtpf_classifier")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(federation.seed, "fedtpf_distill"))
            vae, critic = self._distill_nets(federation.in_channels, federation.spatial_dims, int(phi.embed_dim))
        self.distill_state = {**{f"vae.{k}": v for k, v in get_state(vae).items()},
                              **{f"critic.{k}": v for k, v in get_state(critic).items()},
                              **{f"cls.{k}": v for k, v in get_state(cls).items()}}
        self.stage = "distill"
        self.pending_release = False
        self.stopped_at: dict[str, int] = {}
        self.p_prev: dict[str, float] = {}
        self.delta_perf = 0.0
        self.log: list[dict[str, Any]] = []
        self.release_round = 0
        self.released: list[str] = []
        self.transition: dict[str, Any] = {}
        self.release_stats: dict[str, dict[str, float]] = {}
        self.shared_x = torch.zeros(0)
        self.shared_y = torch.zeros(0, dtype=torch.long)

    def _distill_nets(self, in_channels: int, dims: int, latent: int) -> tuple[DistillVAE, Critic]:
        return (DistillVAE(in_channels, latent, dims, width=self.vae_width, grid=self.vae_grid),
                Critic(in_channels, dims, width=self.critic_width))

    def round_steps(self, round: int) -> int:
        """Two steps in the transition round (the release, then training), one otherwise."""
        return 2 if self.pending_release else 1

    def _release_config(self) -> dict[str, Any]:
        return {"stage": "release", RELEASE_FLAG: True, "mechanism": self.mechanism, "clip": self.clip,
                "delta": self.delta, "accountant": self.accountant,
                "epsilon": -1.0 if self.epsilon is None else self.epsilon}

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Stage 1: phi and the distillation model to the sampled clients; the transition's
        first step: the distillation model and the release settings to every training client;
        stage 2: phi and D^s to the sampled clients."""
        if self.pending_release:
            self.release_round, self.released = round, list(self.federation.client_ids)
            ins = Instruction(payload={"distill": self.distill_state}, config=self._release_config())
            return {cid: ins for cid in self.released}
        sampled = self.federation.sample(round)
        if self.stage == "distill":
            ins = Instruction(payload={"model": self.global_state, "distill": self.distill_state},
                              config={"stage": "distill"})
        else:
            ins = Instruction(payload={"model": self.global_state, "shared_x": self.shared_x,
                                       "shared_y": self.shared_y}, config={"stage": "train"})
        return {cid: ins for cid in sampled}

    def alphas(self, round: int, client_ids: list[str]) -> dict[str, float]:
        """Eq. 8's ``alpha_k`` for ``round`` (1 for every client without ``decay``)."""
        if not self.decay:
            return {cid: 1.0 for cid in client_ids}
        stopped = {cid: self.stopped_at.get(cid) for cid in client_ids}
        return decay_weights(stopped, round, self.delta_perf, self.decay_lambda)

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Stage 1: FedAvg of phi, eq. 8-weighted average of the distillation models; the
        release step: build D^s; stage 2: FedAvg of phi."""
        if self.pending_release:
            self._build_shared(round, replies)
            return
        if not replies:
            return
        self.global_state = weighted_average([r.payload["model"] for r in replies.values()],
                                             [float(r.num_examples) for r in replies.values()])
        if self.stage != "distill":
            return
        alpha = self.alphas(round, list(replies))
        weights = [float(r.num_examples) * alpha[cid] for cid, r in replies.items()]
        if sum(weights) > 0:
            self.distill_state = weighted_average([r.payload["distill"] for r in replies.values()], weights)
        self.log.append({"round": round, "alpha": {cid: alpha[cid] for cid in replies},
                         "delta_perf_used": self.delta_perf,
                         "frozen": sorted(cid for cid in replies if self.stopped_at.get(cid, round + 1) <= round)})
        if round >= self.distill_rounds:
            self._transition(round, "round cap (distill_rounds) reached")

    def _transition(self, round: int, reason: str) -> None:
        if not self.pending_release and self.stage == "distill":
            self.pending_release = True
            self.transition = {"after_round": round, "reason": reason,
                               "converged": sorted(self.stopped_at), "clients": len(self.federation.client_ids)}

    def check_reply(self, client_id: str, instruction: Instruction, reply: Reply) -> str:
        """A site may send anything: stage 1 and 2 replies must return the models they were
        sent (same keys, shapes, dtypes); a release must hold float features ``(N, C, ...)``
        with the federation's channels and dimensions, integer labels in ``[0, K)``, N equal
        to ``num_examples``. A reply that fails is dropped from the round by the engine."""
        stage = instruction.config.get("stage")
        if stage == "release":
            x, y = reply.payload.get("shared_x"), reply.payload.get("shared_y")
            fed = self.federation
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                return "shared_x and shared_y must be tensors"
            if not x.is_floating_point() or y.dim() != 1 or y.is_floating_point():
                return (f"expected float features and integer labels (N,), got {tuple(x.shape)} {x.dtype} and "
                        f"{tuple(y.shape)} {y.dtype}")
            if x.dim() - 2 != fed.spatial_dims or x.shape[1] != fed.in_channels:
                return f"feature shape {tuple(x.shape[1:])}: expected {fed.in_channels} channels in {fed.spatial_dims}D"
            n = int(x.shape[0])
            if n != int(y.shape[0]) or n != int(reply.num_examples):
                return f"{n} features, {int(y.shape[0])} labels, num_examples {reply.num_examples}"
            if n and (int(y.min()) < 0 or int(y.max()) >= fed.num_classes):
                return f"labels outside [0, {fed.num_classes})"
            return ""
        for key in ("model", "distill"):
            if key in instruction.payload:
                problem = state_mismatch(reply.payload.get(key), instruction.payload[key], key)
                if problem:
                    return problem
        return ""

    def _build_shared(self, round: int, replies: dict[str, Reply]) -> None:
        """D^s from the release replies (each passed :meth:`check_reply`); a reply whose
        feature size differs from the most common one among the sites is left out (one bad
        site cannot set the shape) and listed in the report."""
        shapes = {cid: tuple(r.payload["shared_x"].shape[1:]) for cid, r in replies.items()}
        counts = list(shapes.values())
        shape = max(counts, key=counts.count) if counts else None
        xs, ys, odd = [], [], []
        for cid, r in replies.items():
            if shapes[cid] != shape:
                odd.append(cid)
                continue
            xs.append(r.payload["shared_x"].float())
            ys.append(r.payload["shared_y"].long())
            self.release_stats[cid] = {m: float(v) for m, v in r.metrics.items()}
        if xs:
            self.shared_x, self.shared_y = torch.cat(xs), torch.cat(ys)
        self.pending_release = False
        self.stage = "train"
        self.transition["release_round"] = round
        self.transition["shared_samples"] = int(self.shared_y.numel())
        self.transition["contributors"] = len(xs)
        if odd:
            self.transition["left_out"] = {cid: f"feature shape {shapes[cid]}, the others' {shape}" for cid in odd}

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """Stage 1 (stop condition or decay on): the aggregated distillation model to every
        training client."""
        if self.stage != "distill" or self.pending_release or not (self.stop_condition or self.decay):
            return {}
        ins = Instruction(payload={"distill": self.distill_state}, config={"stage": "validate"})
        return {cid: ins for cid in self.federation.client_ids}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Eq. 9's ``Delta_perf(round)``, the clients that stopped, the transition when all did."""
        p_now = {cid: _as_float(m.get("residual_accuracy")) for cid, m in results.items()}
        p_now = {cid: v for cid, v in p_now.items() if 0.0 <= v <= 1.0}
        sampled = self.federation.sample(round)
        distilling = [cid for cid in sampled if self.stopped_at.get(cid, round + 1) > round]
        self.delta_perf = performance_change(p_now, self.p_prev, distilling)
        self.p_prev = p_now
        if self.stop_condition:
            for cid, m in results.items():
                if _as_float(m.get("converged")) == 1.0 and cid not in self.stopped_at:
                    self.stopped_at[cid] = round + 1
        if self.log and self.log[-1]["round"] == round:
            self.log[-1].update({"delta_perf": self.delta_perf,
                                 "mean_residual_accuracy": (sum(p_now.values()) / len(p_now)) if p_now else None,
                                 "converged": len(self.stopped_at)})
        if self.stop_condition and all(cid in self.stopped_at for cid in self.federation.client_ids):
            self._transition(round, "every client met the stop condition")

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """Every client evaluates the global task model phi."""
        ins = Instruction(payload={"model": self.global_state})
        return {cid: ins for cid in self.federation.eval_client_ids}

    def report(self) -> dict[str, Any]:
        """The stage switch, who stopped when, eq. 8-9's weights, the release's norms."""
        stats = self.release_stats
        n = {cid: s.get("released", 0.0) for cid, s in stats.items()}
        total = sum(n.values())

        def mean(key: str) -> float | None:
            vals = [(n[c], s[key]) for c, s in stats.items() if key in s]
            return sum(w * v for w, v in vals) / total if vals and total else None

        return {"transition": self.transition, "stopped_at": dict(self.stopped_at),
                "stage1": self.log, "release": {
                    "mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta, "clip": self.clip,
                    "noise_per_coordinate": self.noise, "private": self.epsilon is not None,
                    "x_norm_mean": mean("x_norm"), "x_s_norm_mean": mean("x_s_norm"),
                    "x_s_to_x_norm": mean("x_s_norm_ratio"), "clipped_fraction": mean("clipped_fraction"),
                    "per_client": stats}}

    def state_dict(self) -> dict[str, Any]:
        """Everything above: phi, the distillation model, the stage, D^s, the bookkeeping."""
        return {"global": self.global_state, "distill": self.distill_state, "stage": self.stage,
                "pending_release": self.pending_release, "stopped_at": dict(self.stopped_at),
                "p_prev": dict(self.p_prev), "delta_perf": self.delta_perf, "log": self.log,
                "release_round": self.release_round, "released": list(self.released),
                "transition": self.transition, "release_stats": self.release_stats,
                "shared_x": self.shared_x, "shared_y": self.shared_y}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.global_state, self.distill_state = state["global"], state["distill"]
        self.stage, self.pending_release = str(state["stage"]), bool(state["pending_release"])
        self.stopped_at = {str(k): int(v) for k, v in state["stopped_at"].items()}
        self.p_prev = {str(k): float(v) for k, v in state["p_prev"].items()}
        self.delta_perf = float(state["delta_perf"])
        self.log, self.transition = list(state["log"]), dict(state["transition"])
        self.release_round, self.released = int(state["release_round"]), [str(c) for c in state["released"]]
        self.release_stats = dict(state["release_stats"])
        self.shared_x, self.shared_y = state["shared_x"], state["shared_y"]

    # ------------------------------------------------------------------ client
    def _client_nets(self, client: ClientContext, distill: State) -> tuple[DistillVAE, Critic, nn.Module]:
        shape = tuple(client.sample_shape)
        cls = client.load_model(_sub(distill, "cls."), fresh=True)
        latent = int(_sub(distill, "vae.")["mu.weight"].shape[0])
        vae, critic = self._distill_nets(int(shape[0]), len(shape) - 1, latent)
        vae.load_state_dict(_sub(distill, "vae."))
        critic.load_state_dict(_sub(distill, "critic."))
        dev = client.device
        return vae.to(dev), critic.to(dev), cls.to(dev)

    def _perturb(self, generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x_s: perturb_features(x_s, clip=self.clip, noise=self.noise, mechanism=self.mechanism,
                                            generator=generator)

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """The stage the instruction names: ``distill``, ``release`` or ``train``."""
        stage = instruction.config.get("stage")
        if stage == "release":
            return self._release(client, instruction)
        if stage not in ("distill", "train"):
            raise ValueError(f"method {self.name!r}: instruction stage must be one of {STAGES}, got {stage!r}")
        phi = client.load_model(instruction.payload["model"])
        opt = make_optimizer(phi.parameters(), client.train)
        epochs = int(client.train.get("epochs", 1))
        if stage == "train":
            shared = SharedSet(instruction.payload["shared_x"], instruction.payload["shared_y"])
            union = ConcatDataset([client.dataset("train"), shared])
            g = torch.Generator().manual_seed(derive_seed(client.seed, "union"))
            loader = DataLoader(union, batch_size=int(client.train.get("batch_size", 16)), shuffle=True, generator=g,
                                num_workers=int(client.train.get("num_workers", 0)))
            stats = train_epochs(phi, loader, opt, epochs, device=client.device,
                                 clip_grad_norm=client.train.get("clip_grad_norm"))
            stats = {**stats, "shared_samples": float(len(shared))}
            return Reply(payload={"model": get_state(phi)}, metrics=stats, num_examples=client.num_examples("train"))
        stats = train_epochs(phi, client.loader("train"), opt, epochs, device=client.device,
                             clip_grad_norm=client.train.get("clip_grad_norm"))
        mine = client.state.get("fedtpf", {})
        if "frozen" in mine:
            distill, dstats = mine["frozen"], {"frozen": 1.0}
        else:
            distill, dstats = self._distill_locally(client, phi, instruction.payload["distill"])
        return Reply(payload={"model": get_state(phi), "distill": distill}, metrics={**stats, **dstats},
                     num_examples=client.num_examples("train"))

    def _distill_locally(self, client: ClientContext, phi: nn.Module, distill: State
                         ) -> tuple[State, dict[str, float]]:
        """Prototypes from the trained phi (eq. 5), then ``distill_epochs`` of eq. 7."""
        vae, critic, cls = self._client_nets(client, distill)
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
        opt_model = torch.optim.Adam(list(parameters_of(vae, cls)), lr=self.distill_lr)
        opt_critic = torch.optim.Adam(critic.parameters(), lr=self.distill_lr, betas=(0.5, 0.9))
        g = torch.Generator().manual_seed(derive_seed(client.seed, "distill"))
        perturb = self._perturb(g)
        weights = self.weights()
        log = StepMeans()   # the terms read every few steps, not every step
        for _ in range(self.distill_epochs):
            for x, y in client.loader("train"):
                x, y = x.to(client.device), torch.as_tensor(y).to(client.device)
                out = distill_step(vae, critic, cls, x, y, protos, present, weights, opt_model,
                                   opt_critic if weights.wgan > 0 else None, g, perturb=perturb, read=False)
                log.add(len(y), **out)
        dstats = {f"distill_{key}": v for key, v in log.means().items()}
        dstats["frozen"] = 0.0
        state = {**{f"vae.{k}": v for k, v in get_state(vae).items()},
                 **{f"critic.{k}": v for k, v in get_state(critic).items()},
                 **{f"cls.{k}": v for k, v in get_state(cls).items()}}
        return state, dstats

    def _residuals(self, client: ClientContext, vae: DistillVAE, split: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, x_hat, labels)`` of ``split`` without augmentation; ``x_hat`` decoded from ``mu``."""
        vae.eval()
        xs, hats, ys = [], [], []
        with torch.no_grad():
            for x, y in client.loader(split, augment=False, shuffle=False):
                x = x.to(client.device)
                mu, _ = vae.encode(x)
                hats.append(vae.decode(mu, tuple(x.shape[2:])).cpu())
                xs.append(x.cpu())
                ys.append(torch.as_tensor(y).long())
        return torch.cat(xs), torch.cat(hats), torch.cat(ys)

    def client_validate(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
        """``p_k``: the global distillation model's residual accuracy on this client's ``val``
        split (``test`` without one), the cosine of ``x_hat`` and ``x_s``, and the stop condition
        over this client's history (``converged`` 1 once met; the model is frozen then)."""
        split = "val" if _size(client, "val") > 0 else "test"
        if _size(client, split) == 0:
            return {"residual_accuracy": math.nan, "cosine": math.nan, "converged": 0.0}
        distill = instruction.payload["distill"]
        vae, _, cls = self._client_nets(client, distill)
        x, x_hat, y = self._residuals(client, vae, split)
        x_s = x - x_hat
        cls.eval()
        with torch.no_grad():
            pred = torch.cat([cls(b.to(client.device)).argmax(1).cpu() for b in x_s.split(256)])
        acc, cos = float((pred == y).float().mean()), residual_cosine(x_hat, x_s)
        mine = dict(client.state.get("fedtpf", {}))
        mine["acc"] = [*mine.get("acc", []), acc]
        mine["cos"] = [*mine.get("cos", []), cos]
        met = "frozen" in mine
        if not met and self.stop_condition:
            met, _ = distillation_converged(mine["acc"], mine["cos"], target=self.target_accuracy,
                                            tol=self.tolerance, max_cosine=self.max_cosine, window=self.window,
                                            max_change=self.max_change)
            if met:
                mine["frozen"], mine["frozen_round"] = dict(distill), client.round
        client.state["fedtpf"] = mine
        return {"residual_accuracy": acc, "cosine": cos, "converged": 1.0 if met else 0.0}

    def _release(self, client: ClientContext, instruction: Instruction) -> Reply:
        """``x_p = clip(x_s) + n`` for every training sample, once, with the labels."""
        cfg = instruction.config
        epsilon = float(cfg.get("epsilon", -1.0))
        mechanism, clip = str(cfg.get("mechanism", "gaussian")), float(cfg["clip"])
        vae, _, _ = self._client_nets(client, instruction.payload["distill"])
        x, x_hat, y = self._residuals(client, vae, "train")
        x_s = x - x_hat
        g = torch.Generator().manual_seed(derive_seed(client.seed, "release", client.noise_key))
        x_norm = x.flatten(1).norm(dim=1)
        s_norm = x_s.flatten(1).norm(dim=1)
        if epsilon > 0:
            x_p, rec = release_features(x_s, epsilon=epsilon, clip=clip, delta=float(cfg["delta"]),
                                        mechanism=mechanism, accountant=str(cfg["accountant"]), generator=g)
            extra = {"epsilon": rec.epsilon, "noise_std": rec.noise_std, "clipped_fraction": rec.clipped_fraction}
        else:  # noise off: a measurement, flagged non-private by the ledger
            x_p = perturb_features(x_s, clip=clip, noise=0.0, mechanism=mechanism)
            order = 2 if mechanism == "gaussian" else 1
            extra = {"noise_std": 0.0,
                     "clipped_fraction": float((x_s.flatten(1).norm(p=order, dim=1) > clip).float().mean())}
        metrics = {"released": float(len(y)), "x_norm": float(x_norm.mean()), "x_s_norm": float(s_norm.mean()),
                   "x_s_norm_ratio": float((s_norm / x_norm.clamp_min(1e-12)).mean()), **extra}
        return Reply(payload={"shared_x": x_p.float().contiguous(), "shared_y": y}, metrics=metrics,
                     num_examples=len(y))

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """The global task model phi."""
        return client.load_model(instruction.payload["model"])


class FedFed(FedTPF):
    """FedFed (Yang et al., NeurIPS 2023), the method FedTPF extends, on FedTPF's code.

    The distillation model is trained in federation for exactly ``distill_rounds`` rounds:
    a VAE generator and a classifier on the noised residual ``x_s + n`` (VAE + CE terms, no
    critic, no prototypes), aggregated by plain FedAvg (no stop condition, no decay, no
    validation exchange). Then every client releases ``x_p`` once (the same DP release as
    FedTPF's, same ledger) and stage 2 trains on local plus shared data. Deviation: FedFed's
    generator is a ResNet-style beta-VAE; ours is FedTPF's small conv VAE, so the comparison
    isolates FedTPF's additions (prototypes, critic, stop condition, decay).
    """

    name = "fedfed"
    description = "FedFed: federated feature distillation (VAE + noised-residual classifier), DP shared set"

    def __init__(self, distill_rounds: int = 10, distill_epochs: int = 1, distill_lr: float = 1e-3,
                 lambda_vae: float = 1.0, lambda_ce: float = 1.0, epsilon: float | None = 8.0, delta: float = 1e-5,
                 clip: float = 5.0, mechanism: str = "gaussian", accountant: str = "rdp", vae_width: int = 16,
                 vae_grid: int = 4) -> None:
        super().__init__(distill_rounds=distill_rounds, distill_epochs=distill_epochs, distill_lr=distill_lr,
                         lambda_vae=lambda_vae, lambda_wgan=0.0, lambda_proto=0.0, lambda_ce=lambda_ce,
                         decay=False, stop_condition=False, epsilon=epsilon, delta=delta, clip=clip,
                         mechanism=mechanism, accountant=accountant, vae_width=vae_width, vae_grid=vae_grid)


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register FedTPF and FedFed."""
    register(FedTPF)
    register(FedFed)
