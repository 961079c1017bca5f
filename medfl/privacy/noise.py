"""Noise draws that are finite by construction: every Gaussian and Laplace draw of medfl.

A Laplace draw made by the inverse CDF from a float32 uniform, ``-b sign(u) log1p(-2|u|)``
with ``u = rand - 0.5``, is ``-inf`` when ``rand`` returns 0 (``u = -0.5``): once in about
2^24 draws, so almost surely in a long run (issue 48: FedTPF's distillation went NaN once in
547 batches). The draws here never take a logarithm of 0, whatever the backend returns:

* the uniforms are float64 from ``torch.rand`` (``[0, 1)``), turned into ``1 - u`` and
  clamped to ``[2^-53, 1]`` (:data:`TINY`), so ``-log`` of them lies in ``[0, 53 ln 2]``
  (at most 36.74);
* :func:`laplace` is the difference of two independent Exp(1) draws ``-log u1 + log u2``,
  which is exactly Laplace(0, 1) for continuous uniforms, times the scale: ``|x| <= 36.74 b``;
* :func:`gaussian` is the Box-Muller transform ``sqrt(-2 log u1) cos(2 pi u2)`` (and
  ``sin`` for the second half of the draws), exactly N(0, 1) for continuous uniforms, times
  the std: ``|x| <= sqrt(106 ln 2) std = 8.57 std``.

Both are computed in float64 and cast to the requested dtype at the end; the std or scale is
checked so that the largest possible draw fits that dtype. The 53-bit grid of the uniforms
truncates the tails beyond those bounds (probability below 1e-16 per draw for the Laplace,
below 1e-17 for the Gaussian): nothing a run of 10^12 draws could notice.

Draws are made on the generator's device (CPU for :func:`medfl.privacy.gaussian.noise_generator`)
and then moved, so one seed gives the same noise in any process; a ``None`` generator uses
torch's default CPU generator.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["TINY", "GAUSSIAN_BOUND", "LAPLACE_BOUND", "gaussian", "laplace"]

#: the smallest uniform a draw takes the logarithm of (the float64 ``rand`` grid step)
TINY = 2.0 ** -53
#: the largest ``|x| / std`` a :func:`gaussian` draw can have: ``sqrt(-2 ln TINY)``
GAUSSIAN_BOUND = math.sqrt(-2.0 * math.log(TINY))
#: the largest ``|x| / scale`` a :func:`laplace` draw can have: ``-ln TINY``
LAPLACE_BOUND = -math.log(TINY)

Shape = torch.Size | tuple[int, ...] | list[int]


def _check(value: float, name: str, bound: float, dtype: torch.dtype, where: str) -> float:
    """``value`` as a float, checked: a finite number >= 0 whose largest draw fits ``dtype``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{where}: dtype must be a floating-point dtype, got {dtype}")
    if float(value) * bound > torch.finfo(dtype).max:
        raise ValueError(f"{where}: {name} {value!r} can give draws beyond the largest {dtype} "
                         f"({torch.finfo(dtype).max:.3g})")
    return float(value)


def _uniform(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` float64 uniforms in ``[TINY, 1]`` on the generator's device: never 0."""
    where = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=where)
    return torch.rsub(u, 1.0).clamp_(min=TINY, max=1.0)


def _shaped(x: torch.Tensor, shape: Shape, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """The float64 draws ``x`` as a tensor of ``shape`` and ``dtype`` on ``device``."""
    out = x.reshape(tuple(shape)).to(dtype)
    return out if device is None else out.to(device)


def gaussian(shape: Shape, std: float, generator: torch.Generator | None = None, *,
             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Independent ``N(0, std^2)`` draws of ``shape``, finite by construction (Box-Muller in
    float64 from uniforms in ``[2^-53, 1]``; ``|x| <= 8.57 std``).

    Args:
        shape: the output shape (``()`` for one draw).
        std: the standard deviation, a finite number >= 0 (0 gives zeros, and draws nothing).
        generator: the random source, advanced by ``2 * ceil(n / 2)`` float64 uniforms for
            ``n`` draws; the draws are made on its device.
        dtype: the output dtype (floating point); the draw is cast to it at the end.
        device: where the result goes (default: the generator's device).

    Raises:
        ValueError: ``std`` is not a finite number >= 0, ``dtype`` is not floating point, or
            ``8.57 std`` exceeds the dtype's largest value.
    """
    std = _check(std, "std", GAUSSIAN_BOUND, dtype, "gaussian")
    n = math.prod(int(s) for s in shape)
    if std == 0 or n == 0:
        where = device if device is not None else (generator.device if generator is not None else "cpu")
        return torch.zeros(tuple(shape), dtype=dtype, device=where)
    half = (n + 1) // 2
    u = _uniform(2 * half, generator)
    radius = torch.log(u[:half]).mul_(-2.0).sqrt_().mul_(std)
    angle = u[half:].mul(2.0 * math.pi)
    x = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]
    return _shaped(x, shape, dtype, device)


def laplace(shape: Shape, scale: float, generator: torch.Generator | None = None, *,
            dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Independent Laplace draws of ``scale`` b (density ``exp(-|x| / b) / 2b``, variance
    ``2 b^2``) of ``shape``, finite by construction: ``b (E1 - E2)`` with ``E = -log u``
    Exp(1) draws from float64 uniforms in ``[2^-53, 1]`` (``|x| <= 36.74 b``).

    Args:
        shape: the output shape.
        scale: b, a finite number >= 0 (0 gives zeros, and draws nothing).
        generator: the random source, advanced by ``2 n`` float64 uniforms for ``n`` draws;
            the draws are made on its device.
        dtype: the output dtype (floating point); the draw is cast to it at the end.
        device: where the result goes (default: the generator's device).

    Raises:
        ValueError: as :func:`gaussian`, for ``scale`` and ``36.74 scale``.
    """
    scale = _check(scale, "scale", LAPLACE_BOUND, dtype, "laplace")
    n = math.prod(int(s) for s in shape)
    if scale == 0 or n == 0:
        where = device if device is not None else (generator.device if generator is not None else "cpu")
        return torch.zeros(tuple(shape), dtype=dtype, device=where)
    e = torch.log(_uniform(2 * n, generator))
    x = (e[n:] - e[:n]).mul_(scale)
    return _shaped(x, shape, dtype, device)
