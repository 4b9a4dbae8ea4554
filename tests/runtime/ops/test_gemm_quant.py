"""gemm_quant.cu: the twin against float64 math on quant.py's FP16-rounded weights (CPU); the kernel against the
twin with and without split-K (check_gemm_quant: on the CPU executor in tests/runtime/emu/test_emu_quant.py, on a GPU
here with the LLaMA-2-7B shapes). Prefill logits equal to decode logits within the FP16 tolerance is the model's
business (the plan's tests); its per-matrix part is here: gemm_quant's rows against gemv_mma's on the same weights
(check_prefill_rows_equal_decode_rows: twins, executor, GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.runtime import ops
from cullama.model import quant
from cullama.runtime.ops import gemm_quant as twin
from cullama.runtime.prefill_kernels import MMA_GEMM
from cullama.runtime.registry import KernelSpec
from cullama.runtime.ops import gemv_mma as gemv_mma_ops
from tests.runtime.ops.test_gemv_mma import exact, quantized, rand
from tests.runtime.test_verify import gpu_launcher, nan

# (M, N, K, splits, accumulate, group) per BITS: M and N not multiples of the tile, K tiles of several groups and
# groups of several K tiles, an empty split (K = 96 over 4 splits of 32), a group of all of K; at 8 bits K = 816
# ends in half a K tile (its second 16-byte chunk zero-filled) and groups of 16 put two groups in one tile row.
CASES = {4: [(70, 200, 800, 1, 0, 32), (70, 200, 800, 3, 1, 160), (5, 136, 96, 4, 0, 96), (1, 8, 32, 1, 1, 32),
             (130, 65, 128, 2, 0, 128)],
         8: [(70, 200, 816, 1, 0, 16), (70, 200, 816, 3, 1, 48), (5, 136, 80, 4, 0, 80), (1, 8, 16, 1, 1, 16),
             (130, 65, 128, 2, 0, 128)]}


def check_gemm_quant(launch, bits, cases=None, seed=5):
    """Each case against the twin: within float32 rounding of the sum of |products| (1e-5 of it), split-K or not;
    exact: rows of C past M untouched, the tile counters back at 0, the workspace untouched when S = 1."""
    rng = np.random.default_rng(seed)
    spec = KernelSpec(twin.SOURCE, "gemm_quant", twin.defines(bits))
    for M, N, K, splits, accumulate, group in cases or CASES[bits]:
        A = rand(rng, M, K, dtype=np.float16)
        qw, qp = quantized(rng, N, K, bits, group)
        C0 = rand(rng, M + 2, N) if accumulate else nan(M + 2, N)  # two guard rows past M
        C0[M:] = np.nan
        ref = C0.copy()
        twin.gemm_quant(A, qw, qp, ref, None, None, M, N, K, accumulate, group)
        grid = (-(-N // MMA_GEMM.tile_n), -(-M // MMA_GEMM.tile_m), splits)
        workspace = nan(max(1, splits * grid[0] * grid[1] * MMA_GEMM.tile_m * MMA_GEMM.tile_n))
        count = np.zeros(grid[0] * grid[1], np.uint32)
        C = C0.copy()
        launch(spec, grid, MMA_GEMM.threads, (A, qw, qp, C, workspace, count, np.int32(M), np.int32(N), np.int32(K),
                                              np.int32(accumulate), np.int32(group)))
        where = f"gemm_quant BITS={bits} M={M} N={N} K={K} S={splits} group={group}"
        w16 = quant.dequantize(qw, qp, bits, np.float16).astype(np.float32)
        bound = np.abs(A).astype(np.float32) @ np.abs(w16).T + np.nan_to_num(np.abs(C0[:M]))
        assert np.isfinite(C[:M]).all(), f"{where}: unwritten or NaN elements"
        excess = np.abs(C[:M].astype(np.float64) - ref[:M]) - 1e-5 * bound
        assert excess.max() <= 0, f"{where}: off by {excess.max()} beyond float32 rounding"
        exact(C[M:], C0[M:], f"{where}: rows past M")
        exact(count, np.zeros_like(count), f"{where}: tile counters")
        if splits == 1:
            assert np.isnan(workspace).all(), f"{where}: S = 1 wrote the workspace"


def check_prefill_rows_equal_decode_rows(launch, bits, M=5, N=37, K=4096 + 2 * 32, group=32, seed=3):
    """gemm_quant's rows (a prefill chunk: FP16 input rows, FP16-rounded weights) against gemv_mma's gemv_residual
    on each row (a decode step: the same input rows, the same FP16-rounded weights, MMAs in another order) on the same
    quantized W: within FP16's tolerance, 2^-11 of the sum of |products| plus float32 summation."""
    rng = np.random.default_rng(seed)
    A = rand(rng, M, K, dtype=np.float16)
    qw, qp = quantized(rng, N, K, bits, group)
    C = nan(M, N)
    grid = (-(-N // MMA_GEMM.tile_n), -(-M // MMA_GEMM.tile_m), 1)
    launch(KernelSpec(twin.SOURCE, "gemm_quant", twin.defines(bits)), grid, MMA_GEMM.threads,
           (A, qw, qp, C, nan(1), np.zeros(1, np.uint32), np.int32(M), np.int32(N), np.int32(K), np.int32(0),
            np.int32(group)))
    decode = np.zeros((M, N), np.float32)
    spec = KernelSpec(gemv_mma_ops.SOURCE, "gemv_residual", gemv_mma_ops.defines(bits, 1, group))
    for m in range(M):  # a decode step per row: x [N] (1-D: one token row) += W · A[m]
        launch(spec, (-(-N // gemv_mma_ops.rows_per_block()),), gemv_mma_ops.THREADS,
               (A[m].copy(), qw, qp, decode[m], np.ones(N, np.float16), np.zeros(N, np.float16),
                np.zeros(-(-N // gemv_mma_ops.SS_SPAN), np.float32), np.int32(N), np.int32(K), np.int32(group)))
    bound = np.abs(A).astype(np.float64) @ np.abs(quant.dequantize(qw, qp, bits)).astype(np.float64).T
    diff = np.abs(C.astype(np.float64) - decode)
    assert np.isfinite(C).all() and (diff <= (2.0 ** -11 + 1e-5) * bound).all(), float((diff / bound).max())


# -- CPU: the twin ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", quant.BITS)
def test_twin_is_the_product_with_fp16_rounded_weights(bits):
    rng = np.random.default_rng(bits)
    M, N, K, group = 6, 20, 64, 32
    A = rand(rng, M, K, dtype=np.float16)
    qw, qp = quantized(rng, N, K, bits, group)
    codes = quant.unpack(qw, bits).astype(np.float64)
    scale, zero = (np.repeat(qp[..., i].astype(np.float64), group, axis=1) for i in (0, 1))
    w = ((codes - zero) * scale).astype(np.float16).astype(np.float64)  # exact product, rounded once to FP16
    C = np.full((M, N), np.nan, np.float32)
    twin.gemm_quant(A, qw, qp, C, None, None, M, N, K, 0, group)
    np.testing.assert_allclose(C, A.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    C2 = C.copy()
    twin.gemm_quant(A, qw, qp, C2, None, None, M, N, K, 1, group)
    np.testing.assert_allclose(C2, 2 * C, rtol=1e-6)


def twin_launch(spec, grid, block, args):
    """A launch on the twins (these take no grid)."""
    ops.twin(spec.source, spec.name)(*args)


@pytest.mark.parametrize("bits", quant.BITS)
def test_twin_prefill_rows_equal_decode_rows_within_fp16_tolerance(bits):
    check_prefill_rows_equal_decode_rows(twin_launch, bits)


def test_variants_are_one_per_bits():
    assert [twin.defines(b) for b in quant.BITS] == twin.VARIANTS


# -- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("bits", quant.BITS)
def test_gpu_kernel_matches_its_twin(kernels, bits):
    check_gemm_quant(gpu_launcher(kernels), bits, seed=int(np.random.default_rng().integers(1 << 20)))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", quant.BITS)
def test_gpu_prefill_rows_equal_decode_rows_within_fp16_tolerance(kernels, bits):
    check_prefill_rows_equal_decode_rows(gpu_launcher(kernels), bits)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("M,N,K,accumulate", [(10, 12288, 4096, 0), (10, 4096, 4096, 1), (10, 22016, 4096, 0),
                                                (10, 4096, 11008, 1), (256, 4096, 4096, 1)])
def test_gpu_llama2_7b_shapes(kernels, bits, M, N, K, accumulate):
    """The 7B prefill GEMMs with on-load quantization's groups and the plan's split rule (a short prompt: split-K on
    o_proj and down), and o_proj over a full 256-row chunk, against the twin (relative to the product's norm: float32
    sums of 4096 to 11008 terms in another order)."""
    import cupy as cp

    rng = np.random.default_rng()
    group = 128 if bits == 4 else K
    A = rand(rng, M, K, dtype=np.float16)
    qw, qp = quantized(rng, N, K, bits, group, size=0.02)
    C0 = rand(rng, M, N)
    splits = MMA_GEMM.splits(M, N, K)
    tiles = MMA_GEMM.tiles(M, N)
    dC = cp.asarray(C0)
    workspace = cp.zeros(splits * tiles * MMA_GEMM.tile_m * MMA_GEMM.tile_n, cp.float32)
    count = cp.zeros(tiles, cp.uint32)
    kernels.function(KernelSpec(twin.SOURCE, "gemm_quant", twin.defines(bits)))(
        MMA_GEMM.grid(M, N, K), (MMA_GEMM.threads,),
        (cp.asarray(A), cp.asarray(qw), cp.asarray(qp), dC, workspace, count, np.int32(M), np.int32(N), np.int32(K),
         np.int32(accumulate), np.int32(group)))
    ref = C0.copy()
    twin.gemm_quant(A, qw, qp, ref, None, None, M, N, K, accumulate, group)
    got = dC.get()
    assert np.linalg.norm(got - ref) <= 1e-4 * np.linalg.norm(ref - (C0 if accumulate else 0))
    assert not count.get().any()
