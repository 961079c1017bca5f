"""A declared differential-privacy release of per-sample features: FedTPF's (and FedFed's)
shared set ``x_p = clip(x_s) + n`` (paper 003, section III-E).

Per-sample, image-shaped data may leave a client only this way. Each sample is released once:

* ``gaussian`` (default): each ``x_s`` is clipped to L2 norm ``clip`` and Gaussian noise of
  std ``sigma = z * clip`` is added, ``z`` the noise multiplier Opacus's accountant gives for
  one release (sample rate 1, one step) at the target ``(epsilon, delta)``
  (:func:`medfl.privacy.accounting.noise_for_epsilon`); the epsilon recorded is the
  accountant's for that ``z`` (at most the target).
* ``laplace``: each ``x_s`` is clipped to L1 norm ``clip`` and Laplace noise of scale
  ``clip / epsilon`` is added per coordinate: pure ``epsilon``-DP (``delta`` 0).

The unit of privacy is one sample, with zero-out neighbours (the sample's vector replaced by
zeros: sensitivity ``clip``), Opacus's convention for DP-SGD; under replace-one neighbours the
sensitivity, and so the noise for the same epsilon, doubles. Labels are not protected: they
travel in the clear with the released features (the docs say so).

:func:`noise_comparison` gives the paper's privacy-utility argument in numbers: the noise std
the same budget needs when the clip norm follows ``x_s``'s norms against ``x``'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from medfl.privacy.accounting import PrivacyConfigError, check_delta, check_positive, epsilon_spent, noise_for_epsilon

__all__ = ["MECHANISMS", "Release", "release_features", "release_noise", "perturb_features", "noise_comparison"]

MECHANISMS = ("gaussian", "laplace")


@dataclass
class Release:
    """What a release spent and did: the record a run keeps in its privacy outputs."""

    mechanism: str
    epsilon: float
    delta: float
    clip: float
    noise_std: float
    noise_multiplier: float
    samples: int
    clipped_fraction: float
    unit: str = "sample"
    neighbours: str = "zero-out"
    accountant: str | None = "rdp"

    def as_dict(self) -> dict[str, Any]:
        """The record as plain values (JSON-ready)."""
        return asdict(self)


def release_features(x_s: torch.Tensor, *, epsilon: float, clip: float, delta: float = 1e-5,
                     mechanism: str = "gaussian", accountant: str = "rdp",
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, Release]:
    """Clip each sample of ``x_s`` (``(N, ...)``) and add noise for a per-sample ``epsilon``.

    Returns:
        ``(x_p, release)``: the noised features (same shape) and the :class:`Release` record.

    Raises:
        PrivacyConfigError: an unknown mechanism, a non-positive or non-finite ``epsilon`` or
            ``clip``, a ``delta`` outside (0, 1) for the Gaussian mechanism, or non-finite
            values in ``x_s`` (they would pass through clipping unbounded).
    """
    where = "release_features"
    if mechanism not in MECHANISMS:
        raise PrivacyConfigError(f"{where}: mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    epsilon = check_positive(epsilon, "epsilon", where)
    clip = check_positive(clip, "clip", where)
    if not torch.isfinite(x_s).all():
        raise PrivacyConfigError(f"{where}: x_s holds NaN or infinite values; nothing is released")
    flat = x_s.detach().flatten(1).double()
    clipped, norms = _clip(flat, clip, mechanism)
    if mechanism == "gaussian":
        delta = check_delta(delta, where)
        z = noise_for_epsilon(epsilon, delta, 1.0, 1, accountant)
        spent = epsilon_spent([(z, 1.0, 1)], delta, accountant)
        std = z * clip
        noise = torch.randn(clipped.shape, generator=generator, dtype=torch.float64) * std
        record = Release("gaussian", spent, delta, clip, std, z, len(flat), float((norms > clip).double().mean()),
                         accountant=accountant)
    else:
        b = clip / epsilon
        u = torch.rand(clipped.shape, generator=generator, dtype=torch.float64) - 0.5
        noise = -b * torch.sign(u) * torch.log1p(-2 * u.abs())
        record = Release("laplace", epsilon, 0.0, clip, b * math.sqrt(2), 1.0 / epsilon, len(flat),
                         float((norms > clip).double().mean()), accountant=None)
    # the noise is drawn on the generator's device (the CPU: seeded the same on any machine)
    x_p = (clipped + noise.to(clipped.device)).to(x_s.dtype).view_as(x_s)
    return x_p, record


def _clip(flat: torch.Tensor, clip: float, mechanism: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``flat`` scaled to norm at most ``clip`` (L2 for ``gaussian``, L1 for
    ``laplace``): ``(clipped, norms before clipping)``; differentiable."""
    norms = flat.norm(p=2 if mechanism == "gaussian" else 1, dim=1)
    scale = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)
    return flat * scale.unsqueeze(1), norms


