"""Twins of kernels_cu/gemv_quant.cu: the decode step's matrix-vector products on INT4 / INT8 weights.

The same kernels as gemv.cu (same fusions, same token rows, same launch geometry rules), with the weight W
[M, K] given as the quantized layout of cullama/model/quant.py: qweight [M, K * BITS / 32] uint32 and qparams
[M, K / group, 2] float16 in place of the FP16 W, and the group size as the last argument. BITS (4 or 8) is
a compile-time constant of the kernel; a twin reads it off the shapes. Each twin dequantizes (exactly, in
float32: quant.dequantize) and computes what the FP16 twin computes on those weights.

gemv_logits has no quantized form: the lm_head stays FP16 (as AWQ and GPTQ keep it).
"""

from __future__ import annotations

import numpy as np

from ...model import quant
from . import gemv

SOURCE = "gemv_quant.cu"
THREADS = 128
# Launch geometry and compile-time variants: output rows per block (even) and 16-byte code vectors per row and
# thread in one batch of loads, per BITS, for one token row (decode) and for k + 1 token rows (verify). The plan
# builds its launches from these (defines, rows_per_block); benchmarks/gemv_sweep.py times SWEEP's others too.
# Reasoning until an H200 sweep decides (benchmarks/PREDICTIONS.md): at K = 4096 an INT4 row is 128 vectors, one
# per thread, so only ROWS puts loads in flight (UNROLL matters from K = 11008 on: 2.7 vectors a thread); 8 rows
# also spread the block's x-side work (RMSNorm: a load, a multiply and a square per input) over twice the weights
# of 4. INT8 rows are twice as long: ROWS 4 with UNROLL 2 keeps 8 loads in flight and its 128 registers.
DECODE = {4: (("ROWS", 8), ("UNROLL", 1)), 8: (("ROWS", 4), ("UNROLL", 2))}
VERIFY = {4: (("ROWS", 4), ("UNROLL", 1)), 8: (("ROWS", 4), ("UNROLL", 1))}
SWEEP = {4: [(("ROWS", 4), ("UNROLL", 2)), (("ROWS", 4), ("UNROLL", 1))],
         8: [(("ROWS", 4), ("UNROLL", 1)), (("ROWS", 8), ("UNROLL", 1))]}
MAX_TOKENS = 9  # a verify step of at most 8 drafts, as gemv.cu


def defines(bits: int, tokens: int = 1) -> tuple:
    """The kernel's compile-time defines for `bits` and `tokens` token rows (1: a decode step)."""
    if tokens == 1:
        return (("BITS", bits),) + DECODE[bits]
    return (("BITS", bits),) + VERIFY[bits] + (("TOKENS", tokens),)


def rows_per_block(bits: int, tokens: int = 1) -> int:
    """Output rows per block (even: RoPE pairs and gate/up pairs share a block), as in gemv.cu."""
    return dict(defines(bits, tokens))["ROWS"]


# What CI compiles (and checks for spills) and `cullama kernels` lists: every launch a plan can make, then the
# sweep's other decode candidates.
DECODE_VARIANTS = [defines(bits) for bits in quant.BITS] + [(("BITS", bits),) + v for bits in quant.BITS
                                                            for v in SWEEP[bits]]
VERIFY_VARIANTS = [defines(bits, t) for bits in quant.BITS for t in range(2, MAX_TOKENS + 1)]
VARIANTS = DECODE_VARIANTS + VERIFY_VARIANTS


def weights(qweight: np.ndarray, qparams: np.ndarray, K: int) -> np.ndarray:
    """W [M, K] float32, exactly the kernels' dequantized weights."""
    return quant.dequantize(qweight, qparams, 32 * qweight.shape[1] // K)


def gemv_qkv_rope(x, norm_w, qweight, qparams, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads,
                  n_kv_heads, hd, max_seq, eps, group):
    """gemv.gemv_qkv_rope on the dequantized W_qkv [(heads + 2 kv_heads) hd, d] (the bias FP16)."""
    gemv.qkv_rope(weights(qweight, qparams, d), x, norm_w, bias, q_out, k_cache, v_cache, rope, state, step_rows, d,
                  n_heads, n_kv_heads, hd, max_seq, eps)


def gemv_residual(inp, qweight, qparams, x, M, K, group):
    """x[t, :M] += W [M, K] · in[t, :K] per token row t, W dequantized."""
    gemv.residual(weights(qweight, qparams, K), inp, x, M, K)


def gemv_gate_up_silu(x, norm_w, qweight, qparams, h, ff, d, eps, group):
    """gemv.gemv_gate_up_silu on the dequantized W [2 ff, d] (gate rows, then up rows)."""
    gemv.gate_up_silu(weights(qweight, qparams, d), x, norm_w, h, ff, d, eps)
