"""medfl.privacy.quantize: min-max quantization (eqs. 14-15) and bit packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm as normal

from medfl.messages import PayloadError, validate_payload
from medfl.privacy.quantize import (
    DTYPE_CODES,
    dequantize_tensor,
    pack_codes,
    quantization_step,
    quantize_tensor,
    unpack_codes,
)

ALL_BITS = list(range(1, 17))
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
Z = normal.ppf(1 - 1e-6 / 2)  # two-sided 1e-6 band for statistical checks


def _tensor(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (7, 13, 11),
            seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 + 0.1).to(dtype)


def _tolerance(t: torch.Tensor, step: float, steps: float) -> float:
    """``steps`` quantization steps, plus float64 slack and the target dtype's rounding."""
    magnitude = float(t.double().abs().max())
    return steps * step + 1e-12 * (magnitude + step) + torch.finfo(t.dtype).eps * magnitude


# --- packing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_unpack_round_trip(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, size=n)
    if n >= 2:
        codes[0], codes[-1] = 0, 2**bits - 1  # the extremes survive
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == math.ceil(n * bits / 8)
    back = unpack_codes(packed, bits, n)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, codes)


def test_pack_layouts():
    codes = np.array([1, 2, 258, 65535])
    np.testing.assert_array_equal(pack_codes(codes[:2], 8).numpy(), [1, 2])
    np.testing.assert_array_equal(pack_codes(codes, 16).numpy(),
                                  [1, 0, 2, 0, 2, 1, 255, 255])  # little-endian pairs
    # 1 bit: eight codes per byte, first code in the least significant bit
    np.testing.assert_array_equal(pack_codes(np.array([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).numpy(),
                                  [0b10000001, 0b00000001])


def test_pack_block_boundaries_round_trip():
    # more values than one packing block, an odd width, a length not a multiple of 8
    n = (1 << 18) * 2 + 13
    codes = np.random.default_rng(5).integers(0, 2**11, size=n)
    np.testing.assert_array_equal(unpack_codes(pack_codes(codes, 11), 11, n), codes)


@pytest.mark.parametrize("bits", [0, 17, -1, 8.0, True, None])
def test_pack_refuses_bad_bits(bits):
    with pytest.raises(ValueError, match="bits must be an int in 1..16"):
        pack_codes(np.zeros(4, dtype=np.int64), bits)
    with pytest.raises(ValueError, match="bits must be an int in 1..16"):
        unpack_codes(torch.zeros(4, dtype=torch.uint8), bits, 4)


def test_pack_refuses_out_of_range_or_float_codes():
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        pack_codes(np.array([0, 16]), 4)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        pack_codes(np.array([-1, 3]), 4)
    with pytest.raises(ValueError, match="codes must be integers"):
        pack_codes(np.array([0.0, 1.0]), 4)


def test_unpack_refuses_bad_input():
    with pytest.raises(ValueError, match="take 2 bytes, got 3"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 4, 4)
    with pytest.raises(ValueError, match="1-D uint8 tensor"):
        unpack_codes(torch.zeros(2, dtype=torch.int16), 4, 4)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        unpack_codes(torch.zeros(2, dtype=torch.uint8), 4, -1)


# --- quantize / dequantize --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_round_trip_error_is_at_most_half_a_step(bits, dtype):
    t = _tensor(dtype)
    q = quantize_tensor(t, bits)
    back = dequantize_tensor(q, "w")
    assert back.dtype == dtype and back.shape == t.shape
    step = quantization_step(q["lo"], q["hi"], bits)
    assert step == (q["hi"] - q["lo"]) / (2**bits - 1) > 0
    error = float((back.double() - t.double()).abs().max())
    assert error <= _tolerance(t, step, 0.5)
    # the extremes are codes 0 and 2**bits - 1
    assert float(back.double().min()) == q["lo"] == float(t.double().min())


@pytest.mark.parametrize("dtype", DTYPES)
def test_lo_and_hi_are_the_exact_extremes(dtype):
    t = _tensor(dtype)
    q = quantize_tensor(t, 4)
    assert isinstance(q["lo"], float) and isinstance(q["hi"], float)
    assert q["lo"] == float(t.double().min()) and q["hi"] == float(t.double().max())


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8, 12, 16])
def test_stochastic_rounding_error_is_under_one_step(bits):
    t = _tensor(torch.float64)
    q = quantize_tensor(t, bits, stochastic=True, generator=torch.Generator().manual_seed(bits))
    back = dequantize_tensor(q, "w")
    step = quantization_step(q["lo"], q["hi"], bits)
    error = (back - t).abs()
    assert float(error.max()) < step
    # it really rounds at random: some values go to the farther level
    if bits <= 8:
        assert float(error.max()) > 0.5 * step


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    # 200k copies of one value between two levels; the mean of the dequantized copies must
    # be the value (each copy is off by less than a step, with variance <= step^2 / 4).
    n = 200_000
    value = 0.3137
    t = torch.cat([torch.tensor([0.0, 1.0], dtype=torch.float64),
                   torch.full((n,), value, dtype=torch.float64)])
    q = quantize_tensor(t, bits, stochastic=True, generator=torch.Generator().manual_seed(11))
    back = dequantize_tensor(q, "w")[2:]
    step = quantization_step(q["lo"], q["hi"], bits)
    assert float(back.mean()) == pytest.approx(value, abs=Z * (step / 2) / math.sqrt(n))
    # deterministic rounding of the same tensor is biased by more than that band
    det = dequantize_tensor(quantize_tensor(t, bits), "w")[2:]
    assert abs(float(det.mean()) - value) > Z * (step / 2) / math.sqrt(n)


