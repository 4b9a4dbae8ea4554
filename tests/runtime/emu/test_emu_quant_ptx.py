"""The executor's mapping of the quantized kernels' PTX (cullama/runtime/emu/ptx.h, "quantized weights"), each against
the PTX ISA's definition written here independently in NumPy, over every immediate or a truth table:
    lop3.b32       every immLut (256) on the truth-table inputs and on random words
    prmt.b32       every selector of the default mode (2^16) on words whose bytes all differ, sign bits mixed
    add / sub / mul.rn.f16x2   every FP16 value against 64 others (specials included), rounded once to nearest
and the forms kernels_cu/dequant.cuh uses (lop3 0xEA, prmt 0x4240 / 0x4341 / 0x3232 / 0x1010) against plain C++
bit arithmetic, then dequant_word against cullama/model/quant.py's format: every 4- and 8-bit code and every zero."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cullama.runtime import emu
from cullama.model import quant
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.registry import KernelSpec

pytestmark = pytest.mark.emu

# Executor-only probes: lop3 and prmt take a runtime value for their immediate here (the rewrite passes the
# operand through; NVRTC would refuse it), so one kernel covers every immLut and every selector.
PROBES = r"""
#include "dequant.cuh"

extern "C" __global__ void lop3_every_lut(const unsigned* a, const unsigned* b, const unsigned* c, unsigned* out,
                                          int n) {
    const int lut = threadIdx.x;
    for (int i = 0; i < n; ++i) {
        unsigned d;
        asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a[i]), "r"(b[i]), "r"(c[i]), "n"(lut));
        out[lut * n + i] = d;
    }
}

extern "C" __global__ void prmt_every_selector(const unsigned* a, const unsigned* b, unsigned* out, int n) {
    for (int j = 0; j < 256; ++j) {
        const int selector = threadIdx.x * 256 + j;
        for (int i = 0; i < n; ++i) {
            unsigned d;
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a[i]), "r"(b[i]), "n"(selector));
            out[selector * n + i] = d;
        }
    }
}

// out[op][i][j] for words a[i] (two halves each) and b[j]: op 0 add, 1 sub, 2 mul.
extern "C" __global__ void f16x2_ops(const unsigned* a, const unsigned* b, unsigned* out, int na, int nb) {
    for (int i = threadIdx.x; i < na; i += blockDim.x)
        for (int j = 0; j < nb; ++j) {
            out[(0 * na + i) * nb + j] = hadd2(a[i], b[j]);
            out[(1 * na + i) * nb + j] = hsub2(a[i], b[j]);
            out[(2 * na + i) * nb + j] = hmul2(a[i], b[j]);
        }
}

// The immediates dequant.cuh uses against plain C++ bit arithmetic: bit k of bad[i] set where form k differs.
extern "C" __global__ void used_forms(const unsigned* w, unsigned* bad, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned x = w[i];
        unsigned flags = 0;
        flags |= (lop3<LUT_A_AND_B_OR_C>(x, 0x000F000Fu, FP16_1024X2) != ((x & 0x000F000Fu) | 0x64006400u)) << 0;
        flags |= (lop3<LUT_A_AND_B_OR_C>(x >> 12, 0x000F000Fu, FP16_1024X2) !=
                  (((x >> 12) & 0x000F000Fu) | 0x64006400u)) << 1;
        flags |= (prmt<0x4240>(x, 0x64646464u) != ((x & 0x00FF00FFu) | 0x64006400u)) << 2;
        flags |= (prmt<0x4341>(x, 0x64646464u) != (((x >> 8) & 0x00FF00FFu) | 0x64006400u)) << 3;
        flags |= (hi_x2(x) != ((x >> 16) | (x & 0xFFFF0000u))) << 4;
        flags |= (lo_x2(x) != ((x & 0xFFFFu) | (x << 16))) << 5;
        bad[i] = flags;
    }
}

// dequant_word over every word of w [n, 4] (one 16-byte vector each) with their (scale, zero) words p [n].
template <int BITS>
__device__ void pairs_of(const unsigned* w, const unsigned* p, unsigned* out, int n) {
    constexpr int PAIRS = 16 / BITS;  // pairs per word
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned bias = zero_bias(p[i]);
        for (int j = 0; j < 4; ++j) {
            unsigned pairs[PAIRS];
            dequant_word<BITS>(w[i * 4 + j], bias, pairs);
            for (int s = 0; s < PAIRS; ++s) out[(i * 4 + j) * PAIRS + s] = pairs[s];
        }
    }
}
extern "C" __global__ void pairs4(const unsigned* w, const unsigned* p, unsigned* out, int n) {
    pairs_of<4>(w, p, out, n);
}
extern "C" __global__ void pairs8(const unsigned* w, const unsigned* p, unsigned* out, int n) {
    pairs_of<8>(w, p, out, n);
}
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("quant_probes")
    for header in SOURCE_DIR.glob("*.cuh"):
        shutil.copy(header, directory)
    (directory / "probes.cu").write_text(PROBES)
    return directory


def probe(source_dir, name, block, args):
    emu.launch(KernelSpec("probes.cu", name), 1, block, args, source_dir=source_dir)


def u32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64).astype(np.uint32)


# -- lop3 and prmt against the ISA's definitions -----------------------------------------------------------------
def lop3_reference(a, b, c, lut):
    """Bit i of the result: bit (a_i b_i c_i) of lut, i.e. the OR over lut's minterms."""
    out = np.zeros_like(a)
    for m in range(8):
        if lut >> m & 1:
            out |= (a if m & 4 else ~a) & (b if m & 2 else ~b) & (c if m & 1 else ~c)
    return out


