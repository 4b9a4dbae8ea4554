"""gemm.cu: the twin against float64 matmul and the split-K rule and buffers (CPU), the tensor-core kernel
against the twin and split-K against S = 1 (GPU)."""

import numpy as np
import pytest

from cullama.runtime.ops import gemm as twin
from cullama.runtime import plan as plans, prefill_kernels
from cullama.model.config import preset
from cullama.model.layout import device_config
from cullama.runtime.prefill_kernels import GEMMS, MAX_SPLIT, MMA_GEMM, WGMMA_GEMM, PrefillKernels, cdiv
from cullama.runtime.registry import compile_module
from tests.conftest import poisoned


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
    workspace, tile_count = np.full(8, np.nan, np.float32), np.zeros(2, np.uint32)
    twin.gemm(A, W, C, workspace, tile_count, M, N, K, 0)
    assert C.dtype == np.float32
    assert rel_err(C[:M], expected(A, W, M, N)) < 1e-5
    assert np.isnan(C[M:]).all()  # rows past M untouched
    C0 = rand(rng, M + 3, N, dtype=np.float32)
    C = C0.copy()
    twin.gemm(A, W, C, workspace, tile_count, M, N, K, 1)
    assert rel_err(C[:M], expected(A, W, M, N, C0)) < 1e-5
    np.testing.assert_array_equal(C[M:], C0[M:])
    assert np.isnan(workspace).all() and not tile_count.any()  # the split-K scratch: untouched


# -- the split-K rule and its buffers (CPU) -------------------------------------------------------
@pytest.mark.parametrize("m,n,k,splits", [
    (1, 4096, 4096, 4), (10, 4096, 11008, 4), (64, 4096, 4096, 4),  # o_proj / down: 32 tiles
    (65, 4096, 4096, 2), (128, 4096, 11008, 2),  # 64 tiles: 132 // 64 = 2
    (129, 4096, 4096, 1), (256, 4096, 11008, 1),  # 96, 128 tiles >= 66: the GPU is full
    (1, 12288, 4096, 1), (1, 22016, 4096, 1), (1, 32000, 4096, 1),  # 96, 172, 250 tiles
    (1, 8320, 4096, 2), (1, 8321, 4096, 1),  # 65 tiles (132 // 65 = 2); 66 tiles
    (1, 136, 40, 1), (1, 136, 511, 1), (1, 136, 512, 2), (1, 136, 11008, 4),  # k // 256 caps S
])
def test_gemm_splits_rule(m, n, k, splits):
    assert MMA_GEMM.splits(m, n, k) == splits


@pytest.mark.parametrize("m,n,k,splits", [
    (256, 4096, 4096, 3), (256, 4096, 11008, 3), (128, 4096, 4096, 4),  # o_proj / down: 44, 22 tiles
    (256, 12288, 4096, 1), (128, 12288, 4096, 2), (256, 22016, 4096, 1),  # 128, 64, 230 tiles
    (10, 32000, 4096, 1), (1, 136, 2047, 1), (1, 136, 2048, 2),  # 167 tiles; k // 1024 caps S
])
def test_wgmma_splits_rule(m, n, k, splits):
    """One 128 x 192 block per SM: split below 99 tiles, with at least 1024 of K a split."""
    assert WGMMA_GEMM.splits(m, n, k) == splits


def test_gemm_split_k_toggle_forces_one_split(monkeypatch):
    monkeypatch.setattr(prefill_kernels, "SPLIT_K", False)
    assert MMA_GEMM.splits(1, 4096, 4096) == 1 and WGMMA_GEMM.splits(1, 4096, 4096) == 1
    cfg = device_config(preset("llama-2-7b"))
    assert all(l.grid[2] == 1 for l in plans.prefill_plan(cfg, 512, 0, 10).launches if l.spec == MMA_GEMM.spec)


