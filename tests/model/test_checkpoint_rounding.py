"""Rounding in every float conversion of the checkpoint module, on the exact halfway bit patterns: round half to
even, as the formats' reference implementations do (IEEE 754's default; CPython's struct 'e' packing for FP16,
PyTorch's round_to_nearest_even for BF16), and NaN stays NaN.

- the writer, `_encode`: FP32 -> BF16 (bits) and FP32 -> FP16;
- the loader, `_RowReader`: FP32 -> FP16 and BF16 -> FP16, where a value that rounds past 65504 is an overflow
  the loader refuses (65520, the halfway point to the next power of two, rounds up: refused) and one that
  rounds down to 65504 loads.

The references here are written from the rule alone (nearest in exact float64 arithmetic, the even one on a
tie), never with the NumPy casts the module itself uses."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from cullama.model import checkpoint
from cullama.model.checkpoint import EMBED, TensorInfo, open_checkpoint, write_random
from cullama.common.errors import CheckpointError

from tests.model.test_checkpoint import SMALL, WEIGHTS, read_raw, write_raw

RNG = np.random.default_rng(21)


def bf16_value(bits) -> np.ndarray:
    """BF16 bit patterns as float64, exactly."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_reference(x32: np.ndarray) -> np.ndarray:
    """The BF16 bits nearest to each finite float32 (ties to the even pattern; past the largest BF16 by half an
    ulp or more: inf, as IEEE rounding says). Exact float64 arithmetic, no casts."""
    bits = x32.view(np.uint32)
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    low = magnitude >> 16  # the BF16 at or below |x|
    below, above = bf16_value(low), bf16_value(low + 1)
    above = np.where(low + 1 == 0x7F80, 2.0 ** 128, above)  # inf stands for 2^128 when rounding
    x = np.abs(x32.astype(np.float64))
    up = (x - below > above - x) | ((x - below == above - x) & (low % 2 == 1))
    return ((low + up) | (sign >> 16)).astype(np.uint16)


def fp16_reference(x: float) -> int | None:
    """CPython's FP16 packing (round half to even) of an exact value; None where it overflows FP16."""
    try:
        return struct.unpack("<H", struct.pack("<e", float(x)))[0]
    except OverflowError:
        return None


def halfway_float32(high_halves: np.ndarray) -> np.ndarray:
    """float32 values whose low 16 bits are exactly half a BF16 ulp (0x8000), and their neighbours either side."""
    high = np.asarray(high_halves, np.uint32) << 16
    return np.concatenate([high | 0x8000, high | 0x7FFF, high | 0x8001]).view(np.float32)


# BF16 high halves: every exponent, both signs, even and odd last bits; none is inf or NaN (exponent all ones).
HIGH_HALVES = np.unique(np.concatenate([
    [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x3F82, 0x4780, 0x477F, 0x7F7E, 0x7F7F],
    RNG.integers(0, 0x7F80, 4000)]).astype(np.uint32))
HIGH_HALVES = np.concatenate([HIGH_HALVES, HIGH_HALVES | 0x8000])


def fp16_midpoints() -> tuple[np.ndarray, np.ndarray]:
    """(x, expected): the exact midpoint between every pair of neighbouring finite FP16 values of either sign
    (float32 holds it: 12 significant bits), and the FP16 bits it rounds to, the even neighbour (inf past
    65504)."""
    low = np.arange(0x7C00, dtype=np.uint16)  # 0 .. 65504 (0x7BFF); low + 1 up to inf
    values = low.view(np.float16).astype(np.float64)
    nexts = (low + 1).view(np.float16).astype(np.float64)
    nexts[-1] = 65536.0  # inf stands for 2^16 when rounding
    mid = (values + nexts) / 2
    even = np.where(low % 2 == 0, low, low + 1).astype(np.uint16)
    x = np.concatenate([mid, -mid]).astype(np.float32)
    assert np.array_equal(x.astype(np.float64), np.concatenate([mid, -mid]))  # exact in float32
    return x, np.concatenate([even, even | 0x8000]).astype(np.uint16)


def converted(values: np.ndarray, dtype: str) -> np.ndarray:
    """values (stored as `dtype`: F32, or BF16 as its bits) through the loader's row reader, one row."""
    info = TensorInfo("t", dtype, (1, values.size), Path("t.safetensors"), 0, values.nbytes)
    (_, rows), = iter(checkpoint._RowReader(info, values.reshape(1, -1)))
    return rows.reshape(-1).view(np.uint16).copy()


