"""The emulated kernel checks have teeth: each seeded bug, planted in a copy of kernels_cu, makes the
test_emu_kernels check of the kernel it breaks fail (a wrong or NaN result, or an EmuError naming the hazard) in
every warp schedule, or in those a race needs (one order of the warps shows it, another hides it: why there are
several). Each mutation's original text must be in the source exactly once, so a kernel edit that moves it
fails here instead of silently testing nothing."""

from __future__ import annotations

import pytest

from tests.runtime.emu import test_emu_kernels as checks
from cullama.runtime import emu
from cullama.runtime.prefill_kernels import MMA_GEMM
from tests.emulated import seeded_copy

pytestmark = pytest.mark.emu

WGMMA_CASE = [checks.GEMM_CASES[0]]  # 13 K tiles through the 5-stage ring, one launch


def gemm(schedule, source_dir):
    checks.check_gemm(MMA_GEMM.spec, MMA_GEMM.tile_m, MMA_GEMM.tile_n, MMA_GEMM.threads, 0, schedule, source_dir,
                      cases=checks.GEMM_CASES[:2])


def wgmma(schedule, source_dir):
    checks.check_gemm_wgmma((), schedule, source_dir, cases=WGMMA_CASE)


def block_sums(schedule, source_dir):
    checks.check_prefill(schedule, source_dir)  # rmsnorm_rows
    checks.check_read_sum(schedule, source_dir)


