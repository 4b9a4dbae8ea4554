"""gemv_quant.cu: the twins against the reference's math on the dequantized weights (CPU); the kernels against the
twins, and a verify launch's token rows against one-row launches bit for bit: the check_* functions, which run on
the CPU executor in tests/runtime/emu/test_emu_quant.py (every variant and warp schedule, with seeded bugs they must
catch) and on a GPU here (`pytest -m gpu`, with the LLaMA-2-7B shapes)."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.model import quant
from cullama.runtime.ops import gemv as fp16_twin
from cullama.runtime.ops import gemv_quant as twin
from cullama.model.reference import apply_rope, rmsnorm, rope_tables, silu
from cullama.runtime.registry import KernelSpec
from tests.conftest import poisoned
from tests.runtime.test_verify import gpu_launcher, nan, state_at, verify_rows

EPS = np.float32(1e-5)

# (K, group) per BITS for the kernel checks: K a multiple of the 16-byte vector but not of 128 (a partial sweep
# of the block's threads), groups of one vector, of several, of 128 and of all of K; the last case has more
# vectors per row than a thread's first batch holds (K = 4128: 129 INT4 vectors; 4112: 257 INT8 vectors).
CASES = {4: [(160, 32), (192, 64), (384, 128), (4128, 4128)],
         8: [(80, 16), (144, 48), (384, 128), (4112, 4112)]}


def rand(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def quantized(rng, M, K, bits, group, size=0.05):
    """(qweight, qparams) of a random [M, K] weight of about `size`: uniform codes, zeros anywhere in 0 .. 2**bits
    (both ends present), scales of both signs and never 0."""
    top = 1 << bits
    codes = rng.integers(0, top, (M, K), dtype=np.uint8)  # uint8: the 7B shapes stay small on the host
    zeros = rng.integers(0, top + 1, (M, K // group))
    zeros.flat[0], zeros.flat[-1] = 0, top
    scales = size * 2 / top * rng.choice([-1.0, 1.0], zeros.shape) * (0.5 + rng.random(zeros.shape))
    return quant.pack(codes, bits), quant.params(scales, zeros)


def spec(name: str, defines) -> KernelSpec:
    return KernelSpec(twin.SOURCE, name, tuple(defines))


def close(out, ref, rel, what):
    """Within `rel` of the largest |ref| (at least 1): float32 sums in another order than the twin's BLAS, and
    the group's scale applied per 16-byte vector rather than per weight; FP16 outputs a rounding apart."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), f"{what}: {int((~np.isfinite(out)).sum())} elements not finite (unwritten?)"
    err = np.abs(out - ref).max(initial=0)
    assert err <= rel * max(1.0, np.abs(ref).max(initial=0)), f"{what}: off by {err}"


def exact(out, ref, what):
    """Bit for bit, NaN poison included."""
    out, ref = np.asarray(out), np.asarray(ref)
    bits = {2: np.uint16, 4: np.uint32}[out.dtype.itemsize]
    same = out.view(bits) == ref.view(bits)
    assert same.all(), f"{what}: {int((~same).sum())} of {same.size} elements differ"


