"""Min-max quantization of a tensor to ``bits`` bits per value, bit-packed (PFedCDP eqs. 14-15).

A floating-point tensor ``x`` with minimum ``lo`` and maximum ``hi`` is sent as integer codes
in ``[0, 2**b - 1]``:

* eq. 14, :func:`quantize_tensor`: ``code = round((x - lo) / (hi - lo) * (2**b - 1))``, or
  with stochastic rounding ``floor(v + u)``, ``u ~ U[0, 1)``, which is unbiased;
* eq. 15, :func:`dequantize_tensor`: ``x' = lo + code / (2**b - 1) * (hi - lo)``.

Deterministic rounding is off by at most half a step ``(hi - lo) / (2**b - 1)`` per value,
stochastic rounding by less than one step, with ``E[x'] = x``.

The encoding of one tensor is a dict of a uint8 tensor, Python ints and floats and a tuple of
ints, so it can travel in a :mod:`medfl.messages` payload::

    {"codes": uint8 1-D tensor, "lo": float, "hi": float, "bits": int,
     "shape": tuple[int, ...], "dtype": int}   # dtype: a key of DTYPE_CODES

Codes are packed densely: ``ceil(n * bits / 8)`` bytes for ``n`` values (8 bits: one byte per
value; 16 bits: two little-endian bytes per value; other widths: the codes' bits, least
significant first, packed with ``np.packbits(..., bitorder="little")``).

:func:`dequantize_tensor` runs at the coordinator on what a site sent, so it checks the
encoding fully and raises :class:`medfl.messages.PayloadError` for anything malformed.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from medfl.messages import PayloadError

__all__ = [
    "DTYPE_CODES",
    "quantize_tensor",
    "dequantize_tensor",
    "pack_codes",
    "unpack_codes",
    "quantization_step",
]

DTYPE_CODES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.float64,
    2: torch.float16,
    3: torch.bfloat16,
}
"""The floating-point dtypes an encoding can restore, by the int code it carries."""

_CODE_OF: dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPE_CODES.items()}
_KEYS = frozenset({"codes", "lo", "hi", "bits", "shape", "dtype"})
# Values packed or unpacked per block: a multiple of 8, so every block starts on a byte, and
# small enough that the (block, bits) bit matrices stay a few MB for 11M-value tensors.
_BLOCK = 1 << 18


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_bits(bits: Any, where: str) -> int:
    if not _is_int(bits) or not 1 <= bits <= 16:
        raise ValueError(f"{where}: bits must be an int in 1..16, got {bits!r}")
    return int(bits)


def _packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def quantization_step(lo: float, hi: float, bits: int) -> float:
    """The spacing between two consecutive dequantized values, ``(hi - lo) / (2**bits - 1)``.

    What it is for: the error bound of a quantized tensor (half a step with deterministic
    rounding, under one step with stochastic rounding).

    Args:
        lo: the tensor's minimum.
        hi: the tensor's maximum, ``>= lo``.
        bits: bits per value, an int in 1..16.

    Returns:
        The step, ``0.0`` for a constant tensor.

    Raises:
        ValueError: ``bits`` is not an int in 1..16, or ``lo > hi``.
    """
    bits = _check_bits(bits, "quantization_step")
    if not lo <= hi:
        raise ValueError(f"quantization_step: lo={lo!r} must not exceed hi={hi!r}")
    return (float(hi) - float(lo)) / (2**bits - 1)


def pack_codes(codes: np.ndarray, bits: int) -> torch.Tensor:
    """Pack integer codes of ``bits`` bits each into bytes.

    Args:
        codes: integer array of codes in ``[0, 2**bits)``, any shape (read flattened, C order).
        bits: bits per code, an int in 1..16.

    Returns:
        A 1-D ``torch.uint8`` tensor of ``ceil(n * bits / 8)`` bytes (``n = codes.size``): the
        codes themselves for 8 bits, little-endian byte pairs for 16 bits, otherwise each
        code's bits least significant first, packed densely (the last byte zero-padded).

    Raises:
        ValueError: ``bits`` is not an int in 1..16, ``codes`` is not an integer array, or a
            code is outside ``[0, 2**bits)``.
    """
    bits = _check_bits(bits, "pack_codes")
    arr = np.asarray(codes).reshape(-1)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"pack_codes: codes must be integers, got dtype {arr.dtype}")
    n = arr.size
    if n and (int(arr.min()) < 0 or int(arr.max()) > 2**bits - 1):
        raise ValueError(
            f"pack_codes: codes must lie in [0, {2**bits - 1}] for {bits} bits, found "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
    if bits == 8:
        out = arr.astype(np.uint8)
    elif bits == 16:
        out = arr.astype("<u2").view(np.uint8)
    else:
        small = arr.astype(np.uint16, copy=False)
        shifts = np.arange(bits, dtype=np.uint16)
        out = np.empty(_packed_len(n, bits), dtype=np.uint8)
        for start in range(0, n, _BLOCK):
            block = small[start:start + _BLOCK]
            bit_matrix = ((block[:, None] >> shifts) & 1).astype(np.uint8)  # (block, bits)
            packed = np.packbits(bit_matrix.reshape(-1), bitorder="little")
            first = start * bits // 8
            out[first:first + packed.size] = packed
    return torch.from_numpy(np.ascontiguousarray(out))


def _check_packed(packed: Any, n: int, bits: int, error: type[Exception], what: str, take: str,
                  unit: str) -> None:
    """Raise ``error`` unless ``packed`` is a 1-D strided uint8 tensor of the
    ``ceil(n * bits / 8)`` bytes that ``n`` codes of ``bits`` bits take (``what`` and ``take``
    start the two messages)."""
    if (not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8
            or packed.layout != torch.strided or packed.dim() != 1):
        got = (f"{packed.dtype} tensor of shape {tuple(packed.shape)}"
               if isinstance(packed, torch.Tensor) else type(packed).__name__)
        raise error(f"{what} must be a 1-D uint8 tensor, got {got}")
    expected = _packed_len(n, bits)
    if packed.numel() != expected:
        raise error(f"{take} {expected} {unit}, got {packed.numel()}")


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> np.ndarray:
    """Unpack ``n`` codes of ``bits`` bits each, the inverse of :func:`pack_codes`.

    Args:
        packed: a 1-D ``torch.uint8`` tensor of exactly ``ceil(n * bits / 8)`` bytes.
        bits: bits per code, an int in 1..16.
        n: how many codes, an int >= 0.

    Returns:
        A 1-D ``np.int64`` array of ``n`` codes in ``[0, 2**bits)``.

    Raises:
        ValueError: ``bits`` or ``n`` invalid, ``packed`` not a 1-D uint8 tensor, or of the
            wrong length.
    """
    bits = _check_bits(bits, "unpack_codes")
    if not _is_int(n) or n < 0:
        raise ValueError(f"unpack_codes: n must be an int >= 0, got {n!r}")
    _check_packed(packed, n, bits, ValueError, "unpack_codes: packed",
                  f"unpack_codes: {n} codes of {bits} bits take", "bytes")
    raw = packed.detach().cpu().contiguous().numpy()
    if bits == 8:
        return raw.astype(np.int64)
    if bits == 16:
        return raw.view("<u2").astype(np.int64)
    out = np.empty(n, dtype=np.int64)
    for start in range(0, n, _BLOCK):
        count = min(_BLOCK, n - start)
        first = start * bits // 8
        bit_matrix = np.unpackbits(
            raw[first:first + _packed_len(count, bits)], count=count * bits, bitorder="little"
        ).reshape(count, bits)
        block = np.zeros(count, dtype=np.int64)
        for j in range(bits):
            block |= bit_matrix[:, j].astype(np.int64) << j
        out[start:start + count] = block
    return out


def quantize_tensor(
    t: torch.Tensor,
    bits: int,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    where: str = "tensor",
) -> dict[str, Any]:
    """Quantize a floating-point tensor to ``bits`` bits per value between its min and max.

    eq. 14, computed in float64: ``v = (x - lo) / (hi - lo) * (2**bits - 1)``, then
    ``code = floor(v + 0.5)`` (round to nearest, halves up) or, with ``stochastic=True``,
    ``code = floor(v + u)`` with ``u ~ U[0, 1)`` drawn from ``generator`` (unbiased), clamped to
    ``[0, 2**bits - 1]``. A constant tensor (``hi == lo``, also any 0- or 1-element tensor) has
    all codes 0.

    Args:
        t: the tensor, of a dtype in :data:`DTYPE_CODES` (float32, float64, float16,
            bfloat16), any shape (empty included), finite values only.
        bits: bits per value, an int in 1..16.
        stochastic: unbiased stochastic rounding instead of round-to-nearest (default False).
        generator: the random source for stochastic rounding (required then; ignored
            otherwise); ``n`` float64 uniforms are drawn from it on its device.
        where: a readable name of the tensor for error messages (default ``"tensor"``).

    Returns:
        ``{"codes": 1-D uint8 tensor of ceil(n * bits / 8) bytes, "lo": float, "hi": float,
        "bits": int, "shape": tuple of ints, "dtype": int code}``; ``lo`` and ``hi`` are the
        exact min and max (``0.0`` for an empty tensor).

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: naming ``where``: ``bits`` not an int in 1..16 (bools refused), ``t`` not
            floating point (pass integer tensors through unquantized) or of an unsupported
            float dtype, ``t`` holding NaN or inf, or ``stochastic`` without ``generator``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(t).__name__}")
    bits = _check_bits(bits, where)
    if not t.is_floating_point():
        raise ValueError(
            f"{where}: only floating-point tensors are quantized, got {t.dtype} (send integer "
            f"tensors as they are)"
        )
    if t.dtype not in _CODE_OF:
        raise ValueError(
            f"{where}: cannot quantize {t.dtype}; supported: "
            f"{', '.join(str(d) for d in DTYPE_CODES.values())}"
        )
    if stochastic and generator is None:
        raise ValueError(f"{where}: stochastic rounding needs a generator")
    codes, lo, hi = _codes(t, bits, generator if stochastic else None, where)
    return {"codes": pack_codes(codes, bits), "lo": lo, "hi": hi, "bits": bits,
            "shape": tuple(int(s) for s in t.shape), "dtype": _CODE_OF[t.dtype]}