# (id, file, original text, its replacement, the check that must fail[, the schedules that must catch it])
MUTATIONS = [
    ("block_sum-first-barrier-removed", "common.cuh",
     "    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n    v = lane < warps ? scratch[lane] : 0.f;",
     "    if (lane == 0) scratch[warp] = v;\n    v = lane < warps ? scratch[lane] : 0.f;", block_sums),
    ("warp_sum-from-a-quarter-warp", "common.cuh",
     "for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync",
     "for (int o = WARP / 4; o > 0; o >>= 1) v += __shfl_xor_sync",
     block_sums),  # block_sum's warp sums (gemv_mma.cu's partials barrier: tests/runtime/emu/test_emu_gemv_mma.py)
    # prepare.cuh (its use in gemv_residual: test_emu_gemv_mma.py): embed_rows_prepared's Σ x² parts
    ("prepared-part-misses-its-last-element", "prepare.cuh", "        if (i < n) {", "        if (i < n - 1) {",
     block_sums),
    ("gemm-cp.async-wait-off-by-one", "gemm.cu", "cp_async_wait<STAGES - 2>();", "cp_async_wait<STAGES - 1>();", gemm),
    ("gemm-ring-barrier-removed", "gemm.cu", "        cp_async_wait<STAGES - 2>();\n        __syncthreads();",
     "        cp_async_wait<STAGES - 2>();", gemm),
    ("gemm-mma-fragments-swapped", "gemm.cuh",
     "mma_16816(acc[i][j], a[i], b[j / 2][(j % 2) * 2], b[j / 2][(j % 2) * 2 + 1]);",
     "mma_16816(acc[i][j], a[i], b[j / 2][(j % 2) * 2 + 1], b[j / 2][(j % 2) * 2]);", gemm),
    ("gemm-split-k-combines-one-early", "gemm.cuh", "tile_count + tile, 1u) == (unsigned int)(splits - 1);",
     "tile_count + tile, 1u) == (unsigned int)(splits - 2);", gemm),
    # the last block sums only the partials its mask says lie inside C: one row short, row M - 1's sums are lost
    ("gemm-split-k-mask-one-row-short", "gemm.cuh", "if (inside_c(i, j, h)) inside |= 1u",
     "if (inside_c(i, j, h) && m0 + wm + i * 16 + g + h * 8 < M - 1) inside |= 1u", gemm),
    ("wgmma-swizzle-xor-wrong", "gemm_wgmma.cu", "((chunk ^ (row & 7)) << 4)", "((chunk ^ ((row >> 1) & 7)) << 4)",
     wgmma),
    ("wgmma-sbo-512", "gemm_wgmma.cu", "lbo = 16, sbo = 1024, mode = 1;", "lbo = 16, sbo = 512, mode = 1;", wgmma),
    ("wgmma-k-step-16-bytes", "gemm_wgmma.cu", "(GW_SWIZZLE == 128 ? 32 : 256)", "(GW_SWIZZLE == 128 ? 16 : 256)",
     wgmma),
    ("wgmma-proxy-fence-removed", "gemm_wgmma.cu", "        fence_proxy_async();\n", "", wgmma),
    ("wgmma-fence-removed", "gemm_wgmma.cu", "        wgmma_fence();\n", "", wgmma),
    ("wgmma-wait-one-group-late", "gemm_wgmma.cu", "wgmma_wait<1>();", "wgmma_wait<2>();", wgmma),
    ("attention-warp-states-barrier-removed", "attention.cu",
     "                red->l[warp][j] = l[j];\n            }\n        }\n    }\n    __syncthreads();",
     "                red->l[warp][j] = l[j];\n            }\n        }\n    }",
     lambda s, d: checks.check_attention_prefill((("HEAD_DIM", 32), ("GROUP", 4), ("ROWS_Q", 1)), s, d)),
    ("attention-decode-combines-one-early", "attention.cu", "count + kv, 1u) == (unsigned int)(splits - 1);",
     "count + kv, 1u) == (unsigned int)(splits - 2);",
     lambda s, d: checks.check_attention_decode((("HEAD_DIM", 32), ("GROUP", 4)), s, d)),
    ("attention-mma-v-without-trans", "attention_mma.cu", "ldmatrix_x4_trans(b, smem_addr(s.v", "ldmatrix_x4(b, smem_addr(s.v",
     lambda s, d: checks.check_attention_mma((("HEAD_DIM", 64), ("GROUP", 1), ("WARPS", 4)), s, d)),
    ("attention-mma-v-barrier-removed", "attention_mma.cu",
     "        cp_async_wait<0>();\n        __syncthreads();  // V_kt visible", "        cp_async_wait<0>();  // V_kt",
     lambda s, d: checks.check_attention_mma((("HEAD_DIM", 32), ("GROUP", 4), ("WARPS", 4)), s, d)),
    ("attention-mma-p-halves-swapped", "attention_mma.cu",
     "pf[kk][r] = pack_f16x2(sc[am_p_tile(kk, r)][am_p_elem(r, 0)],\n                                           "
     "sc[am_p_tile(kk, r)][am_p_elem(r, 1)]);",
     "pf[kk][r] = pack_f16x2(sc[am_p_tile(kk, r)][am_p_elem(r, 1)],\n                                           "
     "sc[am_p_tile(kk, r)][am_p_elem(r, 0)]);",
     lambda s, d: checks.check_attention_mma((("HEAD_DIM", 32), ("GROUP", 1), ("WARPS", 4)), s, d)),
    ("attention-prefill-window-one-key-long", "attention.cu", "min(j / GROUP, end - first_end) - window);",
     "min(j / GROUP, end - first_end) - window - 1);",
     # 4 rows a block: the rows after the first see keys the block loads for the first, masked for them
     lambda s, d: checks.check_attention_prefill((("HEAD_DIM", 32), ("GROUP", 1), ("ROWS_Q", 4)), s, d, window=4)),
    ("attention-decode-splits-the-whole-context", "attention.cu", "const int first = max(n - window, 0);",
     "const int first = 0 * max(n - window, 0);",
     lambda s, d: checks.check_attention_decode((("HEAD_DIM", 32), ("GROUP", 4)), s, d, n=50, window=13)),
    ("attention-mma-window-edge-unmasked", "attention_mma.cu", " || key < first[e / 2])", ")",
     lambda s, d: checks.check_attention_mma((("HEAD_DIM", 32), ("GROUP", 4), ("WARPS", 4)), s, d, window=20)),
    ("rope-kv-rows-bias-dropped", "prefill.cu", "__fadd_rn(row[at], h2f(bias[at]))", "row[at]",
     lambda s, d: checks.check_prefill(s, d)),
    # the ids past the 32 a thread holds on chip never re-read: seen only past V = 32768 (LLaMA-3's, Qwen2's)
    ("sample-ids-past-the-chip-dropped", "sampling.cu", "for (int j = ITEMS; j < n; ++j) {",
     "for (int j = ITEMS; j < 0; ++j) {",
     lambda s, d: checks.check_sample(checks.SAMPLE_OPTIONS[5], 152065, s, d, draws=1)),
    ("sample-block-reduce-barrier-removed", "sampling.cu",
     "    if (threadIdx.x % WARP == 0) buf[threadIdx.x / WARP] = v;\n    __syncthreads();",
     "    if (threadIdx.x % WARP == 0) buf[threadIdx.x / WARP] = v;",
     lambda s, d: checks.check_sample(checks.SAMPLE_OPTIONS[0], 1000, s, d, draws=1)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    _, file, original, replacement, check, *must_catch = mutation
    source_dir = seeded_copy(tmp_path, file, original, replacement)
    missed = []
    for schedule in must_catch[0] if must_catch else emu.SCHEDULES:
        try:
            check(schedule, source_dir)
        except (AssertionError, emu.EmuError):
            continue
        missed.append(schedule)
    assert not missed, f"the bug went unnoticed in the {', '.join(missed)} schedule(s)"