# -- one launch of each kernel -----------------------------------------------------------------------------------
def run_qkv(launch, defines, x, norm_w, qw, qp, bias, rope, pos, heads, kv_heads, hd, max_seq, group):
    """gemv_qkv_rope (with a q|k|v bias, FP16 beside the codes as AWQ and GPTQ keep Qwen2's) on token rows x [T, d]
    (T = the defines' TOKENS): (q [T, heads hd], k_cache, v_cache), all
    NaN before the launch (q's rows at a stride of heads hd: no room for a guard; the caches are checked outside
    the positions written)."""
    T, d = x.shape
    q = nan(T, heads * hd)
    caches = [nan(kv_heads, max_seq, hd, dtype=np.float16) for _ in range(2)]
    pairs = (heads + 2 * kv_heads) * hd // 2
    launch(spec("gemv_qkv_rope", defines), (-(-pairs // (dict(defines)["ROWS"] // 2)),), twin.THREADS,
           (x, norm_w, qw, qp, bias, q, *caches, rope, state_at(pos), verify_rows(T), np.int32(d), np.int32(heads),
            np.int32(kv_heads), np.int32(hd), np.int32(max_seq), EPS, np.int32(group)))
    return q, caches[0], caches[1]


GUARD = np.array([1.5, -2.5, 3.5], np.float32)  # past a one-row output: must stay as it is


def output_rows(start: np.ndarray) -> np.ndarray:
    """The output buffer a launch writes, from its rows start [T, width]: one row is 1-D with GUARD after it (the
    twins read a 1-D array as one row and leave the rest alone); T > 1 rows are [T, width] (the rows at a stride
    of width, as the kernels write them and the twins read them)."""
    return np.concatenate([start[0], GUARD]) if start.shape[0] == 1 else start.copy()


def written_rows(out: np.ndarray, T: int, width: int, what: str) -> np.ndarray:
    """The rows [T, width] of an output_rows buffer, its guard checked untouched."""
    if T == 1:
        exact(out[width:], GUARD, f"{what} past its row")
    return out[:T * width].reshape(T, width)


def run_residual(launch, defines, inp, qw, qp, x0, group):
    """gemv_residual: x = x0 [T, M] + W [M, K] · inp [T, K]; returns x [T, M]."""
    T, K = inp.shape
    M = qw.shape[0]
    x = output_rows(x0)
    launch(spec("gemv_residual", defines), (-(-M // dict(defines)["ROWS"]),), twin.THREADS,
           (inp, qw, qp, x, np.int32(M), np.int32(K), np.int32(group)))
    return written_rows(x, T, M, "gemv_residual")


def run_gate_up(launch, defines, x, norm_w, qw, qp, ff, group):
    """gemv_gate_up_silu on x [T, d]: h [T, ff], from a NaN buffer."""
    T, d = x.shape
    h = output_rows(nan(T, ff))
    launch(spec("gemv_gate_up_silu", defines), (-(-ff // (dict(defines)["ROWS"] // 2)),), twin.THREADS,
           (x, norm_w, qw, qp, h, np.int32(ff), np.int32(d), EPS, np.int32(group)))
    return written_rows(h, T, ff, "gemv_gate_up_silu")


# -- the kernels against their twins ---------------------------------------------------------------------------
def check_gemv_quant(launch, defines, cases=None, seed=0):
    """Each kernel of a decode variant (TOKENS 1) against its twin on every (K, group) case of its BITS: within
    float32 rounding, FP16 caches within a rounding; exact: nothing written outside the rows, positions and token
    rows the launch owns. Odd sizes: 3 q heads, 1 kv head, hd 6 (15 RoPE pairs: a partial last block), M = 37,
    ff = 13."""
    bits = dict(defines)["BITS"]
    for K, group in cases or CASES[bits]:
        rng = np.random.default_rng(seed + K + group)
        where = f"{' '.join(f'{k}={v}' for k, v in defines)} K={K} group={group}"
        heads, kv_heads, hd, pos = 3, 1, 6, 5
        max_seq = pos + 3
        x, norm_w = rand(rng, 1, K), rand(rng, K, dtype=np.float16)
        qw, qp = quantized(rng, (heads + 2 * kv_heads) * hd, K, bits, group)
        bias = rand(rng, (heads + 2 * kv_heads) * hd, dtype=np.float16)
        rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
        q, kc, vc = run_qkv(launch, defines, x, norm_w, qw, qp, bias, rope, pos, heads, kv_heads, hd, max_seq, group)
        rq, rk, rv = nan(1, heads * hd), nan(kv_heads, max_seq, hd, dtype=np.float16), \
            nan(kv_heads, max_seq, hd, dtype=np.float16)
        twin.gemv_qkv_rope(x, norm_w, qw, qp, bias, rq, rk, rv, rope, state_at(pos), verify_rows(1), K, heads,
                           kv_heads, hd, max_seq, EPS, group)
        close(q, rq, 2e-5, f"gemv_qkv_rope q, {where}")
        close(kc[:, pos], rk[:, pos], 2e-3, f"gemv_qkv_rope k, {where}")
        close(vc[:, pos], rv[:, pos], 2e-3, f"gemv_qkv_rope v, {where}")
        exact(np.delete(kc, pos, axis=1), np.delete(rk, pos, axis=1), f"k_cache outside the position, {where}")
        exact(np.delete(vc, pos, axis=1), np.delete(rv, pos, axis=1), f"v_cache outside the position, {where}")

        M = 37
        inp, x0 = rand(rng, 1, K), rand(rng, 1, M)
        qw, qp = quantized(rng, M, K, bits, group)
        out = run_residual(launch, defines, inp, qw, qp, x0, group)
        ref = x0.copy()
        twin.gemv_residual(inp, qw, qp, ref, M, K, group)
        close(out, ref, 2e-5, f"gemv_residual, {where}")

        ff = 13
        qw, qp = quantized(rng, 2 * ff, K, bits, group)
        h = run_gate_up(launch, defines, x, norm_w, qw, qp, ff, group)
        rh = nan(1, ff)
        twin.gemv_gate_up_silu(x, norm_w, qw, qp, rh, ff, K, EPS, group)
        close(h, rh, 2e-5, f"gemv_gate_up_silu, {where}")


# -- verify rows: row t of a TOKENS launch is the one-row launch at pos + t ------------------------------------
def check_gemv_quant_rows(launch, bits, rows, K=192, group=64, heads=3, kv_heads=1, hd=6, M=37, ff=13, pos=5,
                          seed=0):
    """Each kernel with the verify defines for `rows` token rows against `rows` launches of the decode defines at
    the rows' positions: the same bits (outputs poisoned); and close to the twin."""
    rng = np.random.default_rng(seed)
    many, one = twin.defines(bits, rows), twin.defines(bits, 1)
    max_seq = pos + rows + 2
    x, norm_w, inp = rand(rng, rows, K), rand(rng, K, dtype=np.float16), rand(rng, rows, K)
    x0 = rand(rng, rows, M)
    w_qkv = (*quantized(rng, (heads + 2 * kv_heads) * hd, K, bits, group),
             rand(rng, (heads + 2 * kv_heads) * hd, dtype=np.float16))  # codes, (scale, zero)s, the q|k|v bias
    w_res, w_gu = quantized(rng, M, K, bits, group), quantized(rng, 2 * ff, K, bits, group)
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)

    def run(defines, sl, at):
        q, kc, vc = run_qkv(launch, defines, x[sl].copy(), norm_w, *w_qkv, rope, at, heads, kv_heads, hd, max_seq,
                            group)
        n = q.shape[0]
        return {"q": q, "k": kc[:, at:at + n], "v": vc[:, at:at + n],
                "residual": run_residual(launch, defines, inp[sl].copy(), *w_res, x0[sl].copy(), group),
                "h": run_gate_up(launch, defines, x[sl].copy(), norm_w, *w_gu, ff, group)}

    together = run(many, slice(None), pos)
    for t in range(rows):
        for name, value in run(one, slice(t, t + 1), pos + t).items():
            row = together[name][:, t:t + 1] if name in ("k", "v") else together[name][t:t + 1]
            exact(row, value, f"{bits}-bit {name}, row {t} of {rows}")
    rq = nan(rows, heads * hd)
    caches = [nan(kv_heads, max_seq, hd, dtype=np.float16) for _ in range(2)]
    twin.gemv_qkv_rope(x, norm_w, *w_qkv, rq, *caches, rope, state_at(pos), verify_rows(rows), K, heads, kv_heads, hd,
                       max_seq, EPS, group)
    close(together["q"], rq, 2e-5, "verify q against the twin")  # and right, not only consistent
    rh = nan(rows, ff)
    twin.gemv_gate_up_silu(x, norm_w, *w_gu, rh, ff, K, EPS, group)
    close(together["h"], rh, 2e-5, "verify h against the twin")


# -- CPU: the twins are the FP16 kernels' functions on quant.py's exact weights ---------------------------------
@pytest.mark.parametrize("bits", quant.BITS)
def test_twins_match_the_reference_on_the_dequantized_weights(bits):
    rng = np.random.default_rng(bits)
    d, heads, kv_heads, hd, ff, pos = 96, 2, 1, 16, 24, 3
    group = 32
    x, norm_w = rand(rng, d), rand(rng, d, dtype=np.float16)
    n = rmsnorm(x[None], norm_w.astype(np.float32), EPS)[0]
    qkv = quantized(rng, (heads + 2 * kv_heads) * hd, d, bits, group)
    w = quant.dequantize(*qkv, bits)
    np.testing.assert_array_equal(twin.weights(*qkv, d), w)  # the bits read off the shapes
    rope = np.stack(rope_tables(hd, np.arange(pos + 1), 10000.0), -1).astype(np.float32)
    q = np.full(heads * hd, np.nan, np.float32)
    caches = [np.zeros((kv_heads, pos + 1, hd), np.float16) for _ in range(2)]
    bias = rand(rng, (heads + 2 * kv_heads) * hd, dtype=np.float16)
    twin.gemv_qkv_rope(x, norm_w, *qkv, bias, q, *caches, rope, state_at(pos), verify_rows(1), d, heads, kv_heads, hd,
                       pos + 1, EPS, group)
    y = w @ n + bias.astype(np.float32)
    cos, sin = rope_tables(hd, np.array([pos]), 10000.0)
    np.testing.assert_allclose(q, apply_rope(y[:heads * hd].reshape(1, heads, hd), cos, sin).reshape(-1),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(caches[1][:, pos], y[(heads + kv_heads) * hd:].reshape(kv_heads, hd), rtol=2e-3,
                               atol=2e-3)
    assert not caches[0][:, :pos].any()
    res = quantized(rng, 40, d, bits, d)  # one group per row
    x2 = rand(rng, 40)
    out = x2.copy()
    twin.gemv_residual(x, *res, out, 40, d, d)
    np.testing.assert_allclose(out, x2 + quant.dequantize(*res, bits) @ x, rtol=1e-5, atol=1e-5)
    gu = quantized(rng, 2 * ff, d, bits, group)
    h = np.full(ff, np.nan, np.float32)
    twin.gemv_gate_up_silu(x, norm_w, *gu, h, ff, d, EPS, group)
    gate, up = np.split(quant.dequantize(*gu, bits) @ n, 2)
    np.testing.assert_allclose(h, silu(gate) * up, rtol=1e-4, atol=1e-5)


def test_twin_rows_are_one_row_launches():
    """As ops/gemv.py's: each of T token rows is the one-row twin on that row (the verify contract's spec)."""
    rng = np.random.default_rng(0)
    K, M, group, T = 64, 9, 32, 3
    qw, qp = quantized(rng, M, K, 4, group)
    inp, x = rand(rng, T, K), rand(rng, T, M)
    together = x.copy()
    twin.gemv_residual(inp, qw, qp, together, M, K, group)
    for t in range(T):
        one = x[t].copy()
        twin.gemv_residual(inp[t].copy(), qw, qp, one, M, K, group)
        np.testing.assert_array_equal(together[t], one)


def test_defines_and_rows_per_block_are_the_plans_contract():
    for bits in quant.BITS:
        for tokens in range(1, twin.MAX_TOKENS + 1):
            defines = twin.defines(bits, tokens)
            assert dict(defines)["BITS"] == bits and dict(defines).get("TOKENS", 1) == tokens
            assert twin.rows_per_block(bits, tokens) % 2 == 0
            assert defines in twin.VARIANTS  # CI compiles every launch a plan can make
    assert len(set(twin.VARIANTS)) == len(twin.VARIANTS)
    assert all(v[0][0] == "BITS" for v in twin.VARIANTS)


def test_fp16_and_quantized_twins_agree_on_fp16_representable_weights():
    """8-bit codes with scale 2**-7 and zero 128 are FP16 weights exactly: the two twins then give the same bits."""
    rng = np.random.default_rng(1)
    K, M = 48, 10
    codes = rng.integers(0, 256, (M, K))
    qw, qp = quant.pack(codes, 8), quant.params(np.full((M, 1), 2.0**-7), np.full((M, 1), 128))
    w16 = ((codes - 128) * 2.0**-7).astype(np.float16)
    inp, x = rand(rng, K), rand(rng, M)
    a, b = x.copy(), x.copy()
    twin.gemv_residual(inp, qw, qp, a, M, K, K)
    fp16_twin.gemv_residual(inp, w16, b, M, K)
    np.testing.assert_array_equal(a, b)


# -- GPU: the kernels against the twins, and the rows bit for bit ----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("defines", twin.DECODE_VARIANTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d))
def test_gpu_kernels_match_their_twins(kernels, defines):
    check_gemv_quant(gpu_launcher(kernels), defines, seed=int(np.random.default_rng().integers(1 << 20)))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("rows", [2, 5, 9])
def test_gpu_verify_rows_are_one_row_launches(kernels, bits, rows):
    check_gemv_quant_rows(gpu_launcher(kernels), bits, rows, seed=rows)
    check_gemv_quant_rows(gpu_launcher(kernels), bits, rows, K=4096 + 2 * quant.VECTOR[bits], group=K_GROUP[bits],
                          seed=rows)


K_GROUP = {4: 32, 8: 16}  # a group of one vector: K = 4096 + 2 vectors has no larger one in common with 128


@pytest.mark.gpu
@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("kernel,M,K", [("qkv", 12288, 4096), ("o_proj", 4096, 4096), ("gate_up", 22016, 4096),
                                        ("down", 4096, 11008)])
def test_gpu_llama2_7b_shapes(kernels, bits, kernel, M, K):
    """The 7B matrices with on-load quantization's groups (128 for INT4, per channel for INT8), against the twin."""
    import cupy as cp

    rng = np.random.default_rng()
    group = 128 if bits == 4 else K
    qw, qp = quantized(rng, M, K, bits, group, size=0.02)
    defines = twin.defines(bits)
    rows = twin.rows_per_block(bits)
    x, norm_w = rand(rng, K), (1 + 0.1 * rng.standard_normal(K)).astype(np.float16)
    dev = lambda a: cp.asarray(a)  # noqa: E731
    if kernel == "qkv":
        heads, hd, max_seq, pos = 32, 128, 40, 37
        rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
        q, caches = np.empty(heads * hd, np.float32), [np.zeros((heads, max_seq, hd), np.float16) for _ in range(2)]
        args = (K, heads, heads, hd, max_seq, EPS)
        bias = rand(rng, M, dtype=np.float16)
        twin.gemv_qkv_rope(x, norm_w, qw, qp, bias, q, *caches, rope, state_at(pos), verify_rows(1), *args, group)
        dq = poisoned(cp, q.shape, np.float32)
        dk, dv = (poisoned(cp, caches[0].shape, np.float16) for _ in range(2))
        kernels.function(spec("gemv_qkv_rope", defines))(
            (-(-M // rows),), (twin.THREADS,),
            (dev(x), dev(norm_w), dev(qw), dev(qp), dev(bias), dq, dk, dv, dev(rope), dev(state_at(pos)),
             dev(verify_rows(1)),
             *[np.int32(a) for a in args[:5]], EPS, np.int32(group)))
        np.testing.assert_allclose(dq.get(), q, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(dk.get()[:, pos], caches[0][:, pos], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(dv.get()[:, pos], caches[1][:, pos], rtol=2e-3, atol=2e-3)
        assert np.isnan(dk.get()[:, :pos].astype(np.float32)).all()
    elif kernel == "gate_up":
        ff = M // 2
        h = np.empty(ff, np.float32)
        twin.gemv_gate_up_silu(x, norm_w, qw, qp, h, ff, K, EPS, group)
        dh = poisoned(cp, ff, np.float32)
        kernels.function(spec("gemv_gate_up_silu", defines))(
            (-(-ff // (rows // 2)),), (twin.THREADS,),
            (dev(x), dev(norm_w), dev(qw), dev(qp), dh, np.int32(ff), np.int32(K), EPS, np.int32(group)))
        np.testing.assert_allclose(dh.get(), h, rtol=2e-3, atol=2e-3)
    else:
        out = rand(rng, M)
        dx = dev(out)
        kernels.function(spec("gemv_residual", defines))(
            (-(-M // rows),), (twin.THREADS,),
            (dev(x), dev(qw), dev(qp), dx, np.int32(M), np.int32(K), np.int32(group)))
        twin.gemv_residual(x, qw, qp, out, M, K, group)
        np.testing.assert_allclose(dx.get(), out, rtol=1e-3, atol=1e-3)
