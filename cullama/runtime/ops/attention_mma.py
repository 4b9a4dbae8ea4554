"""Twin of kernels_cu/attention_mma.cu: the prefill path's causal attention on the tensor cores.

attention_prefill_mma computes exactly what attention_prefill (attention.cu) computes, with the same
parameters, so its twin is that twin (cullama/runtime/ops/attention.py), called as it is: the kv-head count (the
row stride) from grid[0], the rows from n_rows. Only the launch differs: grid (n_kv_heads, ceil(n_rows /
rows_per_block(group))), block `threads()`; `grid()` below gives it. HEAD_DIM 8 has no tensor-core variant
(m16n8k16 needs a k of 16): `supports()` says which configurations the plan may send here; the others keep
the scalar attention_prefill.
"""

from __future__ import annotations

from . import attention as _attention

SOURCE = "attention_mma.cu"
HEAD_DIMS = (16, 32, 64, 128)  # HEAD_DIM values the kernel compiles for
GROUPS = (1, 2, 4, 8)
WARPS = 4  # the default (and the plan's) warps per block; WARPS 2 is a compiled variant, to compare
TILE_K = 64  # keys per tile (AM_TILE_K)
QUERIES_PER_WARP = 16  # one m16 tile of (row, head) queries
QUERIES = QUERIES_PER_WARP * WARPS  # (row, head) queries per block at the default: 64
THREADS = 32 * WARPS  # block size at the default: 128

# (HEAD_DIM, GROUP, WARPS) compiled by CI and the tests: the shipped configs first (llama-2-7b, tiny-gqa,
# tiny-mha; stories260K has head_dim 8: scalar kernel), then every HEAD_DIM and GROUP at least once, then
# two at WARPS 2, then TinyLlama's (64 x 8; LLaMA-3.2-1B's 64 x 4 and LLaMA-3-8B's 128 x 4 are above; the groups
# of 3, 5, 6 and 7 of LLaMA-3.2-3B and Qwen2.5 have no tensor-core variant: the scalar attention_prefill).
VARIANTS = [(("HEAD_DIM", hd), ("GROUP", g), ("WARPS", w)) for hd, g, w in
            ((128, 1, 4), (32, 4, 4), (32, 1, 4), (64, 1, 4), (64, 4, 4), (128, 4, 4), (16, 2, 4), (128, 8, 4),
             (64, 2, 4), (16, 8, 4), (128, 1, 2), (32, 4, 2), (64, 8, 4))]


def supports(head_dim: int, group: int) -> bool:
    """Whether attention_prefill_mma has a variant for this head_dim and group size."""
    return head_dim in HEAD_DIMS and group in GROUPS


def threads(warps: int = WARPS) -> int:
    """Block size (AM_THREADS)."""
    return 32 * warps


def rows_per_block(group: int, warps: int = WARPS) -> int:
    """Prompt rows per block (AM_ROWS): 16 x warps (row, head) queries of `group` heads each."""
    return QUERIES_PER_WARP * warps // group


def grid(n_kv_heads: int, n_rows: int, group: int, warps: int = WARPS) -> tuple[int, int, int]:
    """The launch grid: (n_kv_heads, ceil(n_rows / rows_per_block), 1)."""
    return n_kv_heads, -(-n_rows // rows_per_block(group, warps)), 1


def attention_prefill_mma(q_rows, k_cache, v_cache, out_rows, start, n_rows, max_seq, scale, window, *, grid):
    """out_rows[r] (f16) = attention of q_rows[r] [heads*hd] f16 over keys max(0, n - window)..n - 1, n = min(start
    + r + 1, max_seq), for rows r < n_rows (rows beyond are left as they are): attention_prefill's twin (grid[0] is
    the kv-head count)."""
    _attention.attention_prefill(q_rows, k_cache, v_cache, out_rows, start, n_rows, max_seq, scale, window,
                                 grid=grid)
