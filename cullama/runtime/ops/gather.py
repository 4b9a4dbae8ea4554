"""Twin of kernels_cu/gather.cu: activation columns in a weight's input order (GPTQ act-order).

A GPTQ checkpoint with desc_act orders each linear's input channels by its g_idx; the loader sorts the columns
once so that groups are contiguous, keeping perm [K] int32 (column k of the stored weight is input channel
perm[k]). Before such a linear the plan gathers its input: out[t, k] = in[t, perm[k]] for each token row t.

Row count: one block per token row and no argument says how many, so the twins take the launch grid as the
keyword `grid` (as ops/prefill.py's row kernels do: the NumPy backend passes it) and read T = grid[0].
"""

from __future__ import annotations

import numpy as np

SOURCE = "gather.cu"
VARIANTS = [()]
THREADS = 256  # threads per block (one block per token row)


def gather_f16(inp, perm, out, K, *, grid):
    """out [T, K] float16 = in[:, perm] for the grid's T rows (a decode step's single row may be 1-D): a decode or
    verify step's GEMV input, or a prefill chunk's GEMM input. Grid: (T, 1, 1), one block per row; rows at a stride
    of K."""
    _gather(inp, perm, out, K, grid[0])


def _gather(inp, perm, out, K, rows):
    index = perm[:K].astype(np.intp)
    src, dst = inp.reshape(-1, K)[:rows], out.reshape(-1, K)[:rows]  # views: out is written in place
    dst[...] = src[:, index]
