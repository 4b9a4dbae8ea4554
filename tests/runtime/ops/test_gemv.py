"""gemv.cu: the twins against the reference's math (CPU), the kernels against the twins (GPU)."""

import numpy as np
import pytest

from cullama.runtime.ops import gemv as twin
from cullama.runtime.plan import GEMV_ROWS, GEMV_THREADS, cdiv, gemv
from cullama.model.reference import apply_rope, rmsnorm, rope_tables, silu
from tests.conftest import poisoned

EPS = 1e-5
ONE_ROW = np.zeros((1, 2), np.int32)  # a decode step's rows table: slot 0, offset 0


def rand(rng, *shape, scale=1.0, dtype=np.float16):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def qkv_case(rng, d=72, heads=3, kv_heads=1, hd=8, max_seq=11, pos=5, bias=True):
    """A q|k|v case; with `bias`, Qwen2's q|k|v bias (else zeros: a model without one)."""
    rows = (heads + 2 * kv_heads) * hd
    return dict(x=rand(rng, d, dtype=np.float32), norm_w=rand(rng, d), W=rand(rng, rows, d, scale=0.2),
                bias=rand(rng, rows) if bias else np.zeros(rows, np.float16),
                rope=np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32),
                state=np.array([pos, 0, 0, 0, 0, 0, 0, 0], np.int32), d=d, heads=heads, kv_heads=kv_heads,
                hd=hd, max_seq=max_seq)


def expected_qkv(c):
    h = rmsnorm(c["x"][None].astype(np.float32), c["norm_w"].astype(np.float32), EPS)
    y = (h @ c["W"].astype(np.float32).T)[0] + c["bias"].astype(np.float32)
    hd, nh, nkv, pos = c["hd"], c["heads"], c["kv_heads"], int(c["state"][0])
    cos, sin = rope_tables(hd, np.array([pos]), 10000.0)
    q = apply_rope(y[:nh * hd].reshape(1, nh, hd), cos, sin).reshape(-1)
    k = apply_rope(y[nh * hd:(nh + nkv) * hd].reshape(1, nkv, hd), cos, sin).reshape(nkv, hd)
    return q, k, y[(nh + nkv) * hd:].reshape(nkv, hd)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("hd,heads,kv_heads", [(8, 3, 1), (32, 4, 2), (128, 2, 2)])
