"""The quantized kernels as written (gemm_quant.cu, gather.cu; gemv_mma.cu's BITS 4 / 8 run in
tests/runtime/emu/test_emu_gemv_mma.py), run on the CPU by cullama.runtime.emu: every variant against its twin in every
warp schedule, outputs NaN-poisoned, prefill rows against decode rows on the same quantized weights, and seeded bugs in
the shared dequantization (dequant.cuh: a wrong nibble order, a zero off by one, ...) and in gemv_mma.cu's quantized
path (the group in codes, the scale per row, the token rows sharing one x) that the gemv_mma and gemm_quant checks must
catch."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.ops import test_gemm_quant as gemm_checks
from tests.runtime.ops import test_gemv_mma as gemv_checks
from cullama.runtime import emu
from cullama.runtime.ops import gather as gather_twin
from cullama.runtime.registry import KernelSpec
from tests.emulated import SEED, check_seeded_bug, emu_launcher

pytestmark = pytest.mark.emu


def ids(variants):
    return ["-".join(f"{k}{v}" for k, v in d) for d in variants]


# -- gemm_quant.cu: the executor's mma sums in double, the twin in float32 ------------------------------------------
@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("bits", [4, 8])
def test_gemm_quant(bits, schedule):
    gemm_checks.check_gemm_quant(emu_launcher(schedule), bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_gemm_quant_rows_equal_gemv_mma_rows_within_fp16_tolerance(bits):
    gemm_checks.check_prefill_rows_equal_decode_rows(emu_launcher("shuffled"), bits)


# -- gather.cu: a copy (exact) -------------------------------------------------------------------------------------
def check_gather(schedule, source_dir=None):
    rng = np.random.default_rng(4)
    for name, dtype, K, T in (("gather_f16", np.float16, 4104, 3), ("gather_f16", np.float16, 136, 5)):
        perm = rng.permutation(K).astype(np.int32)
        inp = rng.standard_normal((T + 1, K)).astype(dtype)
        out, ref = np.full((T + 1, K), np.nan, dtype), np.full((T + 1, K), np.nan, dtype)
        getattr(gather_twin, name)(inp, perm, ref, K, grid=(T, 1, 1))
        emu.launch(KernelSpec(gather_twin.SOURCE, name), T, gather_twin.THREADS, (inp, perm, out, np.int32(K)),
                   schedule=schedule, seed=SEED, source_dir=source_dir)
        gemv_checks.exact(out, ref, name)  # the row past T too: never written
        np.testing.assert_array_equal(out[:T], inp[:T, perm])


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
def test_gather(schedule):
    check_gather(schedule)


# -- seeded bugs the checks must catch -----------------------------------------------------------------------------
def gemv(bits, cases, tokens=1):
    """gemv_mma.cu's kernels of `bits` against their twins bit for bit on (K, group) `cases`."""
    return lambda launch: gemv_checks.check_against_twin(launch, bits, tokens, cases)


GEMM_CASE = {4: [gemm_checks.CASES[4][1]], 8: [gemm_checks.CASES[8][1]]}  # split 3 ways, accumulating, 25+ K tiles


def gemm(launch, bits):
    gemm_checks.check_gemm_quant(launch, bits, GEMM_CASE[bits])


# (id, file, original text, its replacement, the check that must fail)
MUTATIONS = [
    # code_pair4 (gemv_mma.cu's INT4 path): pair s read as pair s ^ 1, i.e. pairs 0 <-> 1, 2 <-> 3
    ("int4-nibble-order-plain", "dequant.cuh", "return s % 2 == 0 ? hsub2(", "return s % 2 == 1 ? hsub2(",
     gemv(4, [(96, 32)])),
    ("int8-byte-order-plain", "dequant.cuh", "s == 0 ? prmt<0x4240>(w, 0x64646464u) : prmt<0x4341>(w, 0x64646464u)",
     "s == 0 ? prmt<0x4140>(w, 0x64646464u) : prmt<0x4342>(w, 0x64646464u)", gemv(8, [(80, 16)])),
    ("zero-off-by-one", "dequant.cuh", "hadd2(hi_x2(params), FP16_1024X2)", "hadd2(hi_x2(params), 0x64016401u)",
     gemv(4, [(96, 32)])),
    # the chunk's (scale, zero) word with its halves exchanged (prmt 0x1032) before both are taken (INT8 path)
    ("scale-and-zero-swapped", "gemv_mma.cu",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;",
     "b.p[u][j] = KBLOCK_SCALE || inside ? prmt<0x1032>(b.P[b.params[j] + group], 0) : 0u;",
     gemv(8, [(80, 16)])),
    ("kblock-scale-and-zero-swapped", "gemv_mma.cu",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;",
     "b.p[u][j] = KBLOCK_SCALE || inside ? prmt<0x1032>(b.P[b.params[j] + group], 0) : 0u;",
     gemv(8, [(448, 64)])),
    # gemv_mma.cu on quantized weights (its other seeded bugs: tests/runtime/emu/test_emu_gemv_mma.py)
    ("group-in-codes-not-chunks", "gemv_mma.cu", "b.group_vecs = QUANT ? group / ELEMS : 1;",
     "b.group_vecs = QUANT ? group / 8 : 1;", gemv(8, [(240, 48)])),
    ("scale-per-row-not-per-group", "gemv_mma.cu",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j]] : 0u;", gemv(4, [(192, 64)])),
    ("kblock-scale-per-row-not-per-group", "gemv_mma.cu",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j]] : 0u;", gemv(4, [(1408, 128)])),
    # x_fragments (gemv_logits_x, FP16 only): token row g (every row at TOKENS <= 8, as in the check's 3) reads token
    # row 0's x
    ("token-rows-share-one-x", "gemv_mma.cu", "x_pair(x + (size_t)g * K + k, gn,", "x_pair(x + k, gn,",
     lambda launch: gemv_checks.check_row_independence(launch, 16, 3, form="x")),
    ("gemm-int4-codes-of-the-other-half-row", "gemm_quant.cu", "&s.codes[stage][row][half * THREAD_WORDS]",
     "&s.codes[stage][row][(1 - half) * THREAD_WORDS]", lambda launch: gemm(launch, 4)),
    ("gemm-params-one-tile-late", "gemm_quant.cu", "params = tile_params(prow, kt + 1, k0, k1, magic);",
     "params = tile_params(prow, kt, k0, k1, magic);", lambda launch: gemm(launch, 8)),
    ("gemm-w-tile-barrier-removed", "gemm_quant.cu", "        __syncthreads();  // the W tile is complete\n", "",
     lambda launch: gemm(launch, 4)),
    ("gemm-scale-not-applied", "gemm_quant.cu", "out[j * (16 / BITS) + p] = hmul2(pairs[p], scale);",
     "out[j * (16 / BITS) + p] = pairs[p];", lambda launch: gemm(launch, 8)),
    ("gather-rows-at-row-zero", "gather.cu", "const size_t row = (size_t)blockIdx.x * K;", "const size_t row = 0;",
     lambda launch: check_gather("forward", launch.source_dir)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    check_seeded_bug(tmp_path, mutation)