def test_lop3_every_lut(probes):
    rng = np.random.default_rng(0)
    truth = [0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA]  # then lop3 returns its immLut in every byte
    a, b, c = (u32([t, *rng.integers(0, 2**32, 15, dtype=np.uint64)]) for t in truth)
    out = np.zeros(256 * a.size, np.uint32)
    probe(probes, "lop3_every_lut", 256, (a, b, c, out, np.int32(a.size)))
    out = out.reshape(256, a.size)
    assert (out[:, 0] == np.arange(256, dtype=np.uint32) * 0x01010101).all()
    for lut in range(256):
        np.testing.assert_array_equal(out[lut], lop3_reference(a, b, c, lut), err_msg=f"immLut {lut:#04x}")


def prmt_reference(a, b, selector):
    out = np.zeros_like(a)
    for i in range(4):
        s = selector >> 4 * i & 0xF
        source = a if (s & 7) < 4 else b
        byte = (source >> np.uint32(8 * (s & 3))) & np.uint32(0xFF)
        if s & 8:  # the byte's sign bit, replicated
            byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def test_prmt_every_selector(probes):
    a = u32([0x84038201, 0x01020304, 0xFF7F8000])  # distinct bytes, sign bits set and clear
    b = u32([0x08870685, 0x05060708, 0x00807FFF])
    out = np.zeros(65536 * a.size, np.uint32)
    probe(probes, "prmt_every_selector", 256, (a, b, out, np.int32(a.size)))
    out = out.reshape(65536, a.size)
    for selector in range(65536):
        expected = prmt_reference(a, b, selector)
        if not np.array_equal(out[selector], expected):
            pytest.fail(f"prmt selector {selector:#06x}: {out[selector]} != {expected}")


# -- f16x2 arithmetic: every half against 64 others, as numpy's correctly rounded float64 -> float16 ----------------
SPECIALS = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
            0x6400, 0x6410, 0x6500, 0x3555, 0x1400]  # zeros, subnormals, 1, max, inf, NaN, 1024, 1040, 1280


def test_f16x2_add_sub_mul_round_once_to_nearest_even(probes):
    rng = np.random.default_rng(1)
    halves = np.arange(65536, dtype=np.uint32)
    a = halves[0::2] | halves[1::2] << np.uint32(16)  # every half once, in one half or the other
    others = np.concatenate([SPECIALS, rng.integers(0, 65536, 64 - len(SPECIALS))]).astype(np.uint32)
    b = others | np.roll(others, 1) << np.uint32(16)
    out = np.zeros((3, a.size, b.size), np.uint32)
    probe(probes, "f16x2_ops", 256, (a, b, out, np.int32(a.size), np.int32(b.size)))
    for half in (0, 1):
        x = ((a >> np.uint32(16 * half)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
        y = ((b >> np.uint32(16 * half)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
        with np.errstate(all="ignore"):
            for op, value in enumerate((x[:, None] + y[None], x[:, None] - y[None], x[:, None] * y[None])):
                expected = value.astype(np.float16).view(np.uint16)  # exact in float64, rounded once
                expected = np.where(np.isnan(value), np.uint16(0x7FFF), expected)  # the canonical NaN
                got = ((out[op] >> np.uint32(16 * half)) & np.uint32(0xFFFF)).astype(np.uint16)
                wrong = np.argwhere(got != expected)
                assert not wrong.size, (f"{('add', 'sub', 'mul')[op]}.rn.f16x2 half {half}: {len(wrong)} wrong, e.g. "
                                        f"{x[wrong[0][0]]} and {y[wrong[0][1]]} gave {got[tuple(wrong[0])]:#06x}, "
                                        f"not {expected[tuple(wrong[0])]:#06x}")


# -- what dequant.cuh builds from them ------------------------------------------------------------------------
def test_the_immediates_dequant_uses_are_plain_bit_arithmetic(probes):
    rng = np.random.default_rng(2)
    w = u32([0, 0xFFFFFFFF, 0x12345678, 0x87654321, *rng.integers(0, 2**32, 4092, dtype=np.uint64)])
    bad = np.full(w.size, 0xFF, np.uint32)
    probe(probes, "used_forms", 128, (w, bad, np.int32(w.size)))
    assert not bad.any(), [f"{int(f):06b}" for f in bad[bad != 0][:5]]


@pytest.mark.parametrize("bits", quant.BITS)
def test_dequant_word_is_q_minus_zero_in_the_device_format(probes, bits):
    """Every code in every slot, against every zero 0 .. 2**bits: the pairs hold codes 2s, 2s + 1 of each word
    (quant.py's order) minus the zero, exactly, in FP16."""
    top, per_word = 1 << bits, 32 // bits
    n = top + 1  # one 16-byte vector (4 words) per zero
    codes = np.stack([np.roll(np.arange(4 * per_word) % top, z) for z in range(n)])  # [n, codes per vector]
    qweight = quant.pack(codes, bits)  # [n, 4]
    params = quant.params(np.full((n, 1), 0.5, np.float32), np.arange(n)[:, None]).view(np.uint32)[:, 0]  # [n]
    out = np.zeros(n * 4 * per_word // 2, np.uint32)
    probe(probes, f"pairs{bits}", 128, (qweight, params, out, np.int32(n)))
    halves = out.view(np.float16).reshape(n, 4 * per_word).astype(np.float64)  # low half first: code order
    np.testing.assert_array_equal(halves, codes - np.arange(n)[:, None])