# ---- the writer --------------------------------------------------------------------------------------------
def test_the_writer_rounds_float32_to_bfloat16_half_to_even():
    x = halfway_float32(HIGH_HALVES)
    got, want = checkpoint._encode(x, "BF16"), bf16_reference(x)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(hex(int(x.view(np.uint32)[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]
    # spelled out: 1 + 2^-8 (halfway between 1 and 1 + 2^-7) goes down to 1, 1 + 3 x 2^-8 up to 1 + 2^-6
    assert checkpoint._encode(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32), "BF16").tolist() == [0x3F80, 0x3F82]


def test_the_writer_keeps_nan_nan_in_bfloat16():
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF, 0xFF800001, 0x7FBFFFFF], np.uint32)
    bits = checkpoint._encode(nans.view(np.float32), "BF16")
    assert np.isnan(bf16_value(bits)).all(), [hex(int(b)) for b in bits]
    assert bits.tolist() == [0x7FC0] * len(nans)  # the quiet NaN, as PyTorch writes every NaN
    inf = checkpoint._encode(np.array([np.inf, -np.inf], np.float32), "BF16")
    assert inf.tolist() == [0x7F80, 0xFF80]


def test_the_writer_rounds_float32_to_float16_half_to_even():
    x, want = fp16_midpoints()
    with np.errstate(over="ignore"):  # 65520 rounds to inf
        got = checkpoint._encode(x, "F16").view(np.uint16)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]


# ---- the loader ---------------------------------------------------------------------------------------------
def test_the_loader_rounds_float32_to_float16_half_to_even_and_refuses_what_rounds_past_65504():
    x, want = fp16_midpoints()
    finite = np.abs(x) < 65520
    got = converted(x[finite], "F32")
    assert np.array_equal(got, want[finite]), np.flatnonzero(got != want[finite])[:5]
    assert all(fp16_reference(v) == w for v, w in zip(x[finite][::997], want[finite][::997]))  # CPython agrees
    below = np.nextafter(np.float32(65520), np.float32(0))  # rounds down to 65504: loads
    assert converted(np.array([below, -below], np.float32), "F32").tolist() == [0x7BFF, 0xFBFF]
    for edge in (65520.0, -65520.0):
        assert fp16_reference(edge) is None  # CPython: too large for FP16
        with pytest.raises(CheckpointError, match=f"float32 value {edge:g} overflows float16"):
            converted(np.array([1.0, edge], np.float32), "F32")


def test_the_loader_rounds_bfloat16_to_float16_half_to_even():
    """BF16 has fewer significant bits than FP16, so only FP16's subnormal range rounds: every BF16 pattern below
    65520 of either sign against CPython's packing (the ties among them: 2^-25 -> 0, 3 x 2^-25 -> 2^-23, ...)."""
    bits = np.arange(0x7F80, dtype=np.uint32)
    bits = bits[bf16_value(bits) < 65520]
    bits = np.concatenate([bits, bits | 0x8000]).astype(np.uint16)
    want = np.array([fp16_reference(v) for v in bf16_value(bits)], np.uint16)
    got = converted(bits, "BF16")
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(hex(int(bits[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]
    ties = np.array([0x3300, 0x33C0, 0xB300, 0xB3C0], np.uint16)  # 2^-25, 3 x 2^-25 and their negatives
    assert converted(ties, "BF16").tolist() == [0x0000, 0x0002, 0x8000, 0x8002]
    with pytest.raises(CheckpointError, match="bfloat16 value 65536 overflows float16"):
        converted(np.array([0x4780], np.uint16), "BF16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_of_halfway_values_loads_rounded_half_to_even(tmp_path, dtype):
    """End to end: the embedding of a written checkpoint replaced by halfway values, read by open_checkpoint."""
    directory = write_random(tmp_path, SMALL, dtype=dtype)
    header, data = read_raw(directory / WEIGHTS)
    start, end = header[EMBED]["data_offsets"]
    n = (end - start) // (4 if dtype == "float32" else 2)
    if dtype == "float32":
        x, want = fp16_midpoints()
        keep = np.abs(x) < 65520
        pick = RNG.choice(np.flatnonzero(keep), n, replace=False)
        raw, want = x[pick].tobytes(), want[pick]
    else:
        ties = np.array([0x3300, 0x33C0, 0xB300, 0xB3C0, 0x3380, 0x3FC0], np.uint16)  # + 2^-24 and 1.5: exact
        stored = np.resize(ties, n)
        raw, want = stored.tobytes(), np.resize(np.array([0x0000, 0x0002, 0x8000, 0x8002, 0x0001, 0x3E00],
                                                         np.uint16), n)
    write_raw(directory / WEIGHTS, header, data[:start] + raw + data[end:])
    got = open_checkpoint(directory).tensor(EMBED).reshape(-1).view(np.uint16)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]
