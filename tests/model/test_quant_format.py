"""cullama/model/quant.py, the quantized device format, checked against its definition written out independently here:
the interleaved order's defining property (a mask after a shift gives codes 2s and 2s + 1 in the two 16-bit
halves), pack / unpack as inverses with the code range enforced, dequantize exact in float32 and rounded half
to even in float16, and quantize's round to nearest, half to even, for the codes and the INT4 zero point."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from cullama.model import quant
from cullama.model.quant import QuantFormat, dequantize, pack, params, quantize, unpack

RNG = np.random.default_rng(16)


def fp16_reference(x: float) -> float:
    """CPython's FP16 packing of an exact value (round half to even), as a float."""
    return struct.unpack("<e", struct.pack("<e", float(x)))[0]


def codes(M: int, K: int, bits: int) -> np.ndarray:
    q = RNG.integers(0, 1 << bits, (M, K))
    q[0, :min(K, 4)] = [0, (1 << bits) - 1, 1, (1 << bits) - 2][:min(K, 4)]  # both ends of the range
    return q


# ---- the format ---------------------------------------------------------------------------------------------
def exactly(value, expected) -> bool:
    """Equal and of the same types all the way down: shapes and byte counts are ints, never floats."""
    if isinstance(expected, (tuple, list)):
        return type(value) is type(expected) and len(value) == len(expected) and all(map(exactly, value, expected))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(exactly(value[k], expected[k]) for k in expected)
    return type(value) is type(expected) and value == expected