@pytest.mark.parametrize("gemm", sorted(GEMMS))
@pytest.mark.parametrize("name", ["llama-2-7b", "tiny"])
def test_split_k_buffers_hold_every_prefill_gemm(name, gemm):
    """Every GEMM a prefill plan makes with either kernel, at every chunk length, fits gemm_workspace and
    gemm_tile_count (sized once for both, so the choice can change at run time)."""
    cfg = device_config(preset(name))
    kernel = GEMMS[gemm]
    bufs = {b.name: b for b in plans.runtime_buffers(cfg, 512)}
    workspace, count = bufs["gemm_workspace"], bufs["gemm_tile_count"]
    assert workspace.dtype == "float32" and count.dtype == "uint32" and len(workspace.shape) == 1
    split_seen = False
    for n in range(1, plans.PREFILL_CHUNK + 1):
        for launch in plans.prefill_plan(cfg, 512, 0, n, "logits", PrefillKernels(gemm=gemm)).launches:
            if launch.spec.source not in ("gemm.cu", "gemm_wgmma.cu"):
                continue
            assert launch.spec == kernel.spec and launch.block == kernel.threads and launch.smem == kernel.smem
            (x, y, splits), (M, N, K) = launch.grid, (int(a) for a in launch.args[5:8])
            assert (x, y) == (cdiv(N, kernel.tile_n), cdiv(M, kernel.tile_m)) and 1 <= splits <= MAX_SPLIT
            assert splits == kernel.splits(M, N, K)
            assert launch.args[3:5] == (plans.Ref("gemm_workspace"), plans.Ref("gemm_tile_count"))
            if splits > 1:
                split_seen = True
                assert x * y <= count.shape[0] and splits * x * y * kernel.tile_m * kernel.tile_n <= workspace.shape[0]
                assert cdiv(cdiv(K, splits), kernel.tile_k) * kernel.tile_k * (splits - 1) < K  # none empty
    assert split_seen or (name, gemm) == ("tiny", "wgmma")  # tiny's K (<= 688) is too short to split 1024 a split
    if name == "llama-2-7b":  # wgmma's: 4 splits x 64 tiles (n = 12288 at 128 rows) x 128 x 192 floats = 24 MiB
        assert workspace.shape == (4 * 64 * 128 * 192,) and count.shape == (64,)


def test_compiles_for_sm90_without_spills():
    res = compile_module(MMA_GEMM.spec.source, MMA_GEMM.spec.defines, "sm_90").resources["gemm"]
    assert not res.spills, res
    assert res.registers <= 80, res  # three blocks of 256 threads fit on an SM (__launch_bounds__(256, 3))
    assert res.smem_bytes <= 48 * 1024, res  # static shared memory only


# -- GPU: the kernel against its twin, fresh random data, odd and tile-edge sizes -------------------
def run_gpu(kernels, cp, A, W, C, M, N, K, accumulate, splits=1, workspace=None, tile_count=None):
    """Launch gemm as the plan does (grid (ceil(N/128), ceil(M/64), splits), 256 threads) on device arrays.

    S = 1 gets a one-element NaN workspace and a one-element counter (it must touch neither); S > 1
    gets a NaN-poisoned workspace of exactly splits * tiles partial tiles and zeroed counters, unless given."""
    grid = (cdiv(N, MMA_GEMM.tile_n), cdiv(M, MMA_GEMM.tile_m), splits)
    tiles = grid[0] * grid[1]
    if workspace is None:
        workspace = poisoned(cp, (splits * tiles * MMA_GEMM.tile_m * MMA_GEMM.tile_n if splits > 1 else 1,),
                             np.float32)
    if tile_count is None:
        tile_count = cp.zeros(tiles if splits > 1 else 1, dtype=cp.uint32)
    kernels.function(MMA_GEMM.spec)(grid, (MMA_GEMM.threads,), (A, W, C, workspace, tile_count, np.int32(M),
                                                                np.int32(N), np.int32(K), np.int32(accumulate)))
    cp.cuda.runtime.deviceSynchronize()
    return workspace, tile_count


SIZES = [(1, 8, 8), (1, 4096, 4096), (17, 136, 40), (63, 127, 24), (64, 128, 32), (65, 129, 40), (128, 256, 64),
         (200, 1000, 264), (3, 32000, 64), (256, 300, 11008), (37, 12288, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SIZES)
def test_gpu_gemm_matches_twin(kernels, M, N, K):
    import cupy as cp

    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.05)
    ref = np.empty((M, N), np.float32)
    twin.gemm(A, W, ref, None, None, M, N, K, 0)
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
    twin.gemm(A, W, ref, None, None, M, N, K, 1)
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
    buf = poisoned(cp, ((M + 64) * N,), np.float32)  # C: its first M rows (row stride N), as a
    # [M + 64, N] view: the kernel gets the same pointer, the twin (CULLAMA_FAKE_GPU=1) the rows it indexes
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), buf.reshape(M + 64, N), M, N, K, 0)
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
    twin.gemm(A, W, ref, None, None, M, N, K, 1)
    dC = cp.asarray(C0)
    run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), dC, M, N, K, 1)
    assert rel_err(dC.get() - C0, ref - C0) <= 1e-3


