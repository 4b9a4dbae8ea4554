"""Twins of kernels_cu/gemv.cu: the decode step's matrix-vector products with their fusions.

Token rows: a kernel compiled with TOKENS = T takes x, in and its outputs as [T, width] rows (token row t of the
slot and at the position the step's rows table gives it: ops/rows.py); the plan hands the twin exactly those rows
(Ref(..., rows=T)), 1-D arrays for a decode step. Each multi-row twin is the one-row twin applied row by row (one
converted copy of W shared by the rows; each row's product its own call, as a product over several rows may sum in
another order; what is elementwise, RoPE and the K/V stores, over all rows at once), so a verify or batched step on
the numpy backend is bit for bit its plain steps, as on the GPU.
"""

from __future__ import annotations

import numpy as np

from .rows import row_positions

SOURCE = "gemv.cu"
# (ROWS, UNROLL) of a decode step (one token row): the plan's choice first; the others are the benchmark
# sweep's candidates. ROWS 8 UNROLL 2 holds 16 vectors of 8 rows: MIN_BLOCKS 5 leaves it 96 registers, which
# ptxas (NVRTC 12.9) fits on sm_80 .. sm_90 but spills 48-64 bytes of gemv_qkv_rope on sm_100 and sm_120; with
# 4 blocks an SM it spills nowhere (on sm_90 it still takes 96).
DECODE_VARIANTS = [(("ROWS", r), ("UNROLL", u)) for r, u in ((4, 4), (2, 4), (4, 2), (2, 8))]
DECODE_VARIANTS.insert(3, (("ROWS", 8), ("UNROLL", 2), ("MIN_BLOCKS", 4)))
# A verify step's k + 1 token rows, k = 1..8, as cullama.runtime.plan.gemv builds them (plan.VERIFY_GEMV_ROWS and
# VERIFY_GEMV_UNROLL; tests/runtime/test_verify.py checks that every verify plan's kernel is one of these).
VERIFY_VARIANTS = [(("ROWS", 4), ("UNROLL", 2), ("TOKENS", t)) for t in range(2, 10)]
VARIANTS = DECODE_VARIANTS + VERIFY_VARIANTS


