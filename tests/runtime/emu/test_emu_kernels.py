"""Every kernel of kernels_cu, as written, run on the CPU by cullama.runtime.emu against its NumPy twin: every variant a
plan, `cullama bench` or `cullama kernels` can launch, on small odd shapes, in three warp schedules (forward,
reverse, shuffled), outputs NaN-poisoned first (gemv_mma.cu's in tests/runtime/emu/test_emu_gemv_mma.py). Each
check says where the kernel must equal the twin bit for bit
(the twin does the same float32 operations in the same order) and where it needs a tolerance (the twin sums with
NumPy's matmul or pairwise sums, or calls NumPy's exp, in another order or rounding than the kernel's).

The check_* functions take `source_dir`: tests/runtime/emu/test_emu_mutations.py runs them on copies of kernels_cu with
seeded bugs, which they must catch."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.ops import test_attention as attention_cases
from tests.runtime.ops import test_attention_mma as mma_cases
from tests.runtime.ops import test_sampling_kernel as sample_cases
from cullama.runtime import emu, sampling
from cullama.runtime.ops import attention as attention_twin
from cullama.runtime.ops import attention_mma as attention_mma_ops
from cullama.runtime.ops import bandwidth as bandwidth_twin
from cullama.runtime.ops import fill as fill_twin
from cullama.runtime.ops import gemm as gemm_twin
from cullama.runtime.ops import gemm_wgmma as wgmma_ops
from cullama.runtime.ops import gemv_mma as gemv_twin
from cullama.runtime.ops import prefill as prefill_twin
from cullama.runtime.ops import prepare as prepare_twin
from cullama.runtime.plan import ATTENTION_THREADS, GEMV_THREADS, ROW_THREADS, SAMPLE_THREADS
from cullama.runtime.prefill_kernels import MMA_GEMM
from cullama.model.reference import rope_tables
from cullama.runtime.registry import KernelSpec

pytestmark = pytest.mark.emu
SCHEDULES = emu.SCHEDULES
SEED = 7  # of the shuffled schedule
EPS = np.float32(1e-5)


def ids(variants):
    return ["-".join(f"{k}{v}" for k, v in d) or "default" for d in variants]


def run(spec, grid, block, args, schedule, source_dir=None, shared_mem=0):
    emu.launch(spec, grid, block, args, shared_mem, schedule=schedule, seed=SEED, source_dir=source_dir)


def nan(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


def rand(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def close(out, ref, rel, what):
    """Within `rel` of the largest |ref|: float32 sums in another order (or fp16 outputs a rounding apart)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), f"{what}: {int((~np.isfinite(out)).sum())} elements not finite (unwritten?)"
    err = np.abs(out - ref).max(initial=0)
    assert err <= rel * max(1.0, np.abs(ref).max(initial=0)), f"{what}: off by {err}"


def exact(out, ref, what):
    """Bit for bit (NaN where the twin left the poison)."""
    out, ref = np.asarray(out), np.asarray(ref)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(out.dtype.itemsize)
    same = out.view(bits) == ref.view(bits) if bits and out.dtype.kind == "f" else out == ref
    assert same.all(), f"{what}: {int((~same).sum())} of {same.size} elements differ"


