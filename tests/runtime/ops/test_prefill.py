"""prefill.cu: the row twins against the reference's math (CPU), the kernels against the twins (GPU)."""

import numpy as np
import pytest

from cullama.runtime.ops import prefill as twin
from cullama.runtime.ops import prepare as prepare_twin
from cullama.runtime.plan import ROW_THREADS, prefill
from cullama.model.reference import apply_rope, rmsnorm, rope_tables, silu
from cullama.runtime.registry import compile_module
from tests.conftest import poisoned

EPS = 1e-5
CHUNK = 13  # rows in the buffers; the launches use n < CHUNK of them


def rand(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def rope_buffer(hd, max_seq):
    """[max_seq, hd/2, (cos, sin)] float32, as plan.rope_table builds it."""
    return np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), axis=-1).astype(np.float32)


def nan(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


def test_embed_rows_gathers_and_upcasts():
    rng = np.random.default_rng(0)
    embed, ids = rand(rng, 50, 72, dtype=np.float16), np.array([7, 0, 49, 7, 3] + [99] * (CHUNK - 5), np.int32)
    x = nan(CHUNK, 72)
    twin.embed_rows(ids, embed, x, 72, 50, grid=(5, 1, 1))
    np.testing.assert_array_equal(x[:5], embed[ids[:5]].astype(np.float32))
    assert np.isnan(x[5:]).all()  # rows past the grid untouched (ids there are out of range on purpose)


# Ids the gather must not follow: below 0, the vocabulary's size, and the int32 extremes (an unchecked one would
# read up to 2^31 rows away).
BAD_IDS = [-1, 50, 2**31 - 1, -2**31, 51]


def test_embed_rows_makes_a_row_of_an_id_outside_the_vocabulary_nan():
    rng = np.random.default_rng(1)
    embed = rand(rng, 50, 16, dtype=np.float16)
    ids = np.array([3] + BAD_IDS + [49], np.int32)
    x = np.zeros((len(ids), 16), np.float32)
    twin.embed_rows(ids, embed, x, 16, 50, grid=(len(ids), 1, 1))
    np.testing.assert_array_equal(x[[0, -1]], embed[[3, 49]].astype(np.float32))
    assert np.isnan(x[1:-1]).all()


@pytest.mark.parametrize("d", [72, 8, 4104])  # 4104: a last Σ x² part of 8 elements
def test_embed_rows_prepared_writes_x_and_its_prepared_input(d):
    """embed_rows' rows, and each one's RMSNorm input for the next qkv as gemv_residual would prepare it: xn =
    fp16(x * norm_w) (norm_w's FP16 widened, the product rounded to FP32, then to FP16) and Σ x² in fmaf chains of
    SS_SPAN elements (from +0, in order), bit for bit; a NaN row (an id outside the vocabulary) NaN throughout; rows
    past the grid untouched."""
    rng = np.random.default_rng(d)
    vocab, span = 50, prepare_twin.SS_SPAN
    embed, norm_w = rand(rng, vocab, d, dtype=np.float16), rand(rng, d, dtype=np.float16)
    ids = np.array([7, -1, 49, 7] + [99] * (CHUNK - 4), np.int32)
    parts = -(-d // span)
    x, xn, ssp = nan(CHUNK, d), nan(CHUNK, d, dtype=np.float16), nan(CHUNK, parts)
    twin.embed_rows_prepared(ids, embed, norm_w, x, xn, ssp, d, vocab, grid=(4, 1, 1))
    plain = nan(CHUNK, d)
    twin.embed_rows(ids, embed, plain, d, vocab, grid=(4, 1, 1))
    np.testing.assert_array_equal(x, plain)
    for r in (0, 2, 3):
        e = embed[ids[r]].astype(np.float32)
        np.testing.assert_array_equal(xn[r], (e * norm_w.astype(np.float32)).astype(np.float16))
        for p in range(parts):  # one float32 fma at a time
            ss = np.float32(0)
            for v in e[p * span:(p + 1) * span]:
                ss = np.float32(np.float64(v) * np.float64(v) + np.float64(ss))  # v² is exact in double
            assert ssp[r, p] == ss, (r, p)
    assert np.isnan(xn[1].astype(np.float32)).all() and np.isnan(ssp[1]).all()
    assert np.isnan(x[4:]).all() and np.isnan(xn[4:].astype(np.float32)).all() and np.isnan(ssp[4:]).all()


@pytest.mark.parametrize("d", [72, 8, 4096])
def test_rmsnorm_rows_matches_reference(d):
    rng = np.random.default_rng(d)
    x, w = rand(rng, CHUNK, d, scale=3.0), rand(rng, d, dtype=np.float16)
    out = nan(CHUNK, d, dtype=np.float16)
    twin.rmsnorm_rows(x, w, out, d, EPS, grid=(9, 1, 1))
    ref = rmsnorm(x[:9], w.astype(np.float32), EPS)
    np.testing.assert_allclose(out[:9].astype(np.float32), ref, rtol=1e-3, atol=1e-3)
    assert np.isnan(out[9:].astype(np.float32)).all()


@pytest.mark.parametrize("hd,heads,kv_heads", [(8, 3, 1), (32, 4, 2), (128, 2, 2)])
def test_rope_kv_rows_matches_reference(hd, heads, kv_heads):
    rng = np.random.default_rng(hd)
    n, start, max_seq, q_dim, kv_dim = 6, 4, 12, heads * hd, kv_heads * hd
    qkv, rope = rand(rng, CHUNK, q_dim + 2 * kv_dim), rope_buffer(hd, max_seq)
    bias = rand(rng, q_dim + 2 * kv_dim, dtype=np.float16)  # Qwen2's q|k|v bias, added before RoPE
    q_rows = nan(CHUNK, q_dim, dtype=np.float16)
    k_cache, v_cache = nan(kv_heads, max_seq, hd, dtype=np.float16), nan(kv_heads, max_seq, hd, dtype=np.float16)
    twin.rope_kv_rows(qkv, bias, rope, q_rows, k_cache, v_cache, start, heads, kv_heads, hd, max_seq, grid=(n, 1, 1))
    cos, sin = rope_tables(hd, np.arange(start, start + n), 10000.0)
    y = qkv[:n] + bias.astype(np.float32)
    q = apply_rope(y[:, :q_dim].reshape(n, heads, hd), cos, sin).reshape(n, q_dim)
    k = apply_rope(y[:, q_dim:q_dim + kv_dim].reshape(n, kv_heads, hd), cos, sin)
    v = y[:, q_dim + kv_dim:].reshape(n, kv_heads, hd)
    tol = dict(rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(q_rows[:n].astype(np.float32), q, **tol)
    np.testing.assert_allclose(k_cache[:, start:start + n].astype(np.float32), k.transpose(1, 0, 2), **tol)
    np.testing.assert_allclose(v_cache[:, start:start + n].astype(np.float32), v.transpose(1, 0, 2), **tol)
    assert np.isnan(q_rows[n:].astype(np.float32)).all()
    for cache in (k_cache, v_cache):  # only positions start..start+n-1 written
        assert np.isnan(cache[:, :start].astype(np.float32)).all()
        assert np.isnan(cache[:, start + n:].astype(np.float32)).all()


def test_silu_mul_rows_matches_reference():
    rng = np.random.default_rng(3)
    ff = 40
    gu, h = rand(rng, CHUNK, 2 * ff, scale=4.0), nan(CHUNK, ff, dtype=np.float16)
    twin.silu_mul_rows(gu, h, ff, grid=(11, 1, 1))
    ref = silu(gu[:11, :ff]) * gu[:11, ff:]
    np.testing.assert_allclose(h[:11].astype(np.float32), ref, rtol=1e-3, atol=1e-3)
    assert np.isnan(h[11:].astype(np.float32)).all()


def test_compiles_for_sm90_without_spills():
    resources = compile_module(twin.SOURCE, (), "sm_90").resources
    assert set(resources) == {"embed_rows", "embed_rows_prepared", "rmsnorm_rows", "rope_kv_rows", "silu_mul_rows"}
    for name, res in resources.items():
        assert not res.spills, (name, res)


# -- GPU: every kernel against its twin, fresh random data, outputs poisoned -----------------------
def launch(kernels, cp, name, n, *args):
    """One block per row, as plan.prefill_plan's `rows(...)` launches; numbers as int32 / float32."""
    conv = [np.int32(a) if isinstance(a, int) else np.float32(a) if isinstance(a, float) else a for a in args]
    kernels.function(prefill(name))((n, 1, 1), (ROW_THREADS,), tuple(conv))
    cp.cuda.runtime.deviceSynchronize()


def check(device, host, **tol):
    """NaN where the twin left the poison, close elsewhere (assert_allclose matches NaN to NaN)."""
    np.testing.assert_allclose(device.get().astype(np.float32), host.astype(np.float32), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("n,d", [(1, 72), (13, 72), (7, 4096), (256, 4096), (5, 8200)])
def test_gpu_embed_and_rmsnorm_rows(kernels, n, d):
    import cupy as cp

    rng = np.random.default_rng()
    chunk, vocab = n + 2, 37
    ids = rng.integers(0, vocab, chunk).astype(np.int32)
    embed, w = rand(rng, vocab, d, dtype=np.float16), rand(rng, d, dtype=np.float16)
    x, xn = nan(chunk, d), nan(chunk, d, dtype=np.float16)
    ids[n // 2] = [-1, vocab, 2**31 - 1][n % 3]  # one row's id outside the vocabulary: NaN, nothing read for it
    twin.embed_rows(ids, embed, x, d, vocab, grid=(n, 1, 1))
    twin.rmsnorm_rows(x, w, xn, d, EPS, grid=(n, 1, 1))
    dx, dxn = poisoned(cp, x.shape, np.float32), poisoned(cp, xn.shape, np.float16)
    launch(kernels, cp, "embed_rows", n, cp.asarray(ids), cp.asarray(embed), dx, d, vocab)
    check(dx, x, rtol=0, atol=0)
    launch(kernels, cp, "rmsnorm_rows", n, dx, cp.asarray(w), dxn, d, EPS)
    check(dxn, xn, rtol=2e-3, atol=2e-3)
    # the decode-step form: the same x, and its prepared input as the twin's, bit for bit
    parts = -(-d // prepare_twin.SS_SPAN)
    px, pxn, pss = nan(chunk, d), nan(chunk, d, dtype=np.float16), nan(chunk, parts)
    twin.embed_rows_prepared(ids, embed, w, px, pxn, pss, d, vocab, grid=(n, 1, 1))
    dev = (poisoned(cp, px.shape, np.float32), poisoned(cp, pxn.shape, np.float16), poisoned(cp, pss.shape, np.float32))
    launch(kernels, cp, "embed_rows_prepared", n, cp.asarray(ids), cp.asarray(embed), cp.asarray(w), *dev, d, vocab)
    for got, want in zip(dev, (px, pxn, pss)):
        check(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,heads,kv_heads,n,start", [(8, 3, 1, 5, 0), (32, 8, 2, 17, 9), (64, 6, 6, 1, 30),
                                                        (128, 32, 32, 256, 100), (128, 32, 8, 33, 0),
                                                        (128, 28, 4, 70, 3)])
def test_gpu_rope_kv_rows(kernels, hd, heads, kv_heads, n, start):
    import cupy as cp

    rng = np.random.default_rng()
    max_seq, chunk, q_dim = start + n + 3, n + 2, heads * hd
    qkv, rope = rand(rng, chunk, (heads + 2 * kv_heads) * hd), rope_buffer(hd, start + n + 3)
    bias = rand(rng, (heads + 2 * kv_heads) * hd, dtype=np.float16)
    q_rows = nan(chunk, q_dim, dtype=np.float16)
    k_cache, v_cache = nan(kv_heads, max_seq, hd, dtype=np.float16), nan(kv_heads, max_seq, hd, dtype=np.float16)
    args = (start, heads, kv_heads, hd, max_seq)
    twin.rope_kv_rows(qkv, bias, rope, q_rows, k_cache, v_cache, *args, grid=(n, 1, 1))
    dq = poisoned(cp, q_rows.shape, np.float16)
    dk, dv = poisoned(cp, k_cache.shape, np.float16), poisoned(cp, v_cache.shape, np.float16)
    launch(kernels, cp, "rope_kv_rows", n, cp.asarray(qkv), cp.asarray(bias), cp.asarray(rope), dq, dk, dv, *args)
    for device, host in ((dq, q_rows), (dk, k_cache), (dv, v_cache)):
        check(device, host, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n,ff", [(1, 8), (9, 40), (256, 11008)])
def test_gpu_silu_mul_rows(kernels, n, ff):
    import cupy as cp

    rng = np.random.default_rng()
    gu, h = rand(rng, n + 2, 2 * ff, scale=4.0), nan(n + 2, ff, dtype=np.float16)
    twin.silu_mul_rows(gu, h, ff, grid=(n, 1, 1))
    dh = poisoned(cp, h.shape, np.float16)
    launch(kernels, cp, "silu_mul_rows", n, cp.asarray(gu), dh, ff)
    check(dh, h, rtol=2e-3, atol=2e-3)
