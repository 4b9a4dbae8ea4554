"""Twins of kernels_cu/gemv.cu: the decode step's matrix-vector products with their fusions."""

from __future__ import annotations

import numpy as np

SOURCE = "gemv.cu"
# (ROWS, UNROLL): the plan's choice first; the others are the benchmark sweep's candidates.
VARIANTS = [(("ROWS", r), ("UNROLL", u)) for r, u in ((4, 4), (2, 4), (4, 2), (8, 2), (2, 8))]


def _norm_dot(w: np.ndarray, x: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """W · rmsnorm(x): x scaled by rsqrt(mean(x^2) + eps) and by the norm weight, in float32."""
    x = x.astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(np.mean(x * x, dtype=np.float32) + np.float32(eps))
    return (w.astype(np.float32) @ (x * norm_w.astype(np.float32))) * scale


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (np.float32(1.0) + np.exp(-a))


def gemv_qkv_rope(x, norm_w, W, q_out, k_cache, v_cache, rope, state, d, n_heads, n_kv_heads, hd, max_seq, eps):
    """q_out [heads*hd] f32; k_cache/v_cache [kv_heads, max_seq, hd] f16 written at state[0] (pos)."""
    pos = int(state[0])
    y = _norm_dot(W, x[:d], norm_w, eps).reshape(n_heads + 2 * n_kv_heads, hd)  # [all heads, hd]
    cos, sin = rope[pos, :, 0], rope[pos, :, 1]  # [hd/2]
    qk = y[: n_heads + n_kv_heads]
    first, second = qk[:, : hd // 2].copy(), qk[:, hd // 2:].copy()
    qk[:, : hd // 2] = first * cos - second * sin
    qk[:, hd // 2:] = second * cos + first * sin
    q_out[: n_heads * hd] = y[:n_heads].reshape(-1)
    k_cache[:, pos] = y[n_heads: n_heads + n_kv_heads].astype(np.float16)
    v_cache[:, pos] = y[n_heads + n_kv_heads:].astype(np.float16)


def gemv_residual(inp, W, x, M, K):
    """x[:M] += W [M, K] · in[:K]."""
    x[:M] += W.astype(np.float32) @ inp[:K].astype(np.float32)


def gemv_gate_up_silu(x, norm_w, W, h, ff, d, eps):
    """h[:ff] = silu(gate) * up, where gate|up = W [2 ff, d] · rmsnorm(x)."""
    y = _norm_dot(W, x[:d], norm_w, eps)
    h[:ff] = _silu(y[:ff]) * y[ff:]


def gemv_logits(x, norm_w, W, logits, V, d, eps):
    logits[:V] = _norm_dot(W, x[:d], norm_w, eps)