def _codes(t: torch.Tensor, bits: int, generator: torch.Generator | None,
           where: str) -> tuple[np.ndarray, float, float]:
    """:func:`quantize_tensor`'s eq. 14 on ``t``'s values in float64: ``(codes, lo, hi)``, the
    codes flat ``uint16``, stochastic rounding when ``generator`` is given.

    Raises:
        ValueError: ``t`` holds NaN or inf (naming ``where`` and how many of each)."""
    x = t.detach().reshape(-1).to("cpu", torch.float64).numpy()
    n = x.size
    lo = hi = 0.0
    if n:
        finite = np.isfinite(x)
        if not finite.all():
            n_nan = int(np.isnan(x).sum())
            n_inf = n - int(finite.sum()) - n_nan
            raise ValueError(
                f"{where}: cannot quantize non-finite values: found {n_nan} NaN and {n_inf} "
                f"inf among {n} values"
            )
        lo, hi = float(x.min()), float(x.max())
    levels = 2**bits - 1
    if hi == lo:
        codes = np.zeros(n, dtype=np.uint16)
    else:
        span = hi - lo
        if math.isfinite(span):
            v = x - lo
            v /= span
        else:  # float64 values near the dtype's limits: halve to avoid overflow
            v = x / 2 - lo / 2
            v /= hi / 2 - lo / 2
        del x  # keep the peak at two float64 copies
        v *= levels
        if generator is not None:
            u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
            v += u.cpu().numpy()
        else:
            v += 0.5
        np.floor(v, out=v)
        np.clip(v, 0, levels, out=v)
        codes = v.astype(np.uint16)
    return codes, lo, hi


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def dequantize_tensor(q: dict[str, Any], where: str) -> torch.Tensor:
    """Restore a tensor from :func:`quantize_tensor`'s encoding (eq. 15), checking it fully.

    ``x = lo + code / (2**bits - 1) * (hi - lo)`` in float64, cast to the encoded dtype and
    reshaped to ``shape``; exactly ``lo`` everywhere when ``hi == lo``. Meant to run at the
    coordinator on what a site sent: nothing in ``q`` is trusted.

    Args:
        q: the encoding, a dict with exactly the keys ``codes``, ``lo``, ``hi``, ``bits``,
            ``shape`` and ``dtype``; ``shape`` may be a tuple or a list.
        where: a readable location for error messages, e.g. ``"reply from client 3['w']"``.

    Returns:
        A new CPU tensor of the encoded dtype and shape.

    Raises:
        PayloadError: naming ``where``: ``q`` not a dict, missing or extra keys, ``codes`` not
            a 1-D uint8 tensor or of the wrong byte length for ``(n, bits)``, ``bits`` not an
            int in 1..16, ``shape`` not a tuple/list of ints >= 0, ``lo``/``hi`` not finite
            numbers (or beyond the dtype's range) or ``lo > hi``, an unknown dtype code.
    """
    if not isinstance(q, dict):
        raise PayloadError(f"{where}: a quantized tensor must be a dict, got {type(q).__name__}")
    keys = set(q)
    if keys != _KEYS:
        missing, extra = sorted(_KEYS - keys), sorted(map(repr, keys - _KEYS))
        raise PayloadError(
            f"{where}: a quantized tensor has exactly the keys {sorted(_KEYS)}; "
            f"missing {missing}, unexpected [{', '.join(extra)}]"
        )
    bits, shape, code, lo, hi, packed = (q["bits"], q["shape"], q["dtype"], q["lo"], q["hi"],
                                         q["codes"])
    if not _is_int(bits) or not 1 <= bits <= 16:
        raise PayloadError(f"{where}: bits must be an int in 1..16, got {bits!r}")
    bits = int(bits)
    if not isinstance(shape, (tuple, list)) or not all(_is_int(s) and s >= 0 for s in shape):
        raise PayloadError(f"{where}: shape must be a tuple of ints >= 0, got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if not _is_int(code) or int(code) not in DTYPE_CODES:
        raise PayloadError(
            f"{where}: unknown dtype code {code!r}; known: "
            f"{', '.join(f'{k} ({v})' for k, v in DTYPE_CODES.items())}"
        )
    dtype = DTYPE_CODES[int(code)]
    limit = float(torch.finfo(dtype).max)
    for name, value in (("lo", lo), ("hi", hi)):
        if not _is_real(value) or not math.isfinite(value):
            raise PayloadError(f"{where}: {name} must be a finite number, got {value!r}")
        if abs(value) > limit:
            raise PayloadError(f"{where}: {name}={value!r} is beyond the range of {dtype}")
    lo, hi = float(lo), float(hi)
    if lo > hi:
        raise PayloadError(f"{where}: lo={lo!r} exceeds hi={hi!r}")
    n = math.prod(shape)
    _check_packed(packed, n, bits, PayloadError, f"{where}: codes", f"{where}: {n} values of {bits} bits take",
                  "code bytes")
    levels = 2**bits - 1
    if hi == lo:
        values = np.full(n, lo, dtype=np.float64)
    else:
        codes = unpack_codes(packed, bits, n)
        if n and int(codes.max()) > levels:  # cannot happen with packing; cheap to be sure
            raise PayloadError(f"{where}: a code exceeds {levels} for {bits} bits")
        values = codes.astype(np.float64)
        values /= levels
        span = hi - lo
        if math.isfinite(span):
            values *= span
            values += lo
        else:  # lo*(1 - c) + hi*c cannot overflow where hi - lo does
            values = lo * (1.0 - values) + hi * values
    return torch.from_numpy(values).to(dtype).reshape(shape)