# -- attention.cu ---------------------------------------------------------------------------------------
# The twins use NumPy's matmul and exp: outputs and split partials within float32 rounding. Exact: an empty
# split's partial (acc 0, m -inf, l 0), the arrival counters back at 0, prefill rows past n_rows untouched.
def check_attention_decode(defines, schedule, source_dir=None, n=20, window=None):
    """20 keys in 6 splits of 4 (the sixth empty); with a window, the splits divide the window's keys alone: keys
    older than it are NaN (never read)."""
    d = dict(defines)
    hd, group, kv_heads, splits = d["HEAD_DIM"], d["GROUP"], 2, 6
    q, k, v, state, max_seq, scale = attention_cases.decode_inputs(hd, group, kv_heads, n, splits, seed=hd + group)
    if window:
        k[:, :max(0, n - window)], v[:, :max(0, n - window)] = np.nan, np.nan
    ref_part, _, ref_out = attention_cases.run_decode_twin(q, k, v, state, max_seq, scale, splits, window)
    part, out, count = nan(*ref_part.shape), nan(*ref_out.shape, dtype=np.float16), np.zeros(kv_heads, np.uint32)
    spec = KernelSpec("attention.cu", "attention_decode", (("HEAD_DIM", hd), ("GROUP", group)))
    run(spec, (kv_heads, splits), ATTENTION_THREADS,
        (q, k, v, part, count, out, state, attention_cases.ONE_ROW, np.int32(max_seq), np.float32(scale),
         np.int32(window or max_seq)),
        schedule, source_dir)
    close(out, ref_out, 1e-3, "attention_decode out")  # FP16: within one rounding where the float32 sums differ
    empty = np.isinf(ref_part[0, :, hd])  # the splits past the keys: acc 0, m -inf, l 0, exactly
    assert empty[-1] and not empty[0]
    close(part[:, ~empty], ref_part[:, ~empty], 1e-5, "attention_decode partials")
    exact(part[:, empty], ref_part[:, empty], "attention_decode's empty splits")
    exact(count, np.zeros(kv_heads, np.uint32), "attention_decode arrival counters")


def check_prefill_attention(spec, rows_per_block, threads, hd, group, start, n, schedule, source_dir, window=None):
    """attention_prefill's contract, which attention_prefill_mma shares: rows < n within 2e-3 of the twin (FP16
    out), rows past n untouched, a grid one block taller than needed harmless. Keys past the chunk are NaN, and
    with a sliding window the keys older than every row's window too."""
    kv_heads = 2
    q_rows, k, v, max_seq, scale = mma_cases.inputs(hd, group, kv_heads, start, n, n + 3, seed=hd + group)
    if window:
        k[:, :max(0, start + 1 - window)], v[:, :max(0, start + 1 - window)] = np.nan, np.nan
    ref = mma_cases.run_twin(q_rows, k, v, start, n, max_seq, scale, window)
    out = nan(*q_rows.shape, dtype=np.float16)
    run(spec, (kv_heads, -(-n // rows_per_block) + 1), threads,
        (q_rows, k, v, out, np.int32(start), np.int32(n), np.int32(max_seq), np.float32(scale),
         np.int32(window or max_seq)), schedule, source_dir)
    close(out[:n], ref[:n], 2e-3, spec.name)
    exact(out[n:], ref[n:], f"{spec.name} rows past n_rows")


def check_attention_prefill(defines, schedule, source_dir=None, window=None):
    d = dict(defines)
    check_prefill_attention(KernelSpec("attention.cu", "attention_prefill", tuple(defines)), d["ROWS_Q"],
                            ATTENTION_THREADS, d["HEAD_DIM"], d["GROUP"], 9, 13, schedule, source_dir, window)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defines", attention_twin.VARIANTS, ids=ids(attention_twin.VARIANTS))
def test_attention(defines, schedule):
    check_attention_decode(defines, schedule)
    check_attention_prefill(defines, schedule)


# A sliding window (Mistral): decode over 50 keys, a window of 13 (splits of 3, 3, 3, 3, 1 and an empty sixth)
# and of 1; prefill rows 9..21 with windows of 4 (the edge inside every block) and 1 (each row its own key).
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defines", attention_twin.VARIANTS[:3] + attention_twin.VARIANTS[-2:],
                         ids=ids(attention_twin.VARIANTS[:3] + attention_twin.VARIANTS[-2:]))
def test_attention_sliding_window(defines, schedule):
    for window in (13, 1):
        check_attention_decode(defines, schedule, n=50, window=window)
    for window in (4, 1):
        check_attention_prefill(defines, schedule, window=window)


# -- attention_mma.cu: P is rounded to FP16 for the tensor cores, the twin keeps float32: within 2e-3 ------
def check_attention_mma(defines, schedule, source_dir=None, window=None):
    d = dict(defines)
    hd, group, warps = d["HEAD_DIM"], d["GROUP"], d["WARPS"]
    check_prefill_attention(KernelSpec("attention_mma.cu", "attention_prefill_mma", tuple(defines)),
                            attention_mma_ops.rows_per_block(group, warps), attention_mma_ops.threads(warps), hd, group,
                            70, 75, schedule, source_dir, window)  # keys 0..144: three 64-key tiles


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defines", attention_mma_ops.VARIANTS, ids=ids(attention_mma_ops.VARIANTS))
def test_attention_mma(defines, schedule):
    check_attention_mma(defines, schedule)


# Windows of 20 (the first key tile past key 0 for the later rows' blocks, the edge inside a tile) and 1.
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defines", attention_mma_ops.VARIANTS[:2] + attention_mma_ops.VARIANTS[-1:],
                         ids=ids(attention_mma_ops.VARIANTS[:2] + attention_mma_ops.VARIANTS[-1:]))
