"""Twin of kernels_cu/gemm_quant.cu: the prefill GEMM on INT4 / INT8 weights.

gemm.cu's product, tiles and split-K contract, with W [N, K] in the quantized layout of cullama/model/quant.py
(qweight [N, K * BITS / 32] uint32, qparams [N, K / group, 2] float16; BITS a compile-time constant, group
the last argument). The kernel dequantizes each weight tile into shared memory as FP16 for the tensor cores:
(q - zero) * scale rounded to nearest even, which is quant.dequantize(..., np.float16).
"""

from __future__ import annotations

import numpy as np

from ...model import quant
from . import gemm

SOURCE = "gemm_quant.cu"
VARIANTS = [(("BITS", 4),), (("BITS", 8),)]  # the tiles and threads are gemm.cu's (prefill_kernels.MMA_GEMM)


def defines(bits: int) -> tuple:
    """The kernel's compile-time defines for `bits`-bit weights."""
    return (("BITS", bits),)


def gemm_quant(A, qweight, qparams, C, workspace, tile_count, M, N, K, accumulate, group):
    """C[:M, :N] (+)= A[:M, :K] · W^T, W [N, K] the FP16-rounded dequantized weights, summed in float32."""
    w = quant.dequantize(qweight[:N], qparams[:N], 32 * qweight.shape[1] // K, np.float16)
    gemm.product(w.astype(np.float32), A, C, M, N, K, accumulate)