def test_qkv_rope_twin_matches_reference(hd, heads, kv_heads, bias):
    c = qkv_case(np.random.default_rng(hd), d=88, heads=heads, kv_heads=kv_heads, hd=hd, bias=bias)
    q = np.full(heads * hd, np.nan, np.float32)
    k_cache = np.zeros((kv_heads, c["max_seq"], hd), np.float16)
    v_cache = np.zeros_like(k_cache)
    twin.gemv_qkv_rope(c["x"], c["norm_w"], c["W"], c["bias"], q, k_cache, v_cache, c["rope"], c["state"], ONE_ROW,
                       c["d"],
                       heads, kv_heads, hd, c["max_seq"], EPS)
    q_ref, k_ref, v_ref = expected_qkv(c)
    np.testing.assert_allclose(q, q_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(k_cache[:, 5], k_ref, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(v_cache[:, 5], v_ref, rtol=2e-3, atol=2e-3)
    assert not k_cache[:, :5].any() and not k_cache[:, 6:].any()  # only position 5 written


def test_gate_up_residual_and_logits_twins():
    rng = np.random.default_rng(1)
    d, ff, vocab = 40, 56, 37
    x, g = rand(rng, d, dtype=np.float32), rand(rng, d)
    w_gu, w_down, w_lm = rand(rng, 2 * ff, d, scale=0.2), rand(rng, d, ff, scale=0.2), rand(rng, vocab, d)
    n = rmsnorm(x[None], g.astype(np.float32), EPS)[0]
    h = np.empty(ff, np.float32)
    twin.gemv_gate_up_silu(x, g, w_gu, h, ff, d, EPS)
    gate, up = np.split(w_gu.astype(np.float32) @ n, 2)
    np.testing.assert_allclose(h, silu(gate) * up, rtol=1e-4, atol=1e-5)
    x2 = x.copy()
    twin.gemv_residual(h, w_down, x2, d, ff)
    np.testing.assert_allclose(x2, x + w_down.astype(np.float32) @ h, rtol=1e-5, atol=1e-5)
    logits = np.empty(vocab, np.float32)
    twin.gemv_logits(x, g, w_lm, logits, vocab, d, EPS)
    np.testing.assert_allclose(logits, w_lm.astype(np.float32) @ n, rtol=1e-4, atol=1e-4)


# -- GPU: every kernel against its twin, fresh random data, odd sizes, outputs poisoned ------------
@pytest.mark.gpu
@pytest.mark.parametrize("hd,heads,kv_heads,d", [(8, 8, 4, 64), (32, 5, 1, 136), (128, 32, 32, 4096),
                                                (64, 32, 8, 2048), (128, 28, 4, 3584)])  # LLaMA-3.2-1B, Qwen2.5-7B
def test_gpu_qkv_rope(kernels, hd, heads, kv_heads, d):
    import cupy as cp

    c = qkv_case(np.random.default_rng(), d=d, heads=heads, kv_heads=kv_heads, hd=hd, max_seq=40, pos=37)
    q = np.empty(heads * hd, np.float32)
    k_cache, v_cache = (np.zeros((kv_heads, 40, hd), np.float16) for _ in range(2))
    args = (c["d"], heads, kv_heads, hd, c["max_seq"], EPS)
    twin.gemv_qkv_rope(c["x"], c["norm_w"], c["W"], c["bias"], q, k_cache, v_cache, c["rope"], c["state"], ONE_ROW,
                       *args)
    dq = poisoned(cp, q.shape, np.float32)
    dk, dv = (poisoned(cp, k_cache.shape, np.float16) for _ in range(2))
    rows = (heads + 2 * kv_heads) * hd
    kernels.function(gemv("gemv_qkv_rope"))(
        (cdiv(rows // 2, GEMV_ROWS // 2),), (GEMV_THREADS,),
        (cp.asarray(c["x"]), cp.asarray(c["norm_w"]), cp.asarray(c["W"]), cp.asarray(c["bias"]), dq, dk, dv,
         cp.asarray(c["rope"]), cp.asarray(c["state"]), cp.asarray(ONE_ROW), *[np.int32(a) for a in args[:5]],
         np.float32(EPS)))
    np.testing.assert_allclose(dq.get(), q, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dk.get()[:, 37], k_cache[:, 37], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dv.get()[:, 37], v_cache[:, 37], rtol=2e-3, atol=2e-3)
    assert np.isnan(dk.get()[:, :37].astype(np.float32)).all()  # nothing else written


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(37, 72), (4096, 4096), (4096, 11008), (1001, 8)])
def test_gpu_residual(kernels, m, k):
    import cupy as cp

    rng = np.random.default_rng()
    inp, w, x = rand(rng, k, dtype=np.float32), rand(rng, m, k, scale=0.05), rand(rng, m, dtype=np.float32)
    dx = cp.asarray(x)
    kernels.function(gemv("gemv_residual"))((cdiv(m, GEMV_ROWS),), (GEMV_THREADS,),
                                           (cp.asarray(inp), cp.asarray(w), dx, np.int32(m), np.int32(k)))
    twin.gemv_residual(inp, w, x, m, k)
    np.testing.assert_allclose(dx.get(), x, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("ff,d,vocab", [(172, 64, 512), (11008, 4096, 32000), (13, 40, 1001)])
def test_gpu_gate_up_and_logits(kernels, ff, d, vocab):
    import cupy as cp

    rng = np.random.default_rng()
    x, g = rand(rng, d, dtype=np.float32), rand(rng, d)
    w_gu, w_lm = rand(rng, 2 * ff, d, scale=0.05), rand(rng, vocab, d, scale=0.05)
    h, logits = np.empty(ff, np.float32), np.empty(vocab, np.float32)
    twin.gemv_gate_up_silu(x, g, w_gu, h, ff, d, EPS)
    twin.gemv_logits(x, g, w_lm, logits, vocab, d, EPS)
    dh, dl = poisoned(cp, ff, np.float32), poisoned(cp, vocab, np.float32)
    dx, dg = cp.asarray(x), cp.asarray(g)
    kernels.function(gemv("gemv_gate_up_silu"))((cdiv(ff, GEMV_ROWS // 2),), (GEMV_THREADS,),
                                               (dx, dg, cp.asarray(w_gu), dh, np.int32(ff), np.int32(d), np.float32(EPS)))
    kernels.function(gemv("gemv_logits"))((cdiv(vocab, GEMV_ROWS),), (GEMV_THREADS,),
                                         (dx, dg, cp.asarray(w_lm), dl, np.int32(vocab), np.int32(d), np.float32(EPS)))
    np.testing.assert_allclose(dh.get(), h, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dl.get(), logits, rtol=2e-3, atol=2e-3)
