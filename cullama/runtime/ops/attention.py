"""Twins of kernels_cu/attention.cu: softmax(q·K^T * scale)·V over the KV cache, decode and prefill.

Convention for twins whose kernel reads its extent from the launch grid: the twin declares a keyword-only parameter
`grid`, and the numpy backend passes the launch's grid (a 3-tuple) as `grid=` to every twin that declares it.
attention_decode takes its token rows from grid[2] (a verify step's k + 1 rows, a batched step's B; 1 for a decode
step), as the kernel does from gridDim.z. attention_prefill takes its kv-head count (the row stride) from grid[0],
as the kernel does from gridDim.x; its row count is the argument n_rows (grid[1] counts blocks of ROWS_Q rows, a
compile-time define the twin never needs). HEAD_DIM and GROUP are never arguments: they follow from the arrays'
shapes. `window` (the last argument of both) is the sliding window: a query at position p sees the keys
max(0, p - window + 1)..p (window >= max_seq: all of 0..p).
"""

from __future__ import annotations

import functools

import numpy as np

from .rows import row_positions

SOURCE = "attention.cu"
# (HEAD_DIM, GROUP, ROWS_Q): the shipped configs first (llama-2-7b, tiny-gqa, tiny-mha, stories260K), then
# enough others that every HEAD_DIM and every GROUP compiles at least once, each with the ROWS_Q that
# cullama.runtime.plan.attention_rows_q gives its GROUP (max(1, 4 // GROUP); attention_decode ignores ROWS_Q);
# then two that tile more rows than the plan does (8 queries a block: ~215 registers, still no spills); then the
# shapes of issue 18's families (LLaMA-3.2-1B: 64 x 4; LLaMA-3.2-3B: 128 x 3; Qwen2.5 14B / 32B, 1.5B, 7B and
# 0.5B: 128 x 5, 6, 7; TinyLlama 64 x 8 and LLaMA-3-8B / Mistral-7B 128 x 4 are above).
VARIANTS = [(("HEAD_DIM", hd), ("GROUP", g), ("ROWS_Q", r)) for hd, g, r in
            ((128, 1, 4), (32, 4, 1), (32, 1, 4), (8, 2, 2), (128, 8, 1), (128, 4, 1), (64, 8, 1), (64, 2, 2),
             (16, 4, 1), (16, 1, 4), (8, 8, 1), (128, 1, 8), (32, 4, 2),
             (64, 4, 1), (128, 3, 1), (128, 5, 1), (128, 6, 1), (128, 7, 1))]


def attention_decode(q, k_cache, v_cache, part, count, out, state, step_rows, max_seq, scale, window, *, grid):
    """Per token row t < grid[2] (1 for a decode step): out[t] [heads*hd] f16 = attention of q[t] [heads*hd]
    over keys max(0, p - window + 1)..p of its slot's k_cache/v_cache [slots, kv_heads, max_seq, hd] f16, where
    step_rows [>= grid[2], 2] int32 gives the row's (slot, offset) and p = state[slot, POS] + offset (state [slots,
    8]); part[t] [heads, splits, hd+2] gets each split's (acc, m, l) as the kernel writes it (the splits divide
    those keys only), the splits are combined in order, count[t] [kv_heads] is left at 0. A decode step's arrays
    are one row (q [heads*hd], part [heads, splits, hd+2], ...). Each row is the one-row computation at its own
    slot and position, as on the GPU: its splits by calls of its own (_attention_decode_row), the combine and the
    empty splits by elementwise arithmetic over all rows at once (each element's the one-row arithmetic)."""
    n_rows = int(grid[2])
    parts = part.reshape(n_rows, *part.shape[-3:])  # [rows, heads, splits, hd + 2], written in place
    heads, kv_heads, hd = parts.shape[1], int(grid[0]), parts.shape[-1] - 2
    keys, values = (c.reshape(-1, kv_heads, int(max_seq), hd) for c in (k_cache, v_cache))  # [slots, ...]
    parts[:] = _empty_split(hd)  # what the splits holding no keys keep
    rows = zip(q.reshape(n_rows, -1), parts, *row_positions(step_rows, state, n_rows))
    for qt, pt, slot, pos in rows:
        _attention_decode_row(qt, keys[slot], values[slot], pt, pos, int(max_seq), scale, int(window))
    # The combine, as the kernel's last block: each row's splits in their fixed order s = 0, 1, ... (accumulate adds
    # them one after another, element by element, so all rows at once is each row's own sum); an empty split
    # (m = -inf) weighs exp(-inf) = 0; split 0 is never empty.
    m = parts[..., hd]  # [rows, heads, splits]
    c = np.exp(m - m.max(axis=2, keepdims=True))
    acc = np.add.accumulate(parts[..., :hd] * c[..., None], axis=2)[:, :, -1]  # [rows, heads, hd]
    l = np.add.accumulate(parts[..., hd + 1] * c, axis=2)[:, :, -1]
    out.reshape(n_rows, -1)[:, : heads * hd] = (acc / l[..., None]).reshape(n_rows, -1)
    count.reshape(n_rows, -1)[:, :kv_heads] = 0


