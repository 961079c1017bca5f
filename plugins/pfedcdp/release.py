"""PFedCDP's private release of the extractor (eqs. 12-15 and the authors' pipeline): the
reply filters it asks the engine for, the authors' noise and quantization of the weights in the
client step, and how that noise is accounted (:class:`PrivateRelease`, a part of
:class:`~medfl_plugins.pfedcdp.method.PFedCDP`)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from medfl.capability import CLUSTERS
from medfl.method import Federation, MethodConfigError, OwnDp, derive_seed
from medfl.plugins import lookup
from medfl.privacy.noise import gaussian
from medfl_plugins.pfedcdp.settings import State

__all__ = ["WEIGHT_DP", "PerClient", "PrivateRelease", "authors_quantize", "clip_noise_tensors"]

#: The name of the authors' weight noise in ``privacy.csv`` (:meth:`PrivateRelease.own_dp`).
WEIGHT_DP = "pfedcdp_weight_dp"


def clip_noise_tensors(state: State, clip: float, sigma: float, generator: torch.Generator) -> State:
    """The authors' ``DifferentialPrivacy.apply_dp`` (shadhin39/PFedCDP, differential_privacy.py,
    lines 19-29 and 31-40) on a model state: each tensor ``w`` scaled by ``min(1, clip / ||w||)``
    (its own L2 norm over all its entries, ``tf.norm(w, ord=2)``), then Gaussian noise of standard
    deviation ``clip * sigma`` added to every entry (drawn from ``generator``, on the CPU, float32
    as the code's ``tf.random.normal``). It acts on the weights themselves, not on an update."""
    out = {}
    for k, w in state.items():
        w32 = w.detach().to("cpu", torch.float32)
        norm = torch.linalg.vector_norm(w32)
        factor = torch.clamp(clip / norm, max=1.0) if float(norm) > 0 else torch.tensor(1.0)
        noise = gaussian(w32.shape, clip * sigma, generator)   # finite by construction (medfl.privacy.noise)
        out[k] = (w32 * factor + noise).to(w.dtype)
    return out


def authors_quantize(state: State, bits: int) -> State:
    """The authors' min-max quantization of the weights and its inverse (shadhin39/PFedCDP,
    quantization.py: ``quantize_weights`` lines 11-37, the formula lines 24-25; ``dequantize_weights``
    lines 39-52, the formula lines 47-48), per tensor: ``q = round((w - min) / (max - min + 1e-8)
    * (2^b - 1))`` (round half to even, as ``tf.round``), then ``q / (2^b - 1) * (max - min) +
    min``. What a coordinator receives of a weight tensor quantized at ``bits`` bits (medfl sends
    the dequantized floats)."""
    levels = float(2 ** bits - 1)
    out = {}
    for k, w in state.items():
        w32 = w.detach().to("cpu", torch.float32)
        if not w32.numel():
            out[k] = w.clone()
            continue
        lo, hi = w32.min(), w32.max()
        q = torch.round((w32 - lo) / (hi - lo + 1e-8) * levels)
        out[k] = (q / levels * (hi - lo) + lo).to(w.dtype)
    return out


class PerClient(dict):  # type: ignore[type-arg]
    """``{client id: value}`` of :meth:`PrivateRelease.own_dp`, resolved when asked from the method's
    cluster assignment (known after the profile exchange, before the ledger records round 1)
    by ``value(client id)``: the noise multiplier (:meth:`PrivateRelease.client_noise`: a client of a
    noised cluster gets the authors' sigma over the square root of its model's number of noised
    tensors, a client of a cluster sent in the clear 0, its epsilon infinite; a client without a
    cluster yet, as in the plan's check before the profile or a site's policy, 0: it may be sent
    in the clear) or the number of values the noise covers (:meth:`PrivateRelease.client_noised_values`)."""

    def __init__(self, value: Callable[[str], float]) -> None:
        super().__init__()
        self._value = value

    def __getitem__(self, client_id: str) -> float:
        return self._value(str(client_id))

    def __contains__(self, client_id: object) -> bool:
        return True


class PrivateRelease:
    """What of a client's extractor leaves it, and with what noise: the engine's filters
    (:meth:`default_filters`, eqs. 12-15) or the client step's own release (:meth:`release_weights`,
    the authors' pipeline) and its accounting (:meth:`own_dp`), from the method's settings."""

    @property
    def dp(self) -> bool:
        """Whether the extractor's update is noised (``epsilon`` or ``noise_multiplier`` given)."""
        return self.epsilon is not None or self.noise_multiplier is not None

    def _dp_entry(self) -> dict[str, Any]:
        """The ``dp_gaussian`` entry of :meth:`default_filters` (a target epsilon or sigma)."""
        noise = {"epsilon": self.epsilon} if self.epsilon is not None else {"noise_multiplier": self.noise_multiplier}
        return {"name": "dp_gaussian", **noise, "clip": self.clip, "delta": self.delta, "accountant": self.accountant,
                "keys": "all"}

    @property
    def in_step(self) -> bool:
        """Whether the client step itself noises and quantizes its extractor's weights (the
        authors' pipeline: ``dp_mode="weights_per_tensor"`` or bits per cluster) instead of the
        engine's filters."""
        return self.dp_mode == "weights_per_tensor" or isinstance(self.bits, dict)

    def cluster_bits(self, c: str) -> int | None:
        """The quantization bits of cluster ``c``'s replies (``None``: sent as floats)."""
        return self.bits.get(c) if isinstance(self.bits, dict) else self.bits

    def noised(self, c: str) -> bool:
        """Whether cluster ``c``'s replies carry DP noise."""
        return self.dp and c in self.dp_clusters

    def default_filters(self) -> list[dict[str, Any]]:
        """``dp_gaussian`` on the extractor's update (clip C2, a target epsilon or a noise
        multiplier; ``keys: all``: the reply holds the extractor's parameters only, and the
        cluster models differ from the run's ``fl.model``) and ``quantize`` (bits; on the
        update unless ``quantize="weights"``). None where the client step does both itself
        (:attr:`in_step`: the authors' noise on the weights of some clusters, bits per cluster)."""
        out: list[dict[str, Any]] = []
        if self.dp and self.dp_mode == "update":
            out.append(self._dp_entry())
        if self.bits is not None and not self.in_step:
            out.append({"name": "quantize", "bits": self.bits, "update": self.quantize == "update"})
        return out

    def own_dp(self, federation: Federation) -> OwnDp | None:
        """The authors' noise on the weights (``dp_mode="weights_per_tensor"``), applied in the
        client step to the clusters of ``dp_clusters``: one release a round of each member's
        extractor weights, each of its L tensors clipped to ``clip``, noise ``clip * sigma`` per
        entry. Accounted as a Gaussian release of the whole extractor, whose L2 sensitivity
        (the weights against none, as ``dp_gaussian``'s update against none) is ``clip *
        sqrt(L)``: noise multiplier ``sigma / sqrt(L)`` per client of a noised cluster, 0
        (epsilon infinite, not private) per client of a cluster sent in the clear. ``None``
        otherwise (the engine's ``dp_gaussian`` filter accounts the update's noise)."""
        if not (self.dp and self.dp_mode == "weights_per_tensor"):
            return None
        return OwnDp(mechanism=WEIGHT_DP, unit="client", noise_multiplier=PerClient(self.client_noise), sample_rate=1.0,
                     steps=1, clip=self.clip, delta=self.delta, accountant=self.accountant,
                     steps_metric="weight_dp_releases",
                     statement=(f"each extractor weight tensor clipped to {self.clip:g} by its L2 norm and Gaussian "
                                f"noise of std {self.clip:g} x {self.noise_multiplier:.4g} added to the weights, in "
                                f"clusters {', '.join(self.dp_clusters) or 'none'}; the other clusters send their "
                                "weights in the clear (noise multiplier 0: not private). The per-client noise "
                                "multiplier, sigma / sqrt(number of tensors), is resolved after the capability "
                                "profile; privacy.csv has each client's"),
                     noised_values=PerClient(self.client_noised_values))

    def client_noise(self, client_id: str) -> float:
        """The noise multiplier :meth:`own_dp` accounts for ``client_id`` (see :class:`PerClient`)."""
        c = getattr(self, "assign", {}).get(client_id)
        if c is None or not self.noised(c) or self.noise_multiplier is None:
            return 0.0
        return float(self.noise_multiplier) / math.sqrt(len(self.extractors[c]))

    def client_noised_values(self, client_id: str) -> int:
        """How many values :meth:`own_dp`'s noise covers at ``client_id``: its cluster's extractor
        weights (0 before the client has a cluster)."""
        c = getattr(self, "assign", {}).get(client_id)
        if c is None or c not in getattr(self, "extractors", {}):
            return 0
        return int(sum(t.numel() for t in self.extractors[c].values()))

    def signal_bound(self, c: str) -> float:
        """The largest L2 norm of what a cluster-``c`` client sends before the noise: C2 for the
        clipped update, ``clip * sqrt(L)`` for the weights clipped tensor by tensor."""
        return self.clip if self.dp_mode == "update" else self.clip * math.sqrt(len(self.extractors[c]))

    def planned_sigma(self, federation: Federation) -> float:
        """The noise multiplier of the run's extractor updates, planned as the engine plans the
        ``dp_gaussian`` of :meth:`default_filters` (the same filter, the same federation): the
        given ``noise_multiplier``, or the accountant's for ``epsilon`` over the planned
        rounds; 0 without DP."""
        if not self.dp:
            return 0.0
        if self.dp_mode == "weights_per_tensor":
            return float(self.noise_multiplier)
        entry = self._dp_entry()
        dp = lookup("filter", entry.pop("name")).from_config(entry)
        dp.plan(federation, "pfedcdp: the noise plan of its mechanisms")
        return float(dp.noise_multiplier)

    def release_weights(self, ext: State, cluster: str, round: int, seed: int) -> State:
        """What a cluster-``cluster`` client sends of its extractor's weights in the authors'
        pipeline (:attr:`in_step`; one release a round, noised or in the clear, as :meth:`own_dp`
        accounts it): in a noised cluster each tensor clipped and noised
        (:func:`clip_noise_tensors`, seeded by the client and the round), then quantized at the
        cluster's bits (:func:`authors_quantize`, sent dequantized). The client keeps ``ext``
        (its own model is not a release)."""
        if cluster not in CLUSTERS:
            raise MethodConfigError(f"pfedcdp: the instruction names no cluster (got {cluster!r})")
        sent = ext
        if self.noised(cluster) and self.dp_mode == "weights_per_tensor":
            gen = torch.Generator().manual_seed(derive_seed(seed, "weight_dp", round))
            sent = clip_noise_tensors(ext, self.clip, float(self.noise_multiplier), gen)
        bits = self.cluster_bits(cluster)
        if bits is not None:
            sent = authors_quantize(sent, bits)
        device = next(iter(ext.values())).device if ext else "cpu"
        return {k: v.to(device) for k, v in sent.items()}
