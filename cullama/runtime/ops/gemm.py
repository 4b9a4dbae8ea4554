"""Twin of kernels_cu/gemm.cu: the prefill path's tensor-core matrix product."""

from __future__ import annotations

import numpy as np

SOURCE = "gemm.cu"
VARIANTS = [()]  # no compile-time constants: the tile shape is GEMM_TILE_M / GEMM_TILE_N in cullama/runtime/plan.py


def gemm(A, W, C, workspace, tile_count, M, N, K, accumulate):
    """C[:M, :N] (+)= A[:M, :K] · W[:N, :K]^T in float32 from the FP16 inputs (+= when accumulate != 0).

    A [rows >= M, K] FP16, W [N, K] FP16, C [rows >= M, N] float32 (row stride N, as in the kernel).
    workspace (float32) and tile_count (uint32) are the kernel's split-K scratch: the kernel leaves
    tile_count all zero and workspace holds nothing anyone reads afterwards, so the twin (which does
    not split K: the split changes only the float32 summation order) leaves both untouched.
    """
    product(W[:N, :K].astype(np.float32), A, C, M, N, K, accumulate)


def product(w32, A, C, M, N, K, accumulate):
    """gemm's function on float32 weights w32 [N, K], whatever they are stored as (ops/gemm_quant.py)."""
    a32 = A[:M, :K].astype(np.float32)  # [M, K]
    # One matrix-vector product per row: BLAS's matrix-matrix kernels sum a row in an order that depends on how
    # many rows share the call (OpenBLAS's small-M paths), so a prompt's numbers would change with the prefill
    # chunk. Row by row, a row's result depends on that row alone, whatever the chunking.
    prod = np.empty((M, N), np.float32)  # [M, N]
    for row in range(M):
        prod[row] = w32 @ a32[row]
    if accumulate:
        C[:M, :N] += prod
    else:
        C[:M, :N] = prod
