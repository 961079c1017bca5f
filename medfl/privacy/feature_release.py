"""A declared differential-privacy release of per-sample features: FedTPF's (and FedFed's)
shared set ``x_p = clip(x_s) + n`` (paper 003, section III-E).

Per-sample, image-shaped data may leave a client only this way, and only medfl releases it:
a method declares the release (:class:`SampleRelease`, ``Method.release_plan``) and returns
the features unnoised; the engine performs it at the client after the method's code returned
(:func:`perform_release`) and the content guard checks what leaves (issue 38). Each sample is
released once:

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from medfl.privacy import noise
from medfl.privacy.accounting import PrivacyConfigError, check_delta, check_positive, epsilon_spent, noise_for_epsilon
from medfl.privacy.declared import Release as LedgerRelease

__all__ = ["MECHANISMS", "RELEASE_METRICS", "Release", "SampleRelease", "method_release", "release_features", "release_at",
           "release_with_variance", "perform_release", "release_noise", "variance_scale", "perturb_features",
           "noise_comparison", "norm_quantile"]

MECHANISMS = ("gaussian", "laplace")

#: The reply metrics of a release reply that medfl writes from its own record of the release
#: (:func:`perform_release`); a method's own metrics may not use these names there.
RELEASE_METRICS = ("released", "noise_std", "epsilon", "clipped_fraction", "signal_norm", "noise_norm",
                   "noise_to_signal")


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


@dataclass(frozen=True)
class SampleRelease(LedgerRelease):
    """A method's per-sample release (``Method.release_plan``), which **medfl** performs at
    the client: the method's client step returns the features unnoised under :attr:`keys`
    (and the samples' labels under :attr:`labels`) in its reply to an instruction that asks
    for the release (``RELEASE_FLAG``); after the method's code returned, medfl clips each
    sample's features (all keys together, one vector per sample) and adds the noise this
    record states (:func:`perform_release`), then the content guard checks what leaves. The
    ledger records exactly this release (``privacy.csv``), so what is counted is what was done.

    Attributes (beyond :class:`medfl.privacy.declared.Release`'s, whose ``mechanism`` is the name in
    ``privacy.csv``, ``noise_multiplier`` the noise over the clip and ``clip`` the sensitivity):
        keys: the reply keys holding per-sample features ``(N, ...)``, ``N`` the client's
            training samples in the train split's order.
        labels: the reply key holding those samples' labels (sent in the clear, as they
            are: it must equal the train split's labels, in order), or ``None``.
        noise: ``"gaussian"`` (L2 clip, Gaussian noise of std ``noise_multiplier * clip``)
            or ``"laplace"`` (L1 clip, Laplace noise of scale ``noise_multiplier * clip``).
        variance: a fixed noise variance on *unclipped* features (paper 003's reading; no
            differential privacy: ``noise_multiplier`` 0 and ``clip`` infinite), or ``None``.

    ``noise_multiplier`` 0 without ``variance``: the features are clipped and sent without
    noise (a measurement, not private); the content guard then also checks them as the method
    returned them. A ``clip`` of NaN is set during the run by the coordinator (from public
    data, at no privacy cost) and travels in the release instruction (``RELEASE_CLIP``).

    Raises:
        PrivacyConfigError: no key, a label key among the feature keys, an unknown noise, a
            sample rate other than 1, a negative or non-finite noise multiplier, a clip that
            is not > 0 (or NaN), a variance with a finite clip or a noise multiplier.
    """

    unit: str = "sample"
    keys: tuple[str, ...] = ()
    labels: str | None = None
    noise: str = "gaussian"
    variance: float | None = None

    def __post_init__(self) -> None:
        where = f"release {self.mechanism!r}"
        if isinstance(self.keys, list):
            object.__setattr__(self, "keys", tuple(self.keys))
        if not self.keys or not all(isinstance(k, str) and k for k in self.keys) or isinstance(self.keys, str):
            raise PrivacyConfigError(f"{where}: keys must name the reply keys of the features medfl releases, "
                                     f"got {self.keys!r}")
        if self.labels is not None and (not isinstance(self.labels, str) or self.labels in self.keys):
            raise PrivacyConfigError(f"{where}: labels must be a reply key other than the feature keys, "
                                     f"got {self.labels!r}")
        if self.noise not in MECHANISMS:
            raise PrivacyConfigError(f"{where}: noise must be one of {', '.join(MECHANISMS)}, got {self.noise!r}")
        if self.sample_rate != 1.0 or self.unit != "sample":
            raise PrivacyConfigError(f"{where}: each sample is released once per request: unit 'sample' and "
                                     f"sample_rate 1, got {self.unit!r} and {self.sample_rate!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise PrivacyConfigError(f"{where}: noise_multiplier must be a finite number >= 0, "
                                     f"got {self.noise_multiplier!r}")
        if self.variance is not None:
            if not (math.isfinite(self.variance) and self.variance > 0) or self.noise_multiplier != 0 \
                    or self.clip != math.inf:
                raise PrivacyConfigError(f"{where}: a fixed variance (> 0) goes on unclipped features: noise "
                                         f"multiplier 0 and clip infinite, got variance {self.variance!r}, "
                                         f"noise multiplier {self.noise_multiplier!r}, clip {self.clip!r}")
        elif not (math.isnan(self.clip) or (math.isfinite(self.clip) and self.clip > 0)):
            raise PrivacyConfigError(f"{where}: clip must be a finite number > 0 (or NaN: set during the run), "
                                     f"got {self.clip!r}")

    @property
    def private(self) -> bool:
        """Whether the release is differentially private (clipped, with noise)."""
        return self.variance is None and self.noise_multiplier > 0

    @property
    def noised(self) -> bool:
        """Whether medfl adds noise (a DP release, or the fixed variance)."""
        return self.variance is not None or self.noise_multiplier > 0


def method_release(method: Any) -> SampleRelease | None:
    """A method's per-sample release (``Method.release_plan``) as medfl performs it, or
    ``None`` when it makes none.

    Raises:
        PrivacyConfigError: the method still uses the old contract (``payload_exemptions``,
            which excuses nothing any more), or its plan is not a :class:`SampleRelease`
            naming the keys medfl releases.
    """
    name = getattr(method, "name", type(method).__name__)
    if getattr(type(method), "payload_exemptions", None):
        raise PrivacyConfigError(
            f"method {name!r} sets payload_exemptions {sorted(type(method).payload_exemptions)}: a method no longer "
            "excuses reply keys from the content guard. Declare the per-sample release in release_plan() as a "
            "medfl.privacy.feature_release.SampleRelease naming its keys and return the features unnoised: medfl "
            "adds the noise at the client (docs/plugins.md, 'Per-sample releases')")
    plan = method.release_plan()
    if plan is not None and not isinstance(plan, SampleRelease):
        raise PrivacyConfigError(
            f"method {name!r}: release_plan() must return a medfl.privacy.feature_release.SampleRelease (the reply "
            f"keys medfl clips and noises at the client, with the noise the ledger records), got "
            f"{type(plan).__name__}: a method cannot make a release itself (docs/plugins.md, 'Per-sample releases')")
    return plan


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
    if mechanism == "gaussian":
        z = noise_for_epsilon(epsilon, check_delta(delta, where), 1.0, 1, accountant)
        return release_at(x_s, noise_multiplier=z, clip=clip, delta=delta, accountant=accountant, generator=generator,
                          where=where)
    b = clip / epsilon
    record = Release("laplace", epsilon, 0.0, clip, b * math.sqrt(2), 1.0 / epsilon, len(x_s), 0.0, accountant=None)
    return _release(x_s, clip, b, mechanism, generator, record, where)


def release_at(x_s: torch.Tensor, *, noise_multiplier: float, clip: float, mechanism: str = "gaussian",
               delta: float = 1e-5, accountant: str = "rdp", generator: torch.Generator | None = None,
               where: str = "release_at") -> tuple[torch.Tensor, Release]:
    """:func:`release_features` with the noise given as a multiplier of the clip (what a
    :class:`SampleRelease` records): Gaussian noise of std ``noise_multiplier * clip`` after
    an L2 clip, its epsilon from the accountant at ``delta``; or Laplace noise of scale
    ``noise_multiplier * clip`` after an L1 clip (epsilon ``1 / noise_multiplier``).

    Raises:
        PrivacyConfigError: as :func:`release_features` (the multiplier must be > 0), naming
            ``where``.
    """
    if mechanism not in MECHANISMS:
        raise PrivacyConfigError(f"{where}: mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    z = check_positive(noise_multiplier, "noise_multiplier", where)
    clip = check_positive(clip, "clip", where)
    if mechanism == "gaussian":
        delta = check_delta(delta, where)
        spent = epsilon_spent([(z, 1.0, 1)], delta, accountant)
        record = Release("gaussian", spent, delta, clip, z * clip, z, len(x_s), 0.0, accountant=accountant)
        return _release(x_s, clip, z * clip, mechanism, generator, record, where)
    b = z * clip
    record = Release("laplace", 1.0 / z, 0.0, clip, b * math.sqrt(2), z, len(x_s), 0.0, accountant=None)
    return _release(x_s, clip, b, mechanism, generator, record, where)


def _release(x_s: torch.Tensor, clip: float, scale: float, mechanism: str, generator: torch.Generator | None,
             record: Release, where: str) -> tuple[torch.Tensor, Release]:
    """Clip each sample of ``x_s`` to ``clip`` and add noise of per-coordinate ``scale``; fill
    in ``record``'s clipped fraction and mean norms. The step both releases share."""
    if not torch.isfinite(x_s).all():
        raise PrivacyConfigError(f"{where}: x_s holds NaN or infinite values; nothing is released")
    flat = x_s.detach().flatten(1).double()
    clipped, norms = _clip(flat, clip, mechanism)
    # the noise is drawn on the generator's device (the CPU: seeded the same on any machine)
    noise = _draw(clipped.shape, scale, mechanism, generator, torch.float64).to(clipped.device)
    record.clipped_fraction = float((norms > clip).double().mean())
    record.signal_norm, record.noise_norm = _mean_norm(clipped), _mean_norm(noise)
    return (clipped + noise).to(x_s.dtype).view_as(x_s), record


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


def perform_release(payload: dict[str, Any], plan: SampleRelease, *, clip: float, train_labels: np.ndarray,
                    generator: torch.Generator, where: str) -> tuple[dict[str, Any], dict[str, float]]:
    """The release ``plan`` describes, done by medfl on a reply ``payload`` at the client,
    after the method's client step returned it: each sample's features under ``plan.keys``
    (one vector per sample across the keys) clipped to ``clip`` and noised with
    :func:`release_at`, or noised with ``plan.variance`` unclipped
    (:func:`release_with_variance`), or only clipped (noise multiplier 0: not private).

    Args:
        clip: the clip to use (``plan.clip``, or the coordinator's when that is NaN).
        train_labels: the client's training labels in the train split's order: the features
            hold one row per training sample, and ``plan.labels`` must be exactly these.
        generator: the noise's generator, seeded with the site's secret at a site.
        where: the reply's readable location, for errors.

    Returns:
        ``(payload, metrics)``: a new payload with the released features (each key in its
        dtype and shape, on the CPU), and medfl's record of the release as reply metrics
        (:data:`RELEASE_METRICS`: ``epsilon`` only for a private release).

    Raises:
        PayloadError: a feature key missing or not a floating-point tensor with one row per
            training sample, non-finite features, or labels other than the train split's.
    """
    from medfl.messages import PayloadError

    n = len(train_labels)
    feats = []
    for key in plan.keys:
        x = payload.get(key)
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 and x.shape[0] == n):
            got = (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else
                   "nothing" if x is None else type(x).__name__)
            raise PayloadError(f"{where}[{key!r}]: release {plan.mechanism!r} expects floating-point features "
                               f"(N, ...) with one row per training sample (N = {n}), got {got}")
        if not bool(torch.isfinite(x).all()):
            raise PayloadError(f"{where}[{key!r}]: the features hold NaN or infinite values; nothing is released")
        feats.append(x.detach().cpu())
    if plan.labels is not None:
        y = payload.get(plan.labels)
        if not (isinstance(y, torch.Tensor) and not y.is_floating_point() and y.dim() == 1
                and np.array_equal(y.cpu().numpy().astype(np.int64), np.asarray(train_labels, dtype=np.int64))):
            raise PayloadError(f"{where}[{plan.labels!r}]: release {plan.mechanism!r} sends the labels of the "
                               f"client's {n} training samples in the clear, as an integer vector in the train "
                               "split's order, and nothing else under that key")
    flat = torch.cat([x.flatten(1).double() for x in feats], dim=1)
    if plan.variance is not None:
        x_p, rec = release_with_variance(flat, variance=plan.variance, mechanism=plan.noise, generator=generator)
    elif plan.noise_multiplier > 0:
        x_p, rec = release_at(flat, noise_multiplier=plan.noise_multiplier, clip=clip, mechanism=plan.noise,
                              delta=plan.delta, accountant=plan.accountant, generator=generator, where=where)
    else:   # noise off: clipped only, a measurement the ledger records as not private
        x_p, norms = _clip(flat, check_positive(clip, "clip", where), plan.noise)
        rec = Release(plan.noise, math.inf, plan.delta, clip, 0.0, 0.0, n, float((norms > clip).double().mean()),
                      accountant=None, signal_norm=_mean_norm(x_p), noise_norm=0.0)
    out = dict(payload)
    start = 0
    for key, x in zip(plan.keys, feats):
        width = x[0].numel() if n else int(np.prod(x.shape[1:]))
        out[key] = x_p[:, start:start + width].to(x.dtype).reshape(x.shape).contiguous()
        start += width
    metrics = {"released": float(n), "noise_std": rec.noise_std, "clipped_fraction": rec.clipped_fraction,
               "signal_norm": rec.signal_norm, "noise_norm": rec.noise_norm,
               "noise_to_signal": rec.noise_norm / rec.signal_norm if rec.signal_norm > 0 else math.nan}
    if plan.private:
        metrics["epsilon"] = rec.epsilon
    return out, metrics


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
    ``generator`` (seeded the same on any machine), finite by construction
    (:mod:`medfl.privacy.noise`)."""
    draw = noise.gaussian if mechanism == "gaussian" else noise.laplace
    return draw(tuple(shape), float(scale), generator, dtype=dtype, device="cpu")


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