def test_formats_and_their_shape_contract():
    int4, int8 = QuantFormat(4, quant.INT4_GROUP), QuantFormat(8, 16)  # on-load int4's group is a valid one
    assert exactly((int4.per_word, int8.per_word), (8, 4))
    assert exactly(int4.shapes(3, 256), {"qweight": (3, 32), "qparams": (3, 2, 2)})
    assert exactly(int8.shapes(5, 48), {"qweight": (5, 12), "qparams": (5, 3, 2)})
    assert exactly(int4.nbytes(3, 256), 3 * 256 // 2 + 3 * 2 * 4) and exactly(int8.nbytes(5, 48), 5 * 48 + 5 * 3 * 4)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a format is a value: hashable, never changed in place
        int4.bits = 8
    assert {int4: 1}[QuantFormat(4, quant.INT4_GROUP)] == 1
    QuantFormat(4, 32), QuantFormat(8, 16), QuantFormat(8, 4096)  # the least groups: one 16-byte vector
    for bits, group in [(2, 32), (16, 32), (3, 32), (4, 16), (4, 48), (8, 8), (8, 24), (4, 0), (8, 0), (4, -32)]:
        with pytest.raises(ValueError):
            QuantFormat(bits, group)
    int4.check(1, 128)
    for M, K in [(0, 128), (1, 0), (1, 64), (1, 96), (-1, 128)]:  # K a multiple of the group (and of 32)
        with pytest.raises(ValueError, match=f"\\[{M}, {K}\\]"):
            int4.check(M, K)
    QuantFormat(8, 16).check(1, 16)
    with pytest.raises(ValueError):
        QuantFormat(8, 16).check(1, 8)


@pytest.mark.parametrize("bits", quant.BITS)
def test_a_mask_after_a_shift_gives_codes_2s_and_2s_plus_1_in_the_two_halves(bits):
    """What the kernels' magic-number dequantization relies on: after a shift by s * bits, the mask 0x000F000F
    (4 bits) or 0x00FF00FF (8 bits) leaves code 2s of the word's codes in the low 16-bit half and code 2s + 1
    in the high half."""
    per_word = 32 // bits
    q = codes(6, 8 * per_word, bits)
    words = pack(q, bits)
    assert words.dtype == np.uint32 and words.shape == (6, 8)
    mask = np.uint32(0x000F000F if bits == 4 else 0x00FF00FF)
    for s in range(per_word // 2):
        halves = (words >> np.uint32(bits * s)) & mask
        assert np.array_equal(halves & 0xFFFF, q[:, 2 * s::per_word])
        assert np.array_equal(halves >> 16, q[:, 2 * s + 1::per_word])


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_and_unpack_are_inverses_and_the_code_range_is_enforced(bits):
    q = codes(5, 64, bits)
    back = unpack(pack(q, bits), bits)
    assert back.dtype == np.uint8 and np.array_equal(back, q)
    top = (1 << bits) - 1
    pack(np.full((1, 32), top), bits), pack(np.zeros((1, 32), int), bits)  # both ends are codes
    for bad in (top + 1, -1):
        with pytest.raises(ValueError, match="codes must lie in"):
            pack(np.full((1, 32), bad), bits)
    for shape in ((32,), (1, 32 // bits + 1), (1, 2, 32)):
        with pytest.raises(ValueError, match="codes must be"):
            pack(np.zeros(shape, int), bits)


def test_params_hold_scale_and_zero_side_by_side():
    scale = np.array([[0.5, 0.01]], np.float32)
    out = params(scale, np.array([[0, 256]]))
    assert out.dtype == np.float16 and out.shape == (1, 2, 2)
    assert out[0, :, 0].tolist() == [0.5, float(np.float16(0.01))] and out[0, :, 1].tolist() == [0, 256]


@pytest.mark.parametrize("zero", [257, -1, 0.5, 2049, 1e9])
def test_params_refuse_a_zero_point_that_is_not_an_integer_from_0_to_256(zero):
    with pytest.raises(ValueError, match="zero points must be integers from 0 to 256"):
        params(np.ones((1, 1), np.float32), np.array([[zero]]))


# ---- dequantize ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, group", [(4, 32), (8, 16), (4, 64)])
def test_dequantize_is_exact_in_float32_and_half_to_even_in_float16(bits, group):
    M, K = 7, 128
    q = codes(M, K, bits)
    scale = (RNG.random((M, K // group)) * 0.1 + 1e-3).astype(np.float16)
    scale[0, 0] = np.float16(1 + 2**-10)  # with q - zero = 3: 3 + 3 x 2^-10, a tie in FP16
    zero = RNG.integers(0, (1 << bits) + 1, (M, K // group))
    zero[0, 0] = 1 << (bits - 1)
    q[0, :4] = zero[0, 0] + np.array([3, 1, 5, -3])
    words, qp = pack(q, bits), params(scale, zero)
    exact = (q - np.repeat(zero, group, axis=1)) * np.repeat(scale.astype(np.float64), group, axis=1)
    w32, w16 = dequantize(words, qp, bits), dequantize(words, qp, bits, np.float16)
    assert w32.dtype == np.float32 and w16.dtype == np.float16 and w32.shape == (M, K)
    assert np.array_equal(w32.astype(np.float64), exact)
    want16 = np.vectorize(fp16_reference)(exact)
    assert np.array_equal(w16.astype(np.float64), want16)
    assert w16[0, 0] == fp16_reference(3 + 3 * 2**-10) == 3 + 2**-8  # the tie, to the even neighbour


# ---- quantize: round to nearest, half to even -----------------------------------------------------------------
def test_int8_codes_round_half_to_even_with_zero_128():
    w = np.zeros((1, 16), np.float32)
    w[0, :9] = [127, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5, -127]  # max |w| = 127: the scale is exactly 1
    qweight, qp = quantize(w, QuantFormat(8, 16))
    assert qp[0, 0].tolist() == [1.0, 128.0]
    assert unpack(qweight, 8)[0, :9].tolist() == [255, 130, 126, 128, 128, 130, 126, 132, 1]


def test_int4_zero_point_and_codes_round_half_to_even():
    # min -1.5, max 13.5: scale (13.5 + 1.5) / 15 = 1, zero = rint(1.5) = 2
    w = np.zeros((1, 32), np.float32)
    w[0, :6] = [-1.5, 13.5, 0.5, 2.5, -0.5, 11.5]
    qweight, qp = quantize(w, QuantFormat(4, 32))
    assert qp[0, 0].tolist() == [1.0, 2.0]
    assert unpack(qweight, 4)[0, :6].tolist() == [0, 15, 2, 4, 2, 14]  # 13.5 -> 14 + 2 = 16: clipped to 15
    assert unpack(qweight, 4)[0, 6:].tolist() == [2] * 26  # zeros sit at the zero point


def test_an_all_zero_group_gets_scale_0_and_dequantizes_to_0():
    w = RNG.standard_normal((2, 64)).astype(np.float32)
    w[1, 32:] = 0
    for fmt in (QuantFormat(4, 32), QuantFormat(8, 32)):
        qweight, qp = quantize(w, fmt)
        assert qp[1, 1, 0] == 0 and np.array_equal(dequantize(qweight, qp, fmt.bits)[1, 32:], np.zeros(32))
        zero = 128 if fmt.bits == 8 else 0
        assert qp[1, 1, 1] == zero and np.all(unpack(qweight, fmt.bits)[1, 32:] == zero)  # codes at the zero point


def test_an_int4_range_always_holds_0():
    """A group of positive weights gets zero point 0 and one of negative weights 15: the range is [min(w, 0),
    max(w, 0)], so 0 dequantizes exactly and each weight lies within half a step."""
    w = np.zeros((3, 32), np.float32)
    w[0] = np.linspace(0.5, 2.0, 32)
    w[1] = -np.linspace(0.5, 2.0, 32)
    w[2] = np.linspace(-0.01, 0.02, 32)  # small: a range well inside (-1, 1)
    qweight, qp = quantize(w, QuantFormat(4, 32))
    assert qp[:, 0, 1].tolist() == [0, 15, 5]
    assert qp[:, 0, 0].tolist() == np.float16([2.0 / 15, 2.0 / 15, 0.03 / 15]).tolist()
    err = np.abs(dequantize(qweight, qp, 4) - w)
    assert np.all(err <= qp[:, :, 0].astype(np.float32) * np.float32(0.5 + 1e-6))


@pytest.mark.parametrize("fmt", [QuantFormat(8, 64), QuantFormat(8, 128), QuantFormat(4, 32), QuantFormat(4, 128)],
                         ids=["int8-g64", "int8-per-channel", "int4-g32", "int4-g128"])
def test_quantize_is_within_half_a_step_and_each_group_has_its_own_scale(fmt):
    M, K = 9, 256
    w = (RNG.standard_normal((M, K)) * np.exp(RNG.standard_normal((M, 1)))).astype(np.float16)  # rows differ
    w[:, :fmt.group] *= np.float16(8)  # the first group is larger than the others
    qweight, qp = quantize(w, fmt)
    assert qweight.dtype == np.uint32 and qweight.shape == fmt.shapes(M, K)["qweight"]
    assert qp.dtype == np.float16 and qp.shape == fmt.shapes(M, K)["qparams"]
    g = w.astype(np.float32).reshape(M, K // fmt.group, fmt.group)
    top = (1 << fmt.bits) - 1
    if fmt.bits == 8:
        want_scale = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float16)
        assert np.all(qp[..., 1] == 128)
    else:
        lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)
        want_scale = ((hi - lo) / np.float32(top)).astype(np.float16)
        assert np.array_equal(qp[..., 1], np.clip(np.rint(-lo / want_scale.astype(np.float32)), 0, top))
    assert np.array_equal(qp[..., 0], want_scale)
    step = np.repeat(want_scale.astype(np.float32), fmt.group, axis=1)
    err = np.abs(dequantize(qweight, qp, fmt.bits) - w.astype(np.float32))
    q = unpack(qweight, fmt.bits)
    inside = (q > 0) & (q < top)  # codes at the ends may be clipped
    assert np.all(err[inside] <= step[inside] * np.float32(0.5 + 1e-6))
    assert np.all(err <= step * np.float32(1.0 + 1e-6))  # the zero point's rounding moves the range by half a step


def test_a_group_too_small_for_a_normal_fp16_scale_still_gets_codes_in_range():
    """Weights around 1e-6: the scale is an FP16 subnormal, rounded by up to half its value, so -min / scale can
    pass 15 and codes below the zero point clip at 0 (never wrap to 255). Dequantized weights keep their order."""
    w = np.zeros((1, 32), np.float32)
    w[0] = np.linspace(-1.335e-6, 0.0, 32)  # scale 8.9e-8 rounds down to 5.96e-8 (FP16's least): -min / scale 22
    qweight, qp = quantize(w, QuantFormat(4, 32))
    assert float(qp[0, 0, 0]) == 2.0**-24 and qp[0, 0, 1] == 15
    q = unpack(qweight, 4)[0]
    assert q[0] == 0 and np.all(np.diff(q.astype(int)) >= 0) and q[-1] == 15
    assert np.all(np.diff(dequantize(qweight, qp, 4)[0]) >= 0)
