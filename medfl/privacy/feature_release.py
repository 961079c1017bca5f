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

:func:`release_with_variance` is paper 003's own reading (section IV-B, Table VIII): noise
of a fixed variance ``sigma_s^2`` added to the *unclipped* ``x_s``. Nothing bounds a sample's
contribution, so it is no differential-privacy mechanism: its record carries an infinite
epsilon, and a run records it as not private.

Every record also says how much of what was released is noise: the mean per-sample L2 norms
of the noise and of the (clipped) signal it was added to, measured on the released tensors.

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

__all__ = ["MECHANISMS", "Release", "release_features", "release_with_variance", "release_noise", "variance_scale",
           "perturb_features", "noise_comparison", "norm_quantile"]

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
    #: mean per-sample L2 norm of the signal released (``x_s`` after clipping)
    signal_norm: float = math.nan
    #: mean per-sample L2 norm of the noise added to it
    noise_norm: float = math.nan

    @property
    def noise_to_signal(self) -> float:
        """The mean noise norm over the mean clipped-signal norm (``inf`` for a zero signal):
        above 1, a released feature is more noise than signal."""
        if not self.signal_norm > 0:
            return math.inf if self.noise_norm > 0 else math.nan
        return self.noise_norm / self.signal_norm

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
        noise = _draw(clipped.shape, std, mechanism, generator, torch.float64)
        record = Release("gaussian", spent, delta, clip, std, z, len(flat), float((norms > clip).double().mean()),
                         accountant=accountant)
    else:
        b = clip / epsilon
        noise = _draw(clipped.shape, b, mechanism, generator, torch.float64)
        record = Release("laplace", epsilon, 0.0, clip, b * math.sqrt(2), 1.0 / epsilon, len(flat),
                         float((norms > clip).double().mean()), accountant=None)
    # the noise is drawn on the generator's device (the CPU: seeded the same on any machine)
    noise = noise.to(clipped.device)
    record.signal_norm, record.noise_norm = _mean_norm(clipped), _mean_norm(noise)
    x_p = (clipped + noise).to(x_s.dtype).view_as(x_s)
    return x_p, record


def release_with_variance(x_s: torch.Tensor, *, variance: float, mechanism: str = "gaussian",
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, Release]:
    """Paper 003's release (section IV-B, Table VIII): ``x_p = x_s + n`` with noise of a fixed
    ``variance`` per coordinate (Gaussian ``N(0, variance)``, or Laplace of scale
    ``sqrt(variance / 2)``, the same variance) on the *unclipped* ``x_s``.

    Not a differential-privacy release: no clip bounds one sample's contribution, so no
    noise level gives an epsilon. The record says so: ``epsilon`` infinite, ``clip``
    infinite, ``noise_multiplier`` 0 (the noise over an unbounded sensitivity).

    Raises:
        PrivacyConfigError: an unknown mechanism, a variance that is not a finite number > 0,
            or non-finite values in ``x_s``.
    """
    where = "release_with_variance"
    if mechanism not in MECHANISMS:
        raise PrivacyConfigError(f"{where}: mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    variance = check_positive(variance, "variance", where)
    if not torch.isfinite(x_s).all():
        raise PrivacyConfigError(f"{where}: x_s holds NaN or infinite values; nothing is released")
    flat = x_s.detach().flatten(1).double()
    noise = _draw(flat.shape, variance_scale(variance, mechanism), mechanism, generator, torch.float64)
    noise = noise.to(flat.device)
    record = Release(mechanism, math.inf, 0.0, math.inf, math.sqrt(variance), 0.0, len(flat), 0.0,
                     accountant=None, signal_norm=_mean_norm(flat), noise_norm=_mean_norm(noise))
    return (flat + noise).to(x_s.dtype).view_as(x_s), record


def variance_scale(variance: float, mechanism: str = "gaussian") -> float:
    """The per-coordinate noise parameter of a noise ``variance``: the Gaussian std
    ``sqrt(variance)`` or the Laplace scale ``sqrt(variance / 2)`` (a Laplace of scale b has
    variance 2 b^2); what :func:`perturb_features` takes as ``noise``."""
    return math.sqrt(variance if mechanism == "gaussian" else variance / 2.0)


def _mean_norm(flat: torch.Tensor) -> float:
    """The mean per-sample L2 norm of ``(N, ...)`` (0 for no sample)."""
    return float(flat.flatten(1).double().norm(dim=1).mean()) if flat.shape[0] else 0.0


def _draw(shape: torch.Size | tuple[int, ...], scale: float, mechanism: str, generator: torch.Generator | None,
          dtype: torch.dtype) -> torch.Tensor:
    """Noise of per-coordinate ``scale`` (Gaussian std or Laplace scale), drawn on the CPU from
    ``generator`` (seeded the same on any machine)."""
    if mechanism == "gaussian":
        return torch.randn(shape, generator=generator, dtype=dtype, device="cpu") * scale
    u = torch.rand(shape, generator=generator, dtype=dtype, device="cpu") - 0.5
    return -scale * torch.sign(u) * torch.log1p(-2 * u.abs())


def _clip(flat: torch.Tensor, clip: float, mechanism: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``flat`` scaled to norm at most ``clip`` (L2 for ``gaussian``, L1 for
    ``laplace``): ``(clipped, norms before clipping)``; differentiable."""
    norms = flat.norm(p=2 if mechanism == "gaussian" else 1, dim=1)
    scale = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)
    return flat * scale.unsqueeze(1), norms


def norm_quantile(norms: torch.Tensor, quantile: float) -> float:
    """The ``quantile`` of per-sample norms ``(N,)`` (linear interpolation, as
    :func:`torch.quantile`): a clip that fits the features, e.g. the median (0.5) of ``x_s``'s
    norms on public data, so clipping neither drowns small features in noise scaled to a
    large clip nor cuts most of them.

    Raises:
        PrivacyConfigError: no norm, a quantile outside (0, 1], or a quantile that is not a
            finite number > 0 (all-zero features give no clip).
    """
    where = "norm_quantile"
    if norms.numel() == 0:
        raise PrivacyConfigError(f"{where}: no sample to measure")
    if not 0.0 < float(quantile) <= 1.0:
        raise PrivacyConfigError(f"{where}: quantile must be in (0, 1], got {quantile!r}")
    value = float(torch.quantile(norms.detach().double().flatten(), float(quantile)))
    if not (math.isfinite(value) and value > 0):
        raise PrivacyConfigError(f"{where}: the {quantile:g} quantile of the norms is {value!r}: not a usable clip")
    return value


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


def perturb_features(x_s: torch.Tensor, *, clip: float | None, noise: float, mechanism: str = "gaussian",
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``clip(x_s) + n`` as the release makes it, differentiable in ``x_s``: each sample
    clipped to norm ``clip`` (L2, or L1 for ``laplace``; ``None``: not clipped, as
    :func:`release_with_variance` releases) and noise of per-coordinate ``noise`` (Gaussian
    std, or Laplace scale) added, drawn from ``generator``. For training and measuring (the
    paper's classifier sees ``x_p = x_s + n``), not a release: nothing is accounted."""
    flat = x_s.flatten(1)
    clipped = flat if clip is None else _clip(flat, clip, mechanism)[0]
    if noise > 0:
        clipped = clipped + _draw(clipped.shape, noise, mechanism, generator, clipped.dtype).to(clipped.device)
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