def test_attention_mma_sliding_window(defines, schedule):
    for window in (20, 1):
        check_attention_mma(defines, schedule, window=window)


# -- gemm.cu and gemm_wgmma.cu: C = A W^T (+ C) -------------------------------------------------------------
# The twin is NumPy's float32 matmul: within float32 rounding of the sum of |products| (1e-5 of it), split-K
# or not. Exact: rows of C past M untouched, the tile counters back at 0, the workspace untouched when S = 1.
GEMM_CASES = [(70, 200, 808, 1, 0), (70, 200, 808, 3, 1), (5, 136, 40, 4, 0), (1, 8, 8, 1, 1), (130, 65, 72, 2, 0)]


def check_gemm(spec, tile_m, tile_n, threads, smem, schedule, source_dir=None, cases=GEMM_CASES):
    rng = np.random.default_rng(5)
    for M, N, K, splits, accumulate in cases:
        A, W = rand(rng, M, K, dtype=np.float16), rand(rng, N, K, scale=0.05, dtype=np.float16)
        C0 = rand(rng, M + 2, N) if accumulate else nan(M + 2, N)  # two guard rows past M
        C0[M:] = np.nan
        ref = C0.copy()
        gemm_twin.gemm(A, W, ref, None, None, M, N, K, accumulate)
        grid = (-(-N // tile_n), -(-M // tile_m), splits)
        workspace, count = nan(max(1, splits * grid[0] * grid[1] * tile_m * tile_n)), np.zeros(grid[0] * grid[1],
                                                                                                 np.uint32)
        C = C0.copy()
        run(spec, grid, threads, (A, W, C, workspace, count, np.int32(M), np.int32(N), np.int32(K),
                                  np.int32(accumulate)), schedule, source_dir, shared_mem=smem)
        where = f"{spec.name} M={M} N={N} K={K} S={splits}"
        bound = np.abs(A).astype(np.float32) @ np.abs(W).astype(np.float32).T + np.nan_to_num(np.abs(C0[:M]))
        assert np.isfinite(C[:M]).all(), f"{where}: unwritten or NaN elements"
        excess = np.abs(C[:M].astype(np.float64) - ref[:M]) - 1e-5 * bound
        assert excess.max() <= 0, f"{where}: off by {excess.max()} beyond float32 rounding"
        exact(C[M:], C0[M:], f"{where}: rows past M")
        exact(count, np.zeros_like(count), f"{where}: tile counters")
        if splits == 1:
            assert np.isnan(workspace).all(), f"{where}: S = 1 wrote the workspace"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gemm(schedule):
    check_gemm(MMA_GEMM.spec, MMA_GEMM.tile_m, MMA_GEMM.tile_n, MMA_GEMM.threads, 0, schedule)


def check_gemm_wgmma(defines, schedule, source_dir=None, cases=GEMM_CASES):
    geo = wgmma_ops.geometry(defines)
    spec = KernelSpec(wgmma_ops.SOURCE, "gemm_wgmma", tuple(defines), arch_specific=True)
    check_gemm(spec, geo.tile_m, geo.tile_n, geo.threads, geo.smem_bytes, schedule, source_dir, cases)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defines", wgmma_ops.VARIANTS, ids=ids(wgmma_ops.VARIANTS))
def test_gemm_wgmma(defines, schedule):
    check_gemm_wgmma(defines, schedule)


# -- prefill.cu: one block per row -----------------------------------------------------------------------------
# Exact: embed_rows (a copy), rope_kv_rows (the twin's float32 operations in the kernel's order), and rows and
# cache positions outside the launch. Within an FP16 rounding: rmsnorm_rows (a block sum against NumPy's
# pairwise mean), silu_mul_rows (the host's expf against NumPy's exp).
def check_prefill(schedule, source_dir=None):
    rng = np.random.default_rng(3)
    n, chunk, d, vocab = 5, 7, 264, 37  # d / 8 = 33 vectors: most of the 256 threads idle
    spec = lambda name: KernelSpec("prefill.cu", name)  # noqa: E731
    ids_ = rng.integers(0, vocab, chunk).astype(np.int32)
    embed, w = rand(rng, vocab, d, dtype=np.float16), rand(rng, d, dtype=np.float16)
    x, rx = nan(chunk, d), nan(chunk, d)
    prefill_twin.embed_rows(ids_, embed, rx, d, vocab, grid=(n, 1, 1))
    run(spec("embed_rows"), n, ROW_THREADS, (ids_, embed, x, np.int32(d), np.int32(vocab)), schedule, source_dir)
    exact(x, rx, "embed_rows")
    # Ids outside the vocabulary (the executor faults on a read outside embed): their rows NaN, the others exact.
    bad_ids = np.array([2, -1, vocab, 2**31 - 1, -2**31, vocab - 1], np.int32)
    bad, rbad = nan(len(bad_ids), d), np.zeros((len(bad_ids), d), np.float32)
    prefill_twin.embed_rows(bad_ids, embed, rbad, d, vocab, grid=(len(bad_ids), 1, 1))
    run(spec("embed_rows"), len(bad_ids), ROW_THREADS, (bad_ids, embed, bad, np.int32(d), np.int32(vocab)), schedule,
        source_dir)
    exact(bad, rbad, "embed_rows of ids outside the vocabulary")
    assert np.isnan(bad[1:-1]).all() and not np.isnan(bad[[0, -1]]).any()
    # embed_rows_prepared: the same rows, and each one's prepared RMSNorm input (NaN rows: NaN), bit for bit
    parts = -(-d // prepare_twin.SS_SPAN)
    got = (nan(len(bad_ids), d), nan(len(bad_ids), d, dtype=np.float16), nan(len(bad_ids), parts))
    want = tuple(np.zeros_like(a) for a in got)
    prefill_twin.embed_rows_prepared(bad_ids, embed, w, *want, d, vocab, grid=(len(bad_ids), 1, 1))
    run(spec("embed_rows_prepared"), len(bad_ids), ROW_THREADS, (bad_ids, embed, w, *got, np.int32(d), np.int32(vocab)),
        schedule, source_dir)
    for a, b, what in zip(got, want, ("x", "xn", "ssp")):
        exact(a, b, f"embed_rows_prepared {what}")
    exact(got[0], rbad, "embed_rows_prepared x against embed_rows")
    xn, rxn = nan(chunk, d, dtype=np.float16), nan(chunk, d, dtype=np.float16)
    prefill_twin.rmsnorm_rows(rx, w, rxn, d, EPS, grid=(n, 1, 1))
    run(spec("rmsnorm_rows"), n, ROW_THREADS, (x, w, xn, np.int32(d), EPS), schedule, source_dir)
    close(xn[:n], rxn[:n], 2e-3, "rmsnorm_rows")
    exact(xn[n:], rxn[n:], "rmsnorm_rows past n")
    hd, heads, kv, start = 8, 3, 1, 4
    max_seq = start + n + 2
    qkv = rand(rng, chunk, (heads + 2 * kv) * hd)
    bias = rand(rng, (heads + 2 * kv) * hd, dtype=np.float16)  # Qwen2's q|k|v bias, added before RoPE
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
    outs = [nan(chunk, heads * hd, dtype=np.float16), nan(kv, max_seq, hd, dtype=np.float16),
            nan(kv, max_seq, hd, dtype=np.float16)]
    refs = [o.copy() for o in outs]
    scalars = (np.int32(start), np.int32(heads), np.int32(kv), np.int32(hd), np.int32(max_seq))
    prefill_twin.rope_kv_rows(qkv, bias, rope, *refs, *scalars, grid=(n, 1, 1))
    run(spec("rope_kv_rows"), n, ROW_THREADS, (qkv, bias, rope, *outs, *scalars), schedule, source_dir)
    for out, ref, what in zip(outs, refs, ("q_rows", "k_cache", "v_cache")):
        exact(out, ref, f"rope_kv_rows {what}")
    ff = 40
    gu = rand(rng, chunk, 2 * ff, scale=4.0)
    h, rh = nan(chunk, ff, dtype=np.float16), nan(chunk, ff, dtype=np.float16)
    prefill_twin.silu_mul_rows(gu, rh, ff, grid=(n, 1, 1))
    run(spec("silu_mul_rows"), n, ROW_THREADS, (gu, h, np.int32(ff)), schedule, source_dir)
    close(h[:n], rh[:n], 2e-3, "silu_mul_rows")
    exact(h[n:], rh[n:], "silu_mul_rows past n")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prefill_rows(schedule):
    check_prefill(schedule)


# The QKV epilogue (the bias, RoPE, the cache write) at the head widths and groups of LLaMA-3.2-1B (64 x GQA 4),
# LLaMA-3-8B and Mistral-7B (128 x 4) and Qwen2.5-7B (128 x 7), where the checks above use hd 8: in decode
# (gemv_qkv_rope, the plan's variant) and in the prefill (rope_kv_rows), the same tolerances as there.
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("hd,group", [(64, 4), (128, 4), (128, 7)], ids=["hd64-gqa4", "hd128-gqa4", "hd128-gqa7"])
def test_qkv_epilogue_at_llama3_and_qwen2_head_dims(hd, group, schedule):
    from cullama.runtime import plan

    rng = np.random.default_rng(hd + group)
    kv, d, pos, n, chunk = 2, 72, 5, 3, 4
    heads, max_seq = kv * group, pos + n + 2
    rows = (heads + 2 * kv) * hd
    bias = rand(rng, rows, dtype=np.float16)  # [q|k|v rows]
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 500000.0), -1).astype(np.float32)  # [max_seq, hd / 2, 2]
    x, norm_w, W = rand(rng, d), rand(rng, d, dtype=np.float16), rand(rng, rows, d, scale=0.2, dtype=np.float16)
    state = np.array([pos, 0, 0, 0, 0, 0, 0, 0], np.int32)
    scalars = (np.int32(d), np.int32(heads), np.int32(kv), np.int32(hd), np.int32(max_seq), EPS)
    q, kc, vc = nan(heads * hd), nan(kv, max_seq, hd, dtype=np.float16), nan(kv, max_seq, hd, dtype=np.float16)
    rq, rk, rv = q.copy(), kc.copy(), vc.copy()
    one_row = np.zeros((1, 2), np.int32)  # the rows table of a decode step: slot 0, offset 0
    xn, ssp = gemv_twin.prepare(x, norm_w, d)  # the input as the residual before it prepares it
    gemv_twin.gemv_qkv_rope(xn, ssp, W, W, bias, rq, rk, rv, rope, state, one_row, *scalars, 0)
    run(plan.gemv("gemv_qkv_rope"), -(-rows // plan.gemv_rows()), GEMV_THREADS,  # FP16: W twice, group 0
        (xn, ssp, W, W, bias, q, kc, vc, rope, state, one_row, *scalars, np.int32(0)), schedule)
    close(q, rq, 1e-5, "gemv_qkv_rope q")
    close(kc[:, pos], rk[:, pos], 2e-3, "gemv_qkv_rope k")
    close(vc[:, pos], rv[:, pos], 2e-3, "gemv_qkv_rope v")
    exact(np.delete(kc, pos, axis=1), np.delete(rk, pos, axis=1), "k_cache outside the position")
    exact(np.delete(vc, pos, axis=1), np.delete(rv, pos, axis=1), "v_cache outside the position")

    qkv = rand(rng, chunk, rows)  # [chunk, q|k|v rows] f32: the prefill GEMM's output
    outs = [nan(chunk, heads * hd, dtype=np.float16), nan(kv, max_seq, hd, dtype=np.float16),
            nan(kv, max_seq, hd, dtype=np.float16)]
    refs = [o.copy() for o in outs]
    row_scalars = (np.int32(pos), np.int32(heads), np.int32(kv), np.int32(hd), np.int32(max_seq))
    prefill_twin.rope_kv_rows(qkv, bias, rope, *refs, *row_scalars, grid=(n, 1, 1))
    run(KernelSpec("prefill.cu", "rope_kv_rows"), n, ROW_THREADS, (qkv, bias, rope, *outs, *row_scalars), schedule)
    for out, ref, what in zip(outs, refs, ("q_rows", "k_cache", "v_cache")):
        exact(out, ref, f"rope_kv_rows {what}")


# -- sampling.cu --------------------------------------------------------------------------------------------
# Exact: the greedy token, and for every draw the state, seen and x updates that follow from the kernel's
# token (NO_TOKEN where no logit can be drawn: seen untouched, x = 0; an index out of bounds would fail the
# launch's guards). A sampled token equals the twin's, or lies within rounding of a bucket edge (the kernel's
# block scan and NumPy's sequential cumsum add in other orders; test_sampling_kernel.explained).
SAMPLE_OPTIONS = [(0.0, 0, 1.0, 1.0), (0.0, 5, 0.5, 1.3), *sample_cases.SAMPLED]


def check_sample(options, V, schedule, source_dir=None, draws=3, nonfinite=None):
    temperature, top_k, top_p, penalty = options
    fp = sample_cases.fparams(temperature, top_p, penalty)
    for draw in range(draws):
        logits, seen, embed = sample_cases.inputs(V, seed=draw, ties=temperature == 0, nonfinite=nonfinite)
        state = sample_cases.make_state(sample_cases.SEEDS[draw], step=draw, top_k=top_k)
        params = sample_cases.ops.params_from(state, fp)
        ref_state, ref_seen = state.copy(), seen.copy()
        sample_cases.run_twin(logits, ref_seen, ref_state, fp, embed)
        x, before = nan(sample_cases.D), seen.copy()
        state[sample_cases.ops.STATE_TOKEN] = -2
        nxt = sample_cases.next_input(x)
        run(KernelSpec("sampling.cu", "sample"), 1, SAMPLE_THREADS,
            (logits, seen, state, fp, embed, *nxt, *sample_cases.one_row(),
             *sample_cases.one_row_sizes(V, sample_cases.D)),
            schedule, source_dir)
        sample_cases.assert_prepared(nxt)
        token, expected = int(state[sample_cases.ops.STATE_TOKEN]), int(ref_state[sample_cases.ops.STATE_TOKEN])
        where = f"sample {options} {nonfinite or ''} draw {draw}"
        assert 0 <= token < V or token == expected == sampling.NO_TOKEN, f"{where}: token {token}"
        if token != expected:
            assert temperature != 0, f"{where}: {token}, the twin {expected}"
            assert sample_cases.explained(token, logits, params, before.astype(bool), draw), (where, token)
        exact(state, np.concatenate([ref_state[:1], [token], ref_state[2:]]), f"{where}: state")
        exact(seen, np.where(np.arange(V) == token, 1, before).astype(np.uint8), f"{where}: seen")
        x_expected = embed[token].astype(np.float32) if token != sampling.NO_TOKEN else np.zeros_like(x)
        exact(x, x_expected, f"{where}: x")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("options", SAMPLE_OPTIONS, ids=[f"T{t}-k{k}-p{p}-r{r}" for t, k, p, r in SAMPLE_OPTIONS])
def test_sample(options, schedule):
    check_sample(options, 1000, schedule)


@pytest.mark.parametrize("V", [33001, 152065], ids=["33001", "qwen2.5-152065"])
@pytest.mark.parametrize("options", [SAMPLE_OPTIONS[1], SAMPLE_OPTIONS[5], SAMPLE_OPTIONS[3]],
                         ids=["greedy", "sampled-both-cuts", "sampled-top-k"])
def test_sample_past_the_on_chip_ids(options, V):
    """V > 1024 x 32: each thread re-reads the ids past its registers and shared memory at every pass; at 152,065
    (Qwen2.5's 152,064 and one: odd) 120 of its 152 ids, in every top-k and top-p pass. Exact as at any V: the
    greedy token, and the sampled one within rounding of a bucket edge."""
    check_sample(options, V, "shuffled", draws=1)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("nonfinite", sample_cases.NONFINITE)
@pytest.mark.parametrize("options", [SAMPLE_OPTIONS[0], SAMPLE_OPTIONS[1], SAMPLE_OPTIONS[5]],
                         ids=["greedy", "greedy-penalty", "sampled-both-cuts"])
def test_sample_with_non_finite_logits(options, nonfinite, schedule):
    """NaN as -inf, +inf tokens sharing the mass, NO_TOKEN where nothing can be drawn: as the twin."""
    check_sample(options, 517, schedule, nonfinite=nonfinite)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_uniform_probe_is_bit_exact(schedule):
    out = nan(1)
    for seed in sample_cases.SEEDS:
        for step in (0, 7, 2**31 - 1):
            run(KernelSpec("sampling.cu", "uniform_probe"), 1, 1, (np.uint64(seed), np.int32(step), out), schedule)
            assert float(out[0]) == sampling.uniform(seed, step), (seed, step)


# -- fill.cu (exact: the _rn intrinsics round as the twin's float32) and bandwidth.cu (a float32 tree against
# the twin's float64 sum: within 1e-5 of the sum of |values|) ------------------------------------------------------
def check_fill(schedule, source_dir=None):
    n = 5003  # three blocks of 256: a grid-stride loop
    out, ref = nan(n + 4, dtype=np.float16), nan(n + 4, dtype=np.float16)
    fill_twin.fill_uniform(ref, n, 2**63 + 11, 0.5, 0.25)
    run(KernelSpec("fill.cu", "fill_uniform"), 3, fill_twin.THREADS,
        (out, np.uint64(n), np.uint64(2**63 + 11), np.float32(0.5), np.float32(0.25)), schedule, source_dir)
    exact(out, ref, "fill_uniform")
    words, ref_words = np.zeros(n + 4, np.uint32), np.zeros(n + 4, np.uint32)
    fill_twin.fill_words(ref_words, n, 2**64 - 3)
    run(KernelSpec("fill.cu", "fill_words"), 3, fill_twin.THREADS, (words, np.uint64(n), np.uint64(2**64 - 3)),
        schedule, source_dir)
    exact(words, ref_words, "fill_words")
    pairs, ref_pairs = nan(n // 2 + 2, 2, dtype=np.float16), nan(n // 2 + 2, 2, dtype=np.float16)
    fill_twin.fill_qparams(ref_pairs, n // 2, 11, 0.01, 0.002, 8.0)
    run(KernelSpec("fill.cu", "fill_qparams"), 3, fill_twin.THREADS,
        (pairs, np.uint64(n // 2), np.uint64(11), np.float32(0.01), np.float32(0.002), np.float32(8)), schedule,
        source_dir)
    exact(pairs, ref_pairs, "fill_qparams")


def check_read_sum(schedule, source_dir=None):
    data = rand(np.random.default_rng(2), 1001, 4)  # 1001 16-byte vectors: the UNROLL sweep, then the tail
    out, ref = np.full(1, 0.5, np.float32), np.full(1, 0.5, np.float32)
    bandwidth_twin.read_sum(data, 1001, ref)
    run(KernelSpec("bandwidth.cu", "read_sum"), 3, 256, (data, np.uint64(1001), out), schedule, source_dir)
    assert abs(float(out[0]) - float(ref[0])) <= 1e-5 * np.abs(data).sum(), (out, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fill_and_bandwidth(schedule):
    check_fill(schedule)
    check_read_sum(schedule)