def _attention_decode_row(q, k_cache, v_cache, part, pos: int, max_seq: int, scale, window: int):
    """One token row's splits, all kv heads at once, into part [heads, splits, hd + 2] (its empty splits already
    written): the window's keys padded to used x chunk (the splits that hold keys, each `chunk` long but the last),
    the padding's scores -inf, so it weighs 0. The same calls on the same shapes for a row alone or in a batch, so
    its bits never depend on the other rows."""
    heads, splits, stride = part.shape
    kv_heads, hd = k_cache.shape[0], stride - 2
    group = heads // kv_heads
    n = min(pos + 1, max_seq)
    first = max(n - window, 0)  # the window's oldest key
    keys_n = n - first  # >= 1
    chunk = -(-keys_n // splits)
    used = -(-keys_n // chunk)  # splits [0, used) hold keys; [used, splits) are empty
    qh = q[: heads * hd].astype(np.float32).reshape(kv_heads, group, hd)
    s = np.full((kv_heads, group, used * chunk), -np.inf, np.float32)  # the last split's padding stays -inf
    s[:, :, :keys_n] = (qh @ k_cache[:, first:n].astype(np.float32).transpose(0, 2, 1)) * np.float32(scale)
    s = s.reshape(kv_heads, group, used, chunk)
    m = s[..., 0] if chunk == 1 else s.max(axis=3)  # [kv_heads, group, used] (one key a split: its score)
    p = np.exp(s - m[..., None])
    # Each key's value in part's layout (v, 0, 1), zero past the window's end: p times it sums to (acc, 0, l)
    values = np.zeros((kv_heads, used * chunk, stride), np.float32)
    values[:, :keys_n, :hd] = v_cache[:, first:n]
    values[:, :keys_n, hd + 1] = 1
    states = p.transpose(0, 2, 1, 3) @ values.reshape(kv_heads, used, chunk, stride)  # [kv_heads, used, group, ..]
    part[:, :used] = states.transpose(0, 2, 1, 3).reshape(heads, used, stride)  # head kv * group + g
    part[:, :used, hd] = m.reshape(heads, used)


@functools.lru_cache(maxsize=8)
def _empty_split(hd: int) -> np.ndarray:
    """[hd + 2]: a split with no keys as the kernel writes it: acc 0, m -inf, l 0 (read only)."""
    state = np.zeros(hd + 2, np.float32)
    state[hd] = -np.inf
    state.flags.writeable = False
    return state


def attention_prefill(q_rows, k_cache, v_cache, out_rows, start, n_rows, max_seq, scale, window, *, grid):
    """out_rows[r] (f16) = attention of q_rows[r] [heads*hd] f16 over keys max(0, n - window)..n - 1, n = min(start
    + r + 1, max_seq), for rows r < n_rows (rows beyond are left as they are); k_cache/v_cache [kv_heads, max_seq,
    hd] f16 already hold the chunk. grid[0] is the kv-head count; grid[1] (blocks of ROWS_Q rows) does not matter
    here."""
    kv_heads, rows = int(grid[0]), int(n_rows)
    hd = k_cache.shape[2]
    group = q_rows.shape[1] // (kv_heads * hd)
    end = min(int(start) + rows, int(max_seq))  # keys any row sees
    q = q_rows[:rows, : kv_heads * group * hd].astype(np.float32).reshape(rows, kv_heads, group, hd)
    keys, values = k_cache[:, :end].astype(np.float32), v_cache[:, :end].astype(np.float32)  # [kv_heads, end, hd]
    # Row by row over exactly the keys a row sees (all kv heads at once): a row's numbers then depend on its
    # position alone, not on which rows share its prefill chunk (a masked [rows, end] product sums each row in an
    # order that does).
    for r in range(rows):
        n = min(int(start) + r + 1, end)  # keys up to start+r (those in the cache)
        first = max(n - int(window), 0)  # and from the window's oldest
        s = (q[r] @ keys[:, first:n].transpose(0, 2, 1)) * np.float32(scale)  # [kv_heads, group, n - first]
        p = np.exp(s - s.max(axis=2, keepdims=True))
        o = (p @ values[:, first:n]) / p.sum(axis=2, keepdims=True)  # [kv_heads, group, hd]
        out_rows[r, : kv_heads * group * hd] = o.reshape(-1).astype(np.float16)