def logits_stride(V: int) -> int:
    """The row stride of a verify step's logits [rows, V]: V rounded up to 4, so every row is 16-byte aligned
    for the sample kernel's float4 loads (kernels_cu/common.cuh logits_stride, the same rule)."""
    return -(-V // 4) * 4


def logit_rows(logits: np.ndarray, V: int, rows: int) -> np.ndarray:
    """[rows, >= V] views of a logits argument at the kernels' row stride logits_stride(V), whatever the
    array's own shape (a buffer's width is logits_stride(vocab) >= logits_stride(V)); written through."""
    if not logits.flags.c_contiguous:  # reshape would copy, and the rows written would be lost
        raise ValueError("logits must be a contiguous array (its rows are written in place)")
    flat = logits.reshape(-1)
    if rows == 1:
        return flat[None, :V]
    return flat[: rows * logits_stride(V)].reshape(rows, logits_stride(V))


def token_rows(a: np.ndarray) -> np.ndarray:
    """[T, width] rows of a twin argument: a decode step's 1-D array is one row (a view, written through)."""
    return a[None] if a.ndim == 1 else a


def _norm_dot(w32: np.ndarray, x: np.ndarray, norm32: np.ndarray, eps: float) -> np.ndarray:
    """W · rmsnorm(x) for one row x, W and the norm weight already float32: x scaled by rsqrt(mean(x^2) + eps) and
    by the norm weight, in float32."""
    x = x.astype(np.float32)
    # np.mean(x * x, dtype=np.float32)'s bits (a float32 sum, divided in float64) without its Python overhead
    mean = np.float32(float(np.add.reduce(x * x)) / x.size)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return (w32 @ (x * norm32)) * scale


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (np.float32(1.0) + np.exp(-a))


def gemv_qkv_rope(x, norm_w, W, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads, n_kv_heads, hd,
                  max_seq, eps):
    """Per token row t of x [T, d] (or [d]): q|k|v = W · rmsnorm(x[t]) + bias [(heads + 2 kv_heads) hd] f16, then
    RoPE: q_out[t] [heads*hd] f32; k_cache/v_cache [slots, kv_heads, max_seq, hd] f16 written in row t's slot at its
    position (step_rows [>= T, 2], state [slots, 8])."""
    qkv_rope(W.astype(np.float32), x, norm_w, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads,
             n_kv_heads, hd, max_seq, eps)


def gemv_residual(inp, W, x, M, K):
    """x[t, :M] += W [M, K] · in[t, :K] per token row t (1-D: one row)."""
    residual(W.astype(np.float32), inp, x, M, K)


def gemv_gate_up_silu(x, norm_w, W, h, ff, d, eps):
    """h[t, :ff] = silu(gate) * up, where gate|up = W [2 ff, d] · rmsnorm(x[t]), per token row t."""
    gate_up_silu(W.astype(np.float32), x, norm_w, h, ff, d, eps)


def gemv_logits(x, norm_w, W, logits, V, d, eps):
    """logits[t, :V] = W [V, d] · rmsnorm(x[t]) per token row t, rows at logits_stride(V)."""
    w32, norm32 = W.astype(np.float32), norm_w.astype(np.float32)
    xs = token_rows(x)
    for xt, lt in zip(xs, logit_rows(logits, V, len(xs))):
        lt[:V] = _norm_dot(w32, xt[:d], norm32, eps)


# The functions of the kernels on float32 weights w32 [M, K], whatever they are stored as (ops/gemv_quant.py
# dequantizes its weights and calls these).
def qkv_rope(w32, x, norm_w, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads, n_kv_heads, hd,
             max_seq, eps):
    b32, norm32 = bias[:w32.shape[0]].astype(np.float32), norm_w.astype(np.float32)  # [all heads * hd], [d]
    xs = token_rows(x)
    rows = len(xs)
    # Each row's product is its own call (a product over several rows may sum in another order); RoPE and the
    # stores are elementwise, so all rows go at once: each element's arithmetic is the one-row arithmetic.
    y = np.stack([_norm_dot(w32, xt[:d], norm32, eps) for xt in xs]) + b32
    y = y.reshape(rows, n_heads + 2 * n_kv_heads, hd)  # [rows, all heads, hd]
    slots, positions = row_positions(step_rows, state, rows)
    angles = rope[positions]  # [rows, hd/2, 2]: each row's cos and sin at its position
    cos, sin = angles[:, None, :, 0], angles[:, None, :, 1]
    qk = y[:, : n_heads + n_kv_heads]
    first, second = qk[..., : hd // 2].copy(), qk[..., hd // 2:].copy()
    qk[..., : hd // 2] = first * cos - second * sin
    qk[..., hd // 2:] = second * cos + first * sin
    token_rows(q_out)[:, : n_heads * hd] = y[:, :n_heads].reshape(rows, -1)
    keys, values = (c.reshape(-1, n_kv_heads, max_seq, hd) for c in (k_cache, v_cache))  # [slots, ...]
    keys[slots, :, positions] = y[:, n_heads: n_heads + n_kv_heads].astype(np.float16)  # [rows, kv_heads, hd]
    values[slots, :, positions] = y[:, n_heads + n_kv_heads:].astype(np.float16)


def residual(w32, inp, x, M, K):
    for it, xt in zip(token_rows(inp), token_rows(x)):
        xt[:M] += w32 @ it[:K].astype(np.float32)


def gate_up_silu(w32, x, norm_w, h, ff, d, eps):
    norm32 = norm_w.astype(np.float32)
    for xt, ht in zip(token_rows(x), token_rows(h)):
        y = _norm_dot(w32, xt[:d], norm32, eps)
        ht[:ff] = _silu(y[:ff]) * y[ff:]
