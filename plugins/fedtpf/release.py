"""FedTPF's release of the shared features ``x_p = x_s + n`` (Sec. III-E, IV-B): what the
clients perturb with (the clip, the noise), the per-sample release medfl performs, the
client's release step, the check of its reply and ``D^s`` built from the replies.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from medfl.messages import Instruction, Reply
from medfl.method import ClientContext, MethodConfigError
from medfl.privacy.accounting import PrivacyConfigError
from medfl.privacy.feature_release import SampleRelease, norm_quantile, perturb_features, variance_scale
from medfl_plugins.fedtpf.models import client_nets, client_scale, fixed_scale, load_nets, residuals, standardized
from medfl_plugins.fedtpf.records import MechanismRecords, as_float

__all__ = ["DISTILL_MODEL_NOT_COVERED", "FeatureRelease"]

#: what the per-sample epsilon leaves out: the distillation model the released values depend on
DISTILL_MODEL_NOT_COVERED = (
    "the distillation model: the per-sample epsilon of the shared features treats it as public, but it is trained "
    "on the clients' data and sent without noise, and x_p = x - x_hat(x) + n depends on it")


class FeatureRelease(MechanismRecords):
    """The release's part of :class:`~medfl_plugins.fedtpf.method.FedTPF`, whose settings and
    state it reads (docs/fedtpf.md, "The release", says what each setting does)."""

    def noise_scale(self, clip: float | None) -> float:
        """The per-coordinate noise the release adds at ``clip``: the Gaussian std
        ``z * clip``, the Laplace scale ``clip / epsilon``, ``noise``'s variance as std (or
        Laplace scale), 0 with the noise off."""
        if self.noise is not None:
            return variance_scale(self.noise["variance"], self.mechanism)
        if self.epsilon is None or clip is None:
            return 0.0
        return clip / self.epsilon if self.mechanism == "laplace" else self.noise_multiplier * clip

    def release_plan(self) -> SampleRelease:
        """One per-sample release of the shared features ``shared_x`` with their labels
        ``shared_y`` (sample rate 1, once per sample), which medfl performs at the client.
        The clip of ``"public_quantile"`` is set at the coordinator during the run (NaN
        before; it travels in the release instruction); the paper's fixed-variance noise has
        no sensitivity bound (clip infinite, noise multiplier 0: not private)."""
        notes: tuple[str, ...] = (DISTILL_MODEL_NOT_COVERED,)
        if self.standardize == "client":
            notes += ("each client's per-channel standard deviation of its training split: the released features "
                      "are on its standardized scale, (x - x_hat) / std + n, so their scale carries it",)
        keys = {"keys": ("shared_x",), "labels": "shared_y", "noise": self.mechanism, "not_covered": notes}
        if self.noise is not None:
            keys["not_covered"] = notes + (
                f"the shared features: noise of variance {self.noise['variance']:g} is added to unclipped x_s "
                "(paper 003's setting), which bounds no sample's contribution: no epsilon",)
            return SampleRelease(f"feature_{self.mechanism}_unclipped", 0.0, math.inf, 1.0,
                                 0.0 if self.mechanism == "laplace" else self.delta,
                                 "laplace" if self.mechanism == "laplace" else self.accountant,
                                 variance=self.noise["variance"], **keys)
        if self.mechanism == "laplace":
            sigma = 0.0 if self.epsilon is None else 1.0 / self.epsilon
            return SampleRelease("feature_laplace", sigma, self.clip_now, 1.0, 0.0, "laplace", **keys)
        return SampleRelease("feature_gaussian", self.noise_multiplier, self.clip_now, 1.0, self.delta,
                             self.accountant, **keys)

    def _clip_config(self) -> dict[str, float]:
        """``{"clip": clip}`` for ``"public_quantile"`` (what a client needs from the
        coordinator), ``{}`` otherwise."""
        return {"clip": self.clip_now} if self.clip == "public_quantile" else {}

    def _finite_clip(self) -> float | None:
        return self.clip_now if math.isfinite(self.clip_now) else None

    def _update_clip(self) -> None:
        """``"public_quantile"``: the clip from the current global distillation model's ``x_s``
        on the public train split (at the coordinator; public data, no privacy cost)."""
        if self.clip != "public_quantile" or self.federation.public is None:
            return
        pub = self.federation.public
        vae, _ = load_nets(self.distill_state, tuple(pub.sample_shape), self.net_sizes)
        vae.eval()
        norms = []
        with torch.no_grad():
            for x, _y in pub.loader("train", batch_size=256, shuffle=False, augment=False):
                x = standardized(x.float(), fixed_scale(self.standardize, x.dim()))
                mu, _ = vae.encode(x)
                x_s = x - vae.decode(mu, tuple(x.shape[2:]))
                norms.append(x_s.flatten(1).norm(p=2 if self.mechanism == "gaussian" else 1, dim=1))
        try:
            self.clip_now = norm_quantile(torch.cat(norms) if norms else torch.zeros(0), self.clip_quantile)
        except PrivacyConfigError as e:
            raise MethodConfigError(f"method {self.name!r}: clip='public_quantile' on fl.public_dataset: {e}") from None

    def _client_clip(self, instruction: Instruction) -> float | None:
        """The clip this client perturbs with: its own ``clip``, the coordinator's for
        ``"public_quantile"`` (any clip gives the same epsilon: the noise scales with it),
        ``None`` for the paper's unclipped noise."""
        if self.noise is not None:
            return None
        if self.clip != "public_quantile":
            return float(self.clip)
        clip = as_float(instruction.config.get("clip"))
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"method {self.name!r}: the instruction's clip must be a finite number > 0, "
                             f"got {instruction.config.get('clip')!r}")
        return clip

    def _perturb(self, generator: torch.Generator, clip: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x_s -> x_p``, as the release perturbs (what the residual classifier trains on)."""
        noise = self.noise_scale(clip)
        return lambda x_s: perturb_features(x_s, clip=clip, noise=noise, mechanism=self.mechanism,
                                            generator=generator)

    def _scale_text(self) -> str:
        """The scale the noise is added on (``standardize``), for ``mechanisms.csv``."""
        return ("input" if self.standardize == "none" else "standardized (each client's own per-channel mean and std)"
                if self.standardize == "client" else "standardized (fixed per-channel mean and std)")

    def _clip_source(self) -> str:
        return ("none (unclipped)" if self.noise is not None else
                f"public_quantile {self.clip_quantile:g}" if self.clip == "public_quantile" else "config")

    def _noise_text(self) -> str:
        return (f"variance {self.noise['variance']:g} (not private)" if self.noise is not None else
                "off (not private)" if self.epsilon is None else f"{self.mechanism} epsilon {self.epsilon:g}")

    def _release(self, client: ClientContext, instruction: Instruction) -> Reply:
        """``x_s`` for every training sample, once, with the labels, **unnoised**: medfl
        performs the release declared by :meth:`release_plan` on this reply after it is
        returned (``clip(x_s) + n`` at this client's epsilon, the paper's fixed-variance noise
        on unclipped ``x_s``, or, noise off, the clipped ``x_s``) and adds its record of it
        (noise and signal norms, clipped fraction, epsilon) to the metrics."""
        vae, _, _ = client_nets(client, instruction.payload["distill"], self.net_sizes)
        x, x_hat, y = residuals(client, vae, "train", client_scale(self.standardize, client))
        x_s = x - x_hat
        x_norm, s_norm = x.flatten(1).norm(dim=1), x_s.flatten(1).norm(dim=1)
        metrics = {"x_norm": float(x_norm.mean()), "x_s_norm": float(s_norm.mean()),
                   "x_s_norm_ratio": float((s_norm / x_norm.clamp_min(1e-12)).mean())}
        return Reply(payload={"shared_x": x_s.float().contiguous(), "shared_y": y}, metrics=metrics,
                     num_examples=len(y))

    def _release_problem(self, reply: Reply) -> str:
        """What is wrong with a release reply (``""``: nothing): float features ``(N, C, ...)``
        with the federation's channels and dimensions, integer labels in ``[0, K)``, N equal
        to ``num_examples``."""
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

    def _build_shared(self, round: int, replies: dict[str, Reply]) -> None:
        """D^s from the release replies (each passed :meth:`check_reply`), in client order; a
        reply whose feature size differs from the most common one among the sites is left out
        (one bad site cannot set the shape) and listed in the report. Stage 2 starts."""
        shapes = {cid: tuple(r.payload["shared_x"].shape[1:]) for cid, r in replies.items()}
        counts = list(shapes.values())
        shape = max(counts, key=counts.count) if counts else None
        kept = {cid: r for cid, r in replies.items() if shapes[cid] == shape}
        if kept:
            self.shared_x = torch.cat([r.payload["shared_x"].float() for r in kept.values()])
            self.shared_y = torch.cat([r.payload["shared_y"].long() for r in kept.values()])
        self.pending_release = False
        self.stage = "train"
        self.transition.update({"release_round": round, "shared_samples": int(self.shared_y.numel()),
                                "contributors": len(kept), "clip": self._finite_clip()})
        odd = [cid for cid in replies if cid not in kept]
        if odd:
            self.transition["left_out"] = {cid: f"feature shape {shapes[cid]}, the others' {shape}" for cid in odd}
        self._record_release(kept)