def test_stochastic_rounding_is_unbiased_per_coordinate():
    t = _tensor(torch.float64, shape=(50,), seed=3)
    g = torch.Generator().manual_seed(2024)
    draws = 2000
    total = torch.zeros_like(t)
    for _ in range(draws):
        total += dequantize_tensor(quantize_tensor(t, 3, stochastic=True, generator=g), "w")
    step = quantization_step(float(t.min()), float(t.max()), 3)
    band = Z * (step / 2) / math.sqrt(draws)
    assert float((total / draws - t).abs().max()) <= band


def test_stochastic_rounding_is_reproducible_and_needs_a_generator():
    t = _tensor()
    a = quantize_tensor(t, 3, stochastic=True, generator=torch.Generator().manual_seed(1))
    b = quantize_tensor(t, 3, stochastic=True, generator=torch.Generator().manual_seed(1))
    c = quantize_tensor(t, 3, stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a["codes"], b["codes"]) and not torch.equal(a["codes"], c["codes"])
    with pytest.raises(ValueError, match="w: stochastic rounding needs a generator"):
        quantize_tensor(t, 3, stochastic=True, where="w")


@pytest.mark.parametrize("bits,expected", [(8, 1000), (4, 500), (1, 125), (16, 2000), (3, 375)])
def test_code_bytes(bits, expected):
    q = quantize_tensor(_tensor(shape=(1000,)), bits)
    assert q["codes"].numel() == expected


@pytest.mark.parametrize("n", [1, 7, 9])
def test_code_bytes_round_up(n):
    assert quantize_tensor(_tensor(shape=(n,)), 1)["codes"].numel() == math.ceil(n / 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 4), (1,), (), (1, 1, 1)])
def test_constant_tensors_dequantize_to_exactly_lo(dtype, shape):
    t = torch.full(shape, -0.8125, dtype=dtype)
    for bits in (1, 7, 16):
        q = quantize_tensor(t, bits)
        assert q["lo"] == q["hi"] == -0.8125
        assert not unpack_codes(q["codes"], bits, t.numel()).any()
        back = dequantize_tensor(q, "w")
        assert back.dtype == dtype and back.shape == t.shape
        assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 5)])
