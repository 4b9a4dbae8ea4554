"""gemm.cu: the twin against float64 matmul (CPU), the tensor-core kernel against the twin (GPU)."""

import numpy as np
import pytest

from cullama.ops import gemm as twin
from cullama.plan import GEMM, GEMM_THREADS, GEMM_TILE_M, GEMM_TILE_N, cdiv
from cullama.registry import compile_module
from conftest import poisoned


def rand(rng, *shape, scale=1.0, dtype=np.float16):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def rel_err(out, ref):
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


def expected(A, W, M, N, C0=None):
    """float64 truth of C[:M, :N] = A[:M] · W^T (+ C0)."""
    ref = A[:M].astype(np.float64) @ W[:N].astype(np.float64).T
    return ref if C0 is None else ref + C0[:M, :N]


@pytest.mark.parametrize("M", [1, 17, 64, 200])
@pytest.mark.parametrize("N", [8, 136, 1000])
@pytest.mark.parametrize("K", [8, 40, 264])
def test_twin_matches_float64_matmul(M, N, K):
    rng = np.random.default_rng(M * 10007 + N * 101 + K)
    A, W = rand(rng, M + 3, K), rand(rng, N, K, scale=0.1)  # A has spare rows, as the plan's chunk buffers
    C = np.full((M + 3, N), np.nan, np.float32)
    twin.gemm(A, W, C, M, N, K, 0)
    assert C.dtype == np.float32
    assert rel_err(C[:M], expected(A, W, M, N)) < 1e-5
    assert np.isnan(C[M:]).all()  # rows past M untouched
    C0 = rand(rng, M + 3, N, dtype=np.float32)
    C = C0.copy()
    twin.gemm(A, W, C, M, N, K, 1)
    assert rel_err(C[:M], expected(A, W, M, N, C0)) < 1e-5
    np.testing.assert_array_equal(C[M:], C0[M:])


def test_compiles_for_sm90_without_spills():
    res = compile_module(GEMM.source, GEMM.defines, "sm_90").resources["gemm"]
    assert not res.spills, res
    assert res.registers <= 128, res  # two blocks of 256 threads fit on an SM
    assert res.smem_bytes <= 48 * 1024, res  # static shared memory only


# -- GPU: the kernel against its twin, fresh random data, odd and tile-edge sizes -------------------
def run_gpu(kernels, cp, A, W, C, M, N, K, accumulate):
    """Launch gemm as the plan does (grid (ceil(N/128), ceil(M/64)), 256 threads) on device arrays."""
    grid = (cdiv(N, GEMM_TILE_N), cdiv(M, GEMM_TILE_M), 1)
    kernels.function(GEMM)(grid, (GEMM_THREADS,), (A, W, C, np.int32(M), np.int32(N), np.int32(K),
                                                  np.int32(accumulate)))
    cp.cuda.runtime.deviceSynchronize()


SIZES = [(1, 8, 8), (1, 4096, 4096), (17, 136, 40), (63, 127, 24), (64, 128, 32), (65, 129, 40), (128, 256, 64),
         (200, 1000, 264), (3, 32000, 64), (256, 300, 11008), (37, 12288, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SIZES)
def test_gpu_gemm_matches_twin(kernels, M, N, K):
    import cupy as cp

    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.05)
    ref = np.empty((M, N), np.float32)
    twin.gemm(A, W, ref, M, N, K, 0)
    dC = poisoned(cp, (M, N), np.float32)  # NaN: every element must be written
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), dC, M, N, K, 0)
    out = dC.get()
    assert np.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (65, 129, 40), (200, 1000, 264)])
def test_gpu_gemm_accumulates(kernels, M, N, K):
    import cupy as cp

    rng = np.random.default_rng()
    A, W, C0 = rand(rng, M, K), rand(rng, N, K, scale=0.05), rand(rng, M, N, dtype=np.float32)
    ref = C0.copy()
    twin.gemm(A, W, ref, M, N, K, 1)
    dC = cp.asarray(C0)
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), dC, M, N, K, 1)
    assert rel_err(dC.get(), ref) <= 1e-3
    assert rel_err(dC.get() - C0, ref - C0) <= 1e-3  # the product itself, not just C0


@pytest.mark.gpu
def test_gpu_gemm_does_not_write_outside_c(kernels):
    """C is a view into a larger poisoned buffer: the guard rows after it stay NaN."""
    import cupy as cp

    M, N, K = 70, 200, 48
    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K)
    buf = poisoned(cp, ((M + 64) * N,), np.float32)
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), buf, M, N, K, 0)
    out = buf.get()
    assert np.isfinite(out[:M * N]).all() and np.isnan(out[M * N:]).all()


@pytest.mark.gpu
def test_gpu_gemm_llama2_7b_down_proj(kernels):
    """LLaMA-2-7B's down_proj over a full prefill chunk: M=256, N=4096, K=11008, accumulated into x."""
    import cupy as cp

    M, N, K = 256, 4096, 11008
    rng = np.random.default_rng()
    A, W, C0 = rand(rng, M, K), rand(rng, N, K, scale=0.02), rand(rng, M, N, dtype=np.float32)
    ref = C0.copy()
    twin.gemm(A, W, ref, M, N, K, 1)
    dC = cp.asarray(C0)
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), dC, M, N, K, 1)
    assert rel_err(dC.get() - C0, ref - C0) <= 1e-3