def release_noise(*, epsilon: float | None, clip: float, delta: float = 1e-5, mechanism: str = "gaussian",
                  accountant: str = "rdp") -> float:
    """The noise one release adds per coordinate: the Gaussian std ``z * clip`` (``z`` from
    the accountant at ``(epsilon, delta)``) or the Laplace scale ``clip / epsilon``; 0 when
    ``epsilon`` is ``None`` (noise off). What :func:`release_features` draws, so a classifier
    can be trained on features perturbed as they will be released (:func:`perturb_features`)."""
    if epsilon is None:
        return 0.0
    where = "release_noise"
    epsilon, clip = check_positive(epsilon, "epsilon", where), check_positive(clip, "clip", where)
    if mechanism == "laplace":
        return clip / epsilon
    if mechanism != "gaussian":
        raise PrivacyConfigError(f"{where}: mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    return noise_for_epsilon(epsilon, check_delta(delta, where), 1.0, 1, accountant) * clip


def perturb_features(x_s: torch.Tensor, *, clip: float, noise: float, mechanism: str = "gaussian",
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``clip(x_s) + n`` as the release makes it, differentiable in ``x_s``: each sample
    clipped to norm ``clip`` (L2, or L1 for ``laplace``) and noise of per-coordinate
    ``noise`` (Gaussian std, or Laplace scale) added, drawn from ``generator``. For training
    (the paper's classifier sees ``x_p = x_s + n``), not a release: nothing is accounted."""
    clipped, _ = _clip(x_s.flatten(1), clip, mechanism)
    if noise > 0:
        if mechanism == "gaussian":
            n = torch.randn(clipped.shape, generator=generator, dtype=clipped.dtype, device="cpu") * noise
        else:
            u = torch.rand(clipped.shape, generator=generator, dtype=clipped.dtype, device="cpu") - 0.5
            n = -noise * torch.sign(u) * torch.log1p(-2 * u.abs())
        clipped = clipped + n.to(clipped.device)
    return clipped.view_as(x_s)


def noise_comparison(x: torch.Tensor, x_s: torch.Tensor, *, epsilon: float, delta: float = 1e-5,
                     quantile: float = 0.95, accountant: str = "rdp") -> dict[str, float]:
    """The paper's claim in numbers: with the clip norm set at the ``quantile`` of the per-sample
    L2 norms, the Gaussian noise std one release needs at ``(epsilon, delta)`` for ``x_s``
    against the raw ``x``, their mean norms, and the ratio of noise std to mean norm (how much
    of the signal the noise drowns) for each."""
    z = noise_for_epsilon(check_positive(epsilon, "epsilon", "noise_comparison"), delta, 1.0, 1, accountant)
    out: dict[str, float] = {"epsilon": float(epsilon), "delta": float(delta), "noise_multiplier": z}
    for name, t in (("x", x), ("x_s", x_s)):
        norms = t.detach().flatten(1).double().norm(dim=1)
        clip = float(torch.quantile(norms, quantile))
        out[f"{name}_mean_norm"] = float(norms.mean())
        out[f"{name}_clip"] = clip
        out[f"{name}_noise_std"] = z * clip
        out[f"{name}_noise_to_signal"] = z * clip / max(float(norms.mean()), 1e-12)
    return out
