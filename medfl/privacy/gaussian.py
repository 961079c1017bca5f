"""Clipping and Gaussian noise of a model update (PFedCDP eqs. 12-13).

An update is a dict ``{key: torch.Tensor}`` (a state-dict difference). Only the listed
``keys`` (floating-point tensors) are clipped and noised, together as one vector; the other
entries are passed through unchanged (the same objects). Nothing is modified in place.

* eq. 12, :func:`clip_update`: ``u <- u / max(1, ||u||_2 / C)`` over the listed tensors.
* eq. 13, :func:`add_noise`: ``u <- u + N(0, std^2 I)``; with ``std = noise_multiplier * C``
  the release is the Gaussian mechanism of sensitivity ``C`` that
  :mod:`medfl.privacy.accounting` accounts for.
"""

from __future__ import annotations

import math
import numbers

import torch

from medfl.privacy.accounting import check_positive
from medfl.privacy.noise import gaussian

__all__ = ["global_norm", "clip_update", "add_noise", "noise_generator"]


def _listed(update: dict[str, torch.Tensor], keys: list[str], where: str) -> list[torch.Tensor]:
    """The listed tensors, checked: present, floating point, no duplicate keys."""
    if len(set(keys)) != len(keys):
        raise ValueError(f"{where}: keys must not repeat, got {list(keys)}")
    tensors = []
    for key in keys:
        if key not in update:
            raise KeyError(f"{where}: key {key!r} is not in the update")
        t = update[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{where}: update[{key!r}] must be a floating-point tensor, got {kind}"
            )
        tensors.append(t.detach())
    return tensors


def global_norm(update: dict[str, torch.Tensor], keys: list[str]) -> float:
    """The L2 norm of the listed tensors taken together as one vector.

    What it is for: the norm that eq. 12 clips, and a diagnostic of update size.

    Args:
        update: ``{key: tensor}``, e.g. a state-dict difference.
        keys: the keys of the floating-point tensors to include (any shapes).

    Returns:
        ``sqrt(sum_k sum_i update[k]_i^2)``, accumulated in float64; ``0.0`` for no keys or
        empty tensors. ``nan`` or ``inf`` when a value is.

    Raises:
        KeyError: a listed key is missing from ``update``.
        ValueError: a listed entry is not a floating-point tensor, or a key repeats.
    """
    total = 0.0
    for t in _listed(update, keys, "global_norm"):
        if t.numel():
            total += float(torch.linalg.vector_norm(t, ord=2, dtype=torch.float64)) ** 2
    return math.sqrt(total)


def clip_update(
    update: dict[str, torch.Tensor], clip: float, keys: list[str]
) -> tuple[dict[str, torch.Tensor], float]:
    """Clip the listed tensors to a global L2 norm of at most ``clip`` (eq. 12).

    Every listed tensor is scaled by the same factor ``1 / max(1, norm / clip)`` (in float64,
    cast back to the tensor's dtype), so the update's direction is kept; an update already
    within the bound is returned with equal values (copies).

    Args:
        update: ``{key: tensor}``; not modified.
        clip: the bound ``C``, a finite number > 0.
        keys: the keys of the floating-point tensors to clip.

    Returns:
        ``(clipped, norm)``: a new dict with new tensors for the listed keys and the same
        objects for the others; ``norm`` is :func:`global_norm` before clipping.

    Raises:
        PrivacyConfigError: ``clip`` is not a finite number > 0 (a ``ValueError``).
        ValueError: the norm is not finite (a NaN or inf update cannot be clipped), or as
            :func:`global_norm`.
        KeyError: as :func:`global_norm`.
    """
    clip = check_positive(clip, "clip", "clip_update")
    norm = global_norm(update, keys)
    if not math.isfinite(norm):
        raise ValueError(
            f"clip_update: the update's norm over {len(keys)} tensors is {norm} (it holds NaN "
            f"or inf values); a non-finite update cannot be clipped"
        )
    scale = 1.0 / max(1.0, norm / clip)
    out = dict(update)
    for key in keys:
        t = update[key].detach()
        out[key] = t.clone() if scale == 1.0 else (t.to(torch.float64) * scale).to(t.dtype)
    return out, norm


def add_noise(
    update: dict[str, torch.Tensor], std: float, keys: list[str], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Add independent Gaussian noise ``N(0, std^2)`` to every coordinate (eq. 13).

    The noise is drawn with :func:`medfl.privacy.noise.gaussian` (finite by construction:
    Box-Muller in float64, ``|noise| <= 8.57 std``) on the generator's device (CPU for
    :func:`noise_generator`), cast to float32 (float64 for float64 tensors), one tensor after
    the other in the order of ``keys``, so the same seed gives the same noise in any process.
    It is added in that precision, then cast to the tensor's dtype and device.

    Args:
        update: ``{key: tensor}``; not modified.
        std: the noise standard deviation, a finite number >= 0; ``0`` returns copies.
        keys: the keys of the floating-point tensors to noise.
        generator: the random source, e.g. ``noise_generator(seed)``; advanced by the draw.

    Returns:
        A new dict: new tensors for the listed keys, the same objects for the others.

    Raises:
        ValueError: ``std`` is not a finite number >= 0, a listed entry is not a
            floating-point tensor, or a key repeats.
        KeyError: a listed key is missing.
    """
    if isinstance(std, bool) or not isinstance(std, numbers.Real) or not math.isfinite(std) \
            or std < 0:
        raise ValueError(f"add_noise: std must be a finite number >= 0, got {std!r}")
    tensors = _listed(update, keys, "add_noise")
    out = dict(update)
    for key, t in zip(keys, tensors):
        if std == 0:
            out[key] = t.clone()
            continue
        dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        noise = gaussian(t.shape, float(std), generator, dtype=dtype, device=t.device)
        out[key] = (t.to(dtype) + noise).to(t.dtype)
    return out


def noise_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed % 2**63``, for :func:`add_noise`.

    Args:
        seed: any int (negative or beyond 63 bits is reduced modulo ``2**63``), e.g. from
            :func:`medfl.seeding.derive_seed` of ``(run seed, round, client)``.

    Returns:
        A new generator; the same seed gives the same draws in any process.

    Raises:
        TypeError: ``seed`` is not an int (bools refused).
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"noise_generator: seed must be an int, got {type(seed).__name__}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) % 2**63)
    return gen
