"""Twins of kernels_cu/prefill.cu: the prompt path's row-wise glue, one CUDA block per token row.

Row count: a row-wise launch processes as many rows as its grid has blocks (grid = (n, 1, 1)); no
kernel argument says n. The NumPy backend therefore passes the launch grid to a twin as the keyword
`grid` (a tuple of 3) whenever the twin declares a keyword-only `grid` parameter, and these twins
read n = grid[0]. Buffers are the plan's: [chunk, ...] row buffers of which rows [:n] are used; rows
n and beyond are left untouched, as on the GPU.
"""

from __future__ import annotations

import numpy as np

from .prepare import write_prepared

SOURCE = "prefill.cu"
VARIANTS = [()]
QUIET_NAN = np.uint32(0x7FFFFFFF).view(np.float32)  # common.cuh QUIET_NAN, the bits the kernel writes


def embed_rows(ids, embed, x_rows, d, vocab, *, grid):
    """x_rows[:n, :d] = float32(embed[ids[:n]]); ids [chunk] int32, embed [vocab, d] FP16; a row whose id is outside
    [0, vocab) is NaN (the kernel bounds its gather)."""
    n = grid[0]
    rows = x_rows.reshape(-1, x_rows.shape[-1])  # x [d]: one row
    picked = np.asarray(ids[:n]).astype(np.int64)
    inside = (picked >= 0) & (picked < int(vocab))
    rows[:n, :d] = embed[np.where(inside, picked, 0), :d].astype(np.float32)
    rows[:n, :d][~inside] = QUIET_NAN


def embed_rows_prepared(ids, embed, norm_w, x_rows, xn_rows, ssp_rows, d, vocab, *, grid):
    """embed_rows, and each row's prepared RMSNorm input with norm_w (ops/prepare.py): xn_rows [chunk, d] f16,
    ssp_rows [chunk, ceil(d / SS_SPAN)] f32 (NaN rows: NaN)."""
    n = grid[0]
    embed_rows(ids, embed, x_rows, d, vocab, grid=grid)
    rows = x_rows.reshape(-1, x_rows.shape[-1])
    write_prepared(rows[:n], norm_w, xn_rows.reshape(len(rows), -1)[:n], ssp_rows.reshape(len(rows), -1)[:n], int(d))


def rmsnorm_rows(x_rows, w, out_rows, d, eps, *, grid):
    """out_rows[:n] = fp16((x * rsqrt(mean(x^2) + eps)) * w) per row; x_rows [chunk, d] f32, w [d] FP16."""
    n = grid[0]
    x = x_rows[:n, :d].astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=1, keepdims=True, dtype=np.float32) + np.float32(eps))
    out_rows[:n, :d] = ((x * scale) * w[:d].astype(np.float32)).astype(np.float16)


def rope_kv_rows(qkv_rows, bias, rope, q_rows, k_cache, v_cache, start, n_heads, n_kv_heads, hd, max_seq, *, grid):
    """Row r (position p = start + r) of qkv_rows [chunk, (heads + 2 kv_heads) hd] f32 = [q | k | v], plus bias
    [(heads + 2 kv_heads) hd] f16: rotate-half RoPE on q and k with rope [max_seq, hd/2, (cos, sin)]; q_rows[r] =
    fp16(q) [chunk, heads hd];
    k_cache[:, p], v_cache[:, p] = fp16(k), fp16(v) in this layer's caches [kv_heads, max_seq, hd].
    """
    n, half = grid[0], hd // 2
    heads = n_heads + 2 * n_kv_heads
    pos = start + np.arange(n)
    y = (qkv_rows[:n, :heads * hd].astype(np.float32) + bias[:heads * hd].astype(np.float32)).reshape(n, heads, hd)
    cos, sin = rope[pos, :half, 0][:, None, :], rope[pos, :half, 1][:, None, :]  # [n, 1, hd/2]
    qk = y[:, :n_heads + n_kv_heads]
    first, second = qk[..., :half], qk[..., half:]
    qk = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    q_rows[:n, :n_heads * hd] = qk[:, :n_heads].reshape(n, n_heads * hd).astype(np.float16)
    k_cache[:n_kv_heads, pos] = qk[:, n_heads:].transpose(1, 0, 2).astype(np.float16)  # [kv_heads, n, hd]
    v_cache[:n_kv_heads, pos] = y[:, n_heads + n_kv_heads:].transpose(1, 0, 2).astype(np.float16)


def silu_mul_rows(gu_rows, h_rows, ff, *, grid):
    """h_rows[:n, :ff] = fp16(silu(gate) * up) with gate|up = gu_rows [chunk, 2 ff] f32, silu(a) = a / (1 + e^-a)."""
    n = grid[0]
    gate, up = gu_rows[:n, :ff].astype(np.float32), gu_rows[:n, ff:2 * ff].astype(np.float32)
    with np.errstate(over="ignore"):  # exp(-a) = inf for a << 0 gives silu = -0, as expf does on the GPU
        h_rows[:n, :ff] = (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float16)