def test_empty_tensors_round_trip(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    q = quantize_tensor(t, 5)
    assert q["codes"].numel() == 0 and q["shape"] == shape
    back = dequantize_tensor(q, "w")
    assert back.shape == t.shape and back.dtype == dtype


def test_round_trip_of_float64_extremes():
    big = torch.finfo(torch.float64).max
    t = torch.tensor([-big, 0.0, big], dtype=torch.float64)
    back = dequantize_tensor(quantize_tensor(t, 2), "w")
    assert torch.isfinite(back).all()
    assert back[0] == -big and back[2] == big


def test_encoding_holds_only_message_types():
    q = quantize_tensor(_tensor(torch.bfloat16), 6)
    assert set(q) == {"codes", "lo", "hi", "bits", "shape", "dtype"}
    assert isinstance(q["codes"], torch.Tensor) and q["codes"].dtype == torch.uint8
    assert type(q["lo"]) is float and type(q["hi"]) is float
    assert type(q["bits"]) is int and type(q["dtype"]) is int
    assert type(q["shape"]) is tuple and all(type(s) is int for s in q["shape"])
    assert DTYPE_CODES[q["dtype"]] == torch.bfloat16
    validate_payload({"w": q}, "reply", allow_str=False)


def test_dequantize_accepts_a_list_shape():
    t = _tensor(shape=(3, 4))
    q = quantize_tensor(t, 8)
    q["shape"] = list(q["shape"])
    assert dequantize_tensor(q, "w").shape == (3, 4)


def test_quantize_does_not_modify_its_input():
    t = _tensor(torch.float64)
    before = t.clone()
    quantize_tensor(t, 3, stochastic=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(t, before)


@pytest.mark.parametrize("bits", [0, 17, -3, 4.0, True, "8", None])
def test_quantize_refuses_bad_bits(bits):
    with pytest.raises(ValueError, match=r"^layer\.w: bits must be an int in 1..16"):
        quantize_tensor(_tensor(), bits, where="layer.w")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_quantize_refuses_non_floating_tensors(dtype):
    with pytest.raises(ValueError, match="layer.w: only floating-point tensors"):
        quantize_tensor(torch.zeros(3, dtype=dtype), 8, where="layer.w")


@pytest.mark.parametrize("bad,found", [(math.nan, "1 NaN and 0 inf"), (math.inf, "0 NaN and 1 inf"),
                                       (-math.inf, "0 NaN and 1 inf")])
def test_quantize_refuses_non_finite_values(bad, found):
    t = _tensor(shape=(10,))
    t[4] = bad
    with pytest.raises(ValueError, match=f"layer.w: cannot quantize non-finite values: found "
                                         f"{found} among 10"):
        quantize_tensor(t, 8, where="layer.w")


# --- dequantize_tensor on hostile input -------------------------------------------------------

def _good() -> dict:
    return quantize_tensor(_tensor(shape=(4, 5)), 3)  # 20 values, 60 bits: 8 bytes


def _with(**changes) -> dict:
    q = _good()
    for key, value in changes.items():
        if value is _DROP:
            del q[key]
        else:
            q[key] = value
    return q


_DROP = object()

BAD_ENCODINGS = {
    "missing key": (_with(lo=_DROP), r"missing \['lo'\]"),
    "extra key": (_with(extra=1), r"unexpected \['extra'\]"),
    "codes not a tensor": (_with(codes=[1, 2, 3]), "codes must be a 1-D uint8 tensor, got list"),
    "codes not uint8": (_with(codes=torch.zeros(8, dtype=torch.int8)),
                        "codes must be a 1-D uint8 tensor"),
    "codes not 1-D": (_with(codes=torch.zeros(2, 4, dtype=torch.uint8)),
                      "codes must be a 1-D uint8 tensor"),
    "codes too short": (_with(codes=torch.zeros(7, dtype=torch.uint8)),
                        "20 values of 3 bits take 8 code bytes, got 7"),
    "codes too long": (_with(codes=torch.zeros(9, dtype=torch.uint8)),
                       "20 values of 3 bits take 8 code bytes, got 9"),
    "bits zero": (_with(bits=0), "bits must be an int in 1..16"),
    "bits 17": (_with(bits=17), "bits must be an int in 1..16"),
    "bits float": (_with(bits=3.0), "bits must be an int in 1..16"),
    "bits bool": (_with(bits=True), "bits must be an int in 1..16"),
    "bits mismatch": (_with(bits=4), "20 values of 4 bits take 10 code bytes, got 8"),
    "shape negative": (_with(shape=(-4, -5)), "shape must be a tuple of ints >= 0"),
    "shape float": (_with(shape=(4.0, 5)), "shape must be a tuple of ints >= 0"),
    "shape not a sequence": (_with(shape=20), "shape must be a tuple of ints >= 0"),
    "shape tensor": (_with(shape=torch.tensor([4, 5])), "shape must be a tuple of ints >= 0"),
    "shape mismatch": (_with(shape=(4, 6)), "24 values of 3 bits take 9 code bytes, got 8"),
    "lo nan": (_with(lo=math.nan), "lo must be a finite number"),
    "hi inf": (_with(hi=math.inf), "hi must be a finite number"),
    "lo bool": (_with(lo=False), "lo must be a finite number"),
    "hi tensor": (_with(hi=torch.tensor(1.0)), "hi must be a finite number"),
    "lo above hi": (_with(lo=2.0, hi=1.0), "lo=2.0 exceeds hi=1.0"),
    "hi beyond dtype": (_with(hi=1e300), "hi=1e\\+300 is beyond the range of torch.float32"),
    "unknown dtype": (_with(dtype=9), "unknown dtype code 9"),
    "dtype bool": (_with(dtype=False), "unknown dtype code False"),
}


@pytest.mark.parametrize("name", list(BAD_ENCODINGS))
def test_dequantize_refuses_malformed_encodings(name):
    q, match = BAD_ENCODINGS[name]
    with pytest.raises(PayloadError, match=match) as err:
        dequantize_tensor(q, "reply from client 3['w']")
    assert str(err.value).startswith("reply from client 3['w']: ")


@pytest.mark.parametrize("q", [None, [1, 2], torch.zeros(3)])
def test_dequantize_refuses_non_dicts(q):
    with pytest.raises(PayloadError, match="^w: a quantized tensor must be a dict"):
        dequantize_tensor(q, "w")


def test_the_good_encoding_used_above_is_accepted():
    assert dequantize_tensor(_good(), "w").shape == (4, 5)