# -- GPU: split-K against S = 1 --------------------------------------------------------------------
SPLIT_SIZES = [(1, 4096, 4096), (10, 4096, 11008), (64, 4096, 4096), (10, 136, 40), (1, 136, 11008),
               (64, 136, 4096), (1, 32000, 40), (10, 32000, 264), (64, 4096, 11008)]


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("M,N,K", SPLIT_SIZES)
def test_gpu_split_k_matches_one_split(kernels, M, N, K, accumulate):
    """S = 2 and 4 equal S = 1 to float32 rounding, bitwise alike on a rerun, with every counter back at 0.

    C starts poisoned (NaN, accumulate = 0) or random (accumulate = 1); the workspace starts NaN, so
    a partial read before (or without) being written shows. K = 40 with S = 4 has empty K ranges."""
    import cupy as cp

    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.05)
    C0 = rand(rng, M, N, dtype=np.float32) if accumulate else np.full((M, N), np.nan, np.float32)
    dA, dW = cp.asarray(A), cp.asarray(W)
    tiles = MMA_GEMM.tiles(M, N)
    workspace = cp.empty(4 * tiles * MMA_GEMM.tile_m * MMA_GEMM.tile_n, dtype=cp.float32)
    count = cp.zeros(tiles, dtype=cp.uint32)  # zeroed once: every launch must leave it so for the next

    def launch(splits):
        dC = cp.asarray(C0)
        workspace.fill(np.nan)
        run_gpu(kernels, cp, dA, dW, dC, M, N, K, accumulate, splits, workspace, count)
        assert not count.get().any(), f"S={splits}: tile_count not reset"
        assert splits > 1 or np.isnan(workspace.get()).all(), "S=1 wrote the workspace"
        return dC.get()

    one = launch(1)
    ref = C0.copy() if accumulate else np.empty((M, N), np.float32)
    twin.gemm(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, accumulate)
    assert np.isfinite(one).all() and rel_err(one, ref) <= 1e-3
    # float32 rounding: the split only reorders the sum (a few ulps of the sum of |products|, and of C0)
    bound = np.abs(A).astype(np.float32) @ np.abs(W).astype(np.float32).T + (np.abs(C0) if accumulate else 0)
    for splits in (2, 4):
        out = launch(splits)
        assert np.isfinite(out).all(), f"S={splits}: unwritten elements"
        excess = np.abs(out.astype(np.float64) - one) - 1e-5 * bound
        assert excess.max() <= 0, f"S={splits}: differs from S=1 beyond float32 rounding at {np.argmax(excess)}"
        np.testing.assert_array_equal(launch(splits), out, err_msg=f"S={splits}: not deterministic")


@pytest.mark.gpu
def test_gpu_split_k_does_not_write_outside_c(kernels):
    """S = 3 (odd K ranges) into a view of a larger poisoned buffer: the guard rows after C stay NaN."""
    import cupy as cp

    M, N, K = 50, 200, 808
    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K)
    buf = poisoned(cp, ((M + 64) * N,), np.float32)  # C: its first M rows (row stride N), as a
    # [M + 64, N] view: the kernel gets the same pointer, the twin (CULLAMA_FAKE_GPU=1) the rows it indexes
    _, count = run_gpu(kernels, cp, cp.asarray(A), cp.asarray(W), buf.reshape(M + 64, N), M, N, K, 0, splits=3)
    out = buf.get()
    assert np.isfinite(out[:M * N]).all() and np.isnan(out[M * N:]).all()
    ref = np.empty((M, N), np.float32)
    twin.gemm(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, 0)
    assert rel_err(out[:M * N].reshape(M, N), ref) <= 1e-3
    assert not count.get().any()


def test_gemm_sweep_script_runs_its_cpu_part():
    """benchmarks/gemm_sweep.py imports and parses its options; without a GPU it fails in one line."""
    import subprocess
    import sys
    from pathlib import Path

    from cullama.runtime.device import cuda_status

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "gemm_sweep.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--splits" in done.stdout, done.stderr
    if not cuda_status()[0]:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and done.stdout == ""
        assert done.stderr.strip().startswith("gemm_sweep: needs an NVIDIA GPU") and "\n" not in done.stderr.strip()
