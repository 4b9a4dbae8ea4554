"""The CPU executor (cullama.runtime.emu) against the GPU on the same inputs, for the kernels whose inline PTX the
executor models from the ISA's text rather than from a run: mma.sync + ldmatrix (gemm.cu, attention_mma.cu), wgmma with
its shared-memory descriptors and swizzle (gemm_wgmma.cu), the quantized kernels' lop3, prmt and FP16x2
arithmetic feeding mma.sync (gemv_mma.cu, the decode GEMVs; gemm_quant.cu), and the canonical NaN of its FP16
conversions, bit for bit. A layout the executor gets wrong would
pass its own
tests against the twins only if the kernel had the same misreading; this compares it with the hardware once.

Agreement means the same numbers up to the one thing the executor does not model, the tensor cores' rounding (it
sums products in double): within 1e-5 of the sum of |products| for the GEMMs, one FP16 rounding (plus P rounded
to FP16 alike on both) for attention. CULLAMA_EMU_VS_GPU_JSON=FILE records every case's largest difference
(benchmarks/device_check.sh keeps it). On the fake GPU (CULLAMA_FAKE_GPU=1) the "GPU" is the twin: the test's own
code still runs in CI."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.runtime.ops import test_attention_mma as mma_cases
from tests.runtime.ops import test_gemm_quant as gemm_quant_cases
from tests.runtime.ops import test_gemv_mma as gemv_mma_cases
from tests.conftest import FAKE_GPU_MODE
from cullama.runtime import emu
from cullama.model import quant
from cullama.runtime.backends import func_attr
from cullama.runtime.ops import attention_mma as attention_mma_ops
from cullama.runtime.ops import gemm_quant as gemm_quant_ops
from cullama.runtime.ops import gemm_wgmma as wgmma_ops
from cullama.runtime.ops import gemv_mma as gemv_mma_ops
from cullama.runtime.prefill_kernels import MMA_GEMM
from cullama.runtime.registry import KernelSpec

pytestmark = [pytest.mark.gpu, pytest.mark.emu]  # emu: skipped where there is no host C++ compiler
RECORD: list[dict] = []  # one row per case, written at the end of the module when asked


@pytest.fixture(scope="module", autouse=True)
def record():
    yield
    path = os.environ.get("CULLAMA_EMU_VS_GPU_JSON")
    if path and RECORD:
        with open(path, "w") as f:
            json.dump({"cases": RECORD}, f, indent=1)


def both(kernels, spec, grid, threads, args, smem=0):
    """Run one launch on the GPU and on the executor from the same host arrays; (gpu outputs, emu outputs), each
    the arrays of `args` after the launch (scalars as given)."""
    import cupy as cp

    fn = kernels.function(spec)
    if smem > 48 * 1024:
        func_attr.allow_dynamic_shared(fn, smem)
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    fn(grid, (threads,), tuple(dev), shared_mem=smem)
    cp.cuda.runtime.deviceSynchronize()
    gpu = [d.get() if isinstance(a, np.ndarray) else a for a, d in zip(args, dev)]
    host = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    emu.launch(spec, grid, threads, tuple(host), smem)
    return gpu, host


def agree(what: str, gpu: np.ndarray, cpu: np.ndarray, bound: np.ndarray, rel: float) -> None:
    gpu, cpu = np.asarray(gpu, np.float64), np.asarray(cpu, np.float64)
    assert np.isfinite(gpu).all() and np.isfinite(cpu).all(), f"{what}: unwritten (NaN) elements"
    diff = np.abs(gpu - cpu)
    worst = float((diff / np.maximum(bound, 1e-30)).max(initial=0))
    RECORD.append({"case": what, "max_abs_diff": float(diff.max(initial=0)), "max_diff_over_bound": worst,
                   "tolerance": rel})
    assert worst <= rel, f"{what}: the executor and the GPU differ by {worst:.3g} of the bound (> {rel})"


GEMM_CASES = [(70, 200, 808, 1), (70, 200, 808, 3), (5, 136, 40, 4), (130, 65, 72, 2)]


def gemm_case(kernels, spec, geo_grid, threads, smem, M, N, K, splits, what):
    rng = np.random.default_rng(M * 7 + N + K + splits)
    A = rng.standard_normal((M, K)).astype(np.float16)
    W = (0.05 * rng.standard_normal((N, K))).astype(np.float16)
    C = np.full((M, N), np.nan, np.float32)
    grid = geo_grid(M, N, splits)
    workspace = np.full(max(1, splits * grid[0] * grid[1] * 128 * 256), np.nan, np.float32)  # the largest tile
    count = np.zeros(grid[0] * grid[1], np.uint32)
    args = (A, W, C, workspace, count, np.int32(M), np.int32(N), np.int32(K), np.int32(0))
    gpu, cpu = both(kernels, spec, grid, threads, args, smem)
    bound = np.abs(A).astype(np.float64) @ np.abs(W).astype(np.float64).T
    agree(f"{what} M={M} N={N} K={K} S={splits}", gpu[2], cpu[2], bound, 1e-5)


@pytest.mark.parametrize("M,N,K,splits", GEMM_CASES)
def test_mma_gemm_on_the_executor_equals_the_gpu(kernels, M, N, K, splits):
    """mma.sync.m16n8k16 and ldmatrix (x4, .trans) fragments, cp.async: gemm.cu."""
    g = MMA_GEMM
    grid = lambda m, n, s: (-(-n // g.tile_n), -(-m // g.tile_m), s)  # noqa: E731
    gemm_case(kernels, g.spec, grid, g.threads, g.smem, M, N, K, splits, "gemm (mma.sync)")


@pytest.mark.parametrize("M,N,K,splits", GEMM_CASES)
@pytest.mark.parametrize("defines", wgmma_ops.VARIANTS, ids=["-".join(f"{k}{v}" for k, v in d) or "default"
                                                              for d in wgmma_ops.VARIANTS])
def test_wgmma_gemm_on_the_executor_equals_the_gpu(kernels, defines, M, N, K, splits):
    """wgmma.mma_async with its shared-memory descriptors, 128-byte swizzle (and none): gemm_wgmma.cu."""
    geo = wgmma_ops.geometry(defines)
    spec = KernelSpec(wgmma_ops.SOURCE, "gemm_wgmma", tuple(defines), arch_specific=True)
    grid = lambda m, n, s: (-(-n // geo.tile_n), -(-m // geo.tile_m), s)  # noqa: E731
    gemm_case(kernels, spec, grid, geo.threads, geo.smem_bytes, M, N, K, splits, f"gemm_wgmma {dict(defines)}")


@pytest.mark.parametrize("defines", attention_mma_ops.VARIANTS,
                         ids=["-".join(f"{k}{v}" for k, v in d) for d in attention_mma_ops.VARIANTS])
def test_mma_attention_on_the_executor_equals_the_gpu(kernels, defines):
    """mma.sync for Q K^T and P V, ldmatrix (.trans for V), ex2.approx: attention_mma.cu, 70 rows after 75 keys."""
    d = dict(defines)
    hd, group, warps = d["HEAD_DIM"], d["GROUP"], d["WARPS"]
    start, n, kv_heads = 70, 75, 2
    q_rows, k, v, max_seq, scale = mma_cases.inputs(hd, group, kv_heads, start, n, n, seed=hd + group, poison=False)
    out = np.full(q_rows.shape, np.nan, np.float16)
    spec = KernelSpec("attention_mma.cu", "attention_prefill_mma", tuple(defines))
    grid = (kv_heads, -(-n // attention_mma_ops.rows_per_block(group, warps)))
    gpu, cpu = both(kernels, spec, grid, attention_mma_ops.threads(warps),
                    (q_rows, k, v, out, np.int32(start), np.int32(n), np.int32(max_seq), np.float32(scale),
                     np.int32(max_seq)))
    bound = np.maximum(np.abs(cpu[3].astype(np.float64)), 1.0)  # an FP16 rounding or two of the output
    agree(f"attention_prefill_mma {d}", gpu[3], cpu[3], bound, 2e-3)
    gpu, cpu = both(kernels, spec, grid, attention_mma_ops.threads(warps),  # a sliding window of 50 keys
                    (q_rows, k, v, out, np.int32(start), np.int32(n), np.int32(max_seq), np.float32(scale),
                     np.int32(50)))
    agree(f"attention_prefill_mma {d}, window 50", gpu[3], cpu[3], np.maximum(np.abs(cpu[3].astype(np.float64)),
                                                                              1.0), 2e-3)


def same_bits(what: str, gpu: np.ndarray, cpu: np.ndarray) -> None:
    if FAKE_GPU_MODE == "1":  # the "GPU" is the NumPy twin, which keeps a NaN's payload: where the NaNs are
        assert np.array_equal(np.isnan(gpu), np.isnan(cpu)), what
        return
    bits = {2: np.uint16, 4: np.uint32}[gpu.dtype.itemsize]
    gpu, cpu = gpu.view(bits).ravel(), cpu.view(bits).ravel()
    differ = np.flatnonzero(gpu != cpu)
    assert differ.size == 0, (f"{what}: {differ.size} elements differ, the first {int(gpu[differ[0]]):#x} on the "
                              f"GPU, {int(cpu[differ[0]]):#x} on the executor")


def test_nan_conversions_on_the_executor_equal_the_gpu(kernels):
    """A NaN of any sign and payload through cvt.f32.f16 (embed_rows widens every FP16 NaN) and cvt.rn.f16.f32
    (rope_kv_rows stores v unrotated after the bias's add.rn, q and k after more arithmetic on NaNs): the executor
    gives the canonical NaN (0x7FFFFFFF, 0x7FFF), which must be the GPU's bit for bit
    (cullama/runtime/emu/emu_abi.h)."""
    halves = np.concatenate([np.arange(0x7C01, 0x8000), np.arange(0xFC01, 0x10000), [0x7C00, 0x3C00]])
    embed = halves.astype(np.uint16).view(np.float16).reshape(1, -1)  # [1, 2048]: every FP16 NaN
    d = embed.shape[1]
    gpu, cpu = both(kernels, KernelSpec("prefill.cu", "embed_rows"), (1,), 256,
                    (np.zeros(1, np.int32), embed, np.zeros((1, d), np.float32), np.int32(d), np.int32(1)))
    same_bits("embed_rows (cvt.f32.f16)", gpu[2], cpu[2])

    n, hd, heads, kv_heads = 256, 8, 1, 1  # 24 floats a row: q, k, v; every v float goes straight to FP16
    rng = np.random.default_rng(0)
    payload = rng.integers(1, 1 << 23, (n, (heads + 2 * kv_heads) * hd), dtype=np.uint32)
    sign = rng.integers(0, 2, payload.shape, dtype=np.uint32) << 31
    qkv = (sign | 0x7F800000 | payload).view(np.float32)
    rope = rng.standard_normal((n, hd // 2, 2)).astype(np.float32)
    q_rows, k_cache, v_cache = (np.zeros(shape, np.float16) for shape in ((n, heads * hd), (kv_heads, n, hd),
                                                                          (kv_heads, n, hd)))
    with np.errstate(invalid="ignore"):  # the fake GPU's twin multiplies NaNs
        gpu, cpu = both(kernels, KernelSpec("prefill.cu", "rope_kv_rows"), (n,), 256,
                        (qkv, np.zeros(qkv.shape[1], np.float16), rope, q_rows, k_cache, v_cache, np.int32(0),
                         np.int32(heads), np.int32(kv_heads),
                         np.int32(hd), np.int32(n)))
    for i, what in ((3, "q_rows"), (4, "k_cache"), (5, "v_cache")):
        same_bits(f"rope_kv_rows {what} (cvt.rn.f16.f32)", gpu[i], cpu[i])


@pytest.mark.parametrize("bits, kblock", [(16, False), (8, False), (4, False), (8, True), (4, True)])
def test_gemv_mma_on_the_executor_equals_the_gpu(kernels, bits, kblock):
    """gemv_mma.cu's decode instance (gemv_residual, K over many k-blocks, a partial last n-tile): the B fragments as
    loaded (FP16 words, or lop3 / prmt extraction and mul.rn.f16x2 of the quantized codes; KBLOCK_SCALE: the exact
    codes and each k-block's fmaf by its scale), the A fragments (cvt.rn.f16x2) and mma.sync m16n8k16 against the GPU,
    within 1e-5 of the sum of |products|: the executor sums an MMA's products in double, the tensor core in its own
    order (not bit for bit, as for the GEMMs)."""
    rng = np.random.default_rng(bits)
    M, K = 37, (4096 + 2 * 128 // bits) if not kblock else 4096 + 512
    group = 0 if bits == 16 else 128 if kblock else 128 // bits
    assert kblock == gemv_mma_ops.kblock_scale(bits, group)
    if bits == 16:
        W = gemv_mma_cases.rand(rng, M, K, scale=0.05, dtype=np.float16)
        weights, w16 = (W, W), W
    else:
        weights = gemv_mma_cases.quantized(rng, M, K, bits, group)
        w16 = quant.dequantize(*weights, bits, np.float16)
    inp, x = rng.standard_normal(K).astype(np.float16), rng.standard_normal(M).astype(np.float32)  # inp: FP16
    spec = KernelSpec(gemv_mma_ops.SOURCE, "gemv_residual", gemv_mma_ops.defines(bits, 1, group))
    norm_w = (1 + 0.1 * rng.standard_normal(M)).astype(np.float16)  # the next RMSNorm's, for the prepared input
    xn, ssp = np.zeros(M, np.float16), np.zeros(-(-M // gemv_mma_ops.SS_SPAN), np.float32)
    gpu, cpu = both(kernels, spec, (-(-M // gemv_mma_ops.rows_per_block()),), gemv_mma_ops.THREADS,
                    (inp, *weights, x, norm_w, xn, ssp, np.int32(M), np.int32(K), np.int32(group)))
    bound = np.abs(w16).astype(np.float64) @ np.abs(inp.astype(np.float16)).astype(np.float64) + np.abs(x)
    agree(f"gemv_mma residual BITS={bits} M={M} K={K}", gpu[3], cpu[3], bound, 1e-5)
    for i, prepared in ((5, "xn"), (6, "ssp")):  # from the new x: as close as x itself
        want = gemv_mma_ops.prepare(gpu[3][None], norm_w, M)[i - 5][0]
        np.testing.assert_array_equal(gpu[i], want, err_msg=f"residual's {prepared} from its x")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gemm_on_the_executor_equals_the_gpu(kernels, bits):
    """The W tile dequantized into shared memory (mul.rn.f16x2), then mma.sync: gemm_quant.cu with and without
    split-K, against the GPU within 1e-5 of the sum of |products|."""
    for M, N, K, splits, accumulate, group in gemm_quant_cases.CASES[bits][:3]:
        rng = np.random.default_rng(M + N + K)
        A = rng.standard_normal((M, K)).astype(np.float16)
        qw, qp = gemv_mma_cases.quantized(rng, N, K, bits, group)
        C = np.full((M, N), np.nan, np.float32)
        grid = (-(-N // MMA_GEMM.tile_n), -(-M // MMA_GEMM.tile_m), splits)
        workspace = np.full(max(1, splits * grid[0] * grid[1] * MMA_GEMM.tile_m * MMA_GEMM.tile_n), np.nan, np.float32)
        count = np.zeros(grid[0] * grid[1], np.uint32)
        spec = KernelSpec(gemm_quant_ops.SOURCE, "gemm_quant", gemm_quant_ops.defines(bits))
        args = (A, qw, qp, C, workspace, count, np.int32(M), np.int32(N), np.int32(K), np.int32(0), np.int32(group))
        gpu, cpu = both(kernels, spec, grid, MMA_GEMM.threads, args)
        w16 = quant.dequantize(qw, qp, bits, np.float16).astype(np.float64)
        bound = np.abs(A).astype(np.float64) @ np.abs(w16).T
        agree(f"gemm_quant BITS={bits} M={M} N={N} K={K} S={splits} group={group}", gpu[3], cpu[3], bound, 1e-5)
