"""Twins of kernels_cu/gemv_mma.cu: the decode step's matrix-vector products on tensor cores (mma.sync m16n8k16),
FP16, INT8 and INT4 weights, 1 to 16 token rows.

Compile-time defines (`defines(bits, tokens)`): BITS (16: FP16 W; 8 or 4: quant.py's qweight / qparams, the group size
the kernels' last argument) and TOKENS, the launch's token rows (1..16: 1 a decode step, k + 1 a verify step of k
drafts, B a batched step's group; x, in and the outputs are [TOKENS, width] rows). One signature for every BITS:
the weight is (W, qparams) and the group size the last argument; a BITS 16 kernel reads neither qparams nor group
(the plans pass W and 0). Two more have defaults the plans
use and a sweep may change: NTILES (n-tiles of 8 output rows per block, default 4: ROWS = 32 rows a block) and UNROLL
(k-blocks per warp in one batch of loads, default 4 for FP16, 2 for INT8, 1 for INT4); MIN_BLOCKS (default 4, INT4 3)
bounds registers.

The twins compute what the kernel computes, in its order: A = fp16(x * norm_w) (fp16(in) for gemv_residual), B = the
FP16 weight (quantized: fp16((q - zero) * scale), quant.dequantize(..., np.float16)), the reduction index permuted as
the lanes load it, every warp's chain of MMAs over its k-blocks, each MMA as the CPU executor runs mma.sync (C plus the
16 products in k order, summed in double, rounded once to float32: runtime.cpp complete_mma), the warps' partials added
in warp order, RMSNorm's Σ x² as each lane's chain of fmaf (emulated exactly), and the epilogues' float32 arithmetic.
So on the executor a twin equals its kernel bit for bit (tests/runtime/emu/test_emu_gemv_mma.py). On a GPU it matches
within a tolerance: the tensor core's internal summation inside an MMA is not specified by PTX (as for the prefill
GEMM's twin, ops/gemm.py); a token row's result still depends on that row alone there (the GPU check shows it).
Row independence is by construction here too: each token row is computed on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from ...model import quant
from .prepare import SS_SPAN, fma32 as _fma32, prepare, write_prepared  # noqa: F401 (prepare: the tests' X_PREP input)
from .rows import logit_rows, row_positions, token_rows

SOURCE = "gemv_mma.cu"
THREADS = 128
WARPS = THREADS // 32
NTILES = 4  # the kernel's default
ROWS = 8 * NTILES  # output rows per block (even: RoPE pairs and gate/up pairs share a block)
MAX_TOKENS = 16  # the MMA's M
FORMATS = (16, 8, 4)  # BITS: FP16, W8A16, W4A16


def kblock_scale(bits: int, group: int) -> bool:
    """Whether a quantized weight's groups hold whole k-blocks (4 chunks of 128 / bits codes each): then the kernel
    scales each k-block's sum in FP32 (KBLOCK_SCALE) instead of each code pair in FP16."""
    return bits != 16 and group > 0 and group % (4 * (128 // bits)) == 0


def defines(bits: int = 16, tokens: int = 1, group: int = 0) -> tuple:
    """The compile-time defines of the kernel the plans launch for `bits` and `tokens` token rows on a weight of
    groups of `group` along K (quantized; 0 or absent for FP16)."""
    if bits not in FORMATS:
        raise ValueError(f"gemv_mma: BITS must be one of {FORMATS}, not {bits}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv_mma: TOKENS must be 1..{MAX_TOKENS}, not {tokens}")
    return (("BITS", bits), ("TOKENS", tokens)) + ((("KBLOCK_SCALE", 1),) if kblock_scale(bits, group) else ())


def rows_per_block(defs: tuple = ()) -> int:
    """Output rows per block of a variant: 8 NTILES."""
    return 8 * dict(defs).get("NTILES", NTILES)


K_BLOCK_GROUP = 128  # a group that holds whole k-blocks for INT8 and INT4 (VARIANTS' KBLOCK_SCALE forms)
# What CI compiles (and checks for spills) and `cullama kernels` lists: every launch a plan can make.
VARIANTS = [defines(bits, t, group) for bits in FORMATS for group in ((0,) if bits == 16 else (128 // bits, K_BLOCK_GROUP))
            for t in range(1, MAX_TOKENS + 1)]


# -- the kernel's arithmetic ---------------------------------------------------------------------------------------
def _k_order(K: int, elems: int) -> tuple[np.ndarray, int]:
    """idx [kblocks, STEPS, 16]: the k of MMA k-index kk in step s of k-block kb (k >= K: padding), and kblocks."""
    vecs = K // elems
    kblocks = -(-vecs // 4)
    kb, s, kk = np.meshgrid(np.arange(kblocks), np.arange(elems // 4), np.arange(16), indexing="ij")
    t, h, upper = (kk % 8) // 2, kk % 2, kk // 8
    return (4 * kb + t) * elems + 4 * s + 2 * upper + h, kblocks


def mma_rows(b16: np.ndarray, a16: np.ndarray, bits: int, x: np.ndarray | None = None,
             scale: np.ndarray | None = None):
    """The kernel's sums before the epilogue, for one token row or several at once (each row's arithmetic is its own):
    dot [T, M] float32 = B [M, K] · A [T, K] (FP16 both) in the kernel's order, and with x [T, K] float32 (RMSNorm
    kernels) ss [T] float32, Σ x² in the kernel's order (else None). With scale [M, kblocks] (KBLOCK_SCALE) each
    k-block's MMAs chain from zero and enter the accumulator as fmaf(part, scale, acc)."""
    M, K = b16.shape
    T = a16.shape[0]
    elems = 128 // bits
    idx, kblocks = _k_order(K, elems)
    iters = -(-kblocks // WARPS)
    pad = iters * WARPS * 4 * elems  # k-blocks past the last one multiply zeros: adding +0.0 changes no sum
    a64 = np.zeros((T, pad), np.float64)
    a64[:, :K] = a16
    bp = np.zeros((M, pad), np.float16)  # FP16 (a 7B lm_head in float64 would take 1 GB); columns widened as used
    bp[:, :K] = b16
    steps = elems // 4
    full = np.zeros((iters * WARPS, steps, 16), np.int64)
    full[:kblocks] = idx
    if iters * WARPS > kblocks:  # whole padding k-blocks: any k past K
        full[kblocks:] = K
    order = full.reshape(iters, WARPS, steps, 16)  # k-block i * WARPS + w is warp w's i-th
    acc = np.zeros((WARPS, T, M), np.float32)
    if scale is not None:  # [WARPS, 1, M] per iteration: k-blocks past the last scale +0 sums by 0 (no change)
        kscale = np.zeros((iters * WARPS, M), np.float32)
        kscale[:kblocks] = scale.T
        kscale = kscale.reshape(iters, WARPS, 1, M)
    for i in range(iters):
        part = acc if scale is None else np.zeros_like(acc)
        for s in range(steps):
            total = part.astype(np.float64)  # C, then the 16 products in k order, in double; rounded once
            for kk in range(16):
                k = order[i, :, s, kk]  # [WARPS]
                total += a64[:, k].T[:, :, None] * bp[:, k].T.astype(np.float64)[:, None, :]
            part = total.astype(np.float32)
        acc = part if scale is None else _fma32(part, kscale[i], acc)
    dot = acc[0].copy()
    for w in range(1, WARPS):
        dot = dot + acc[w]
    if x is None:
        return dot, None
    # Σ x²: lane (g, t) of warp w chains fmaf over its chunks c = 4 kb + t (kb its warp's) and their elements in order
    xp = np.zeros((T, pad), np.float32)
    xp[:, :K] = x
    chunks = xp.reshape(T, iters, WARPS, 4, elems)  # [T, i, w, t, e]
    ss = np.zeros((T, WARPS, 4), np.float32)
    for i in range(iters):
        for e in range(elems):
            v = chunks[:, i, :, :, e]
            ss = _fma32(v, v, ss)
    total = ss[:, 0, 0].copy()
    for w in range(WARPS):
        for t in range(4):
            if w or t:
                total = total + ss[:, w, t]
    return dot, total


def _rms_scale(ss: np.ndarray, K: int, eps) -> np.ndarray:
    """rsqrtf(ss / K + eps) as the executor has it (1 / sqrt), in float32."""
    mean = ss / np.float32(K) + np.float32(eps)
    return np.float32(1.0) / np.sqrt(mean)


def _normed(x: np.ndarray, norm_w: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(x [T, K] float32, A = fp16(x * norm_w) [T, K])."""
    x32 = np.ascontiguousarray(token_rows(x)[:, :K], np.float32)
    return x32, (x32 * norm_w[:K].astype(np.float32)).astype(np.float16)


def _weights(W, qparams, K: int) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(B [M, K] float16, BITS, scale): the FP16 W (scale None); a quantized weight as the prefill GEMM has it,
    fp16((q - zero) * scale) (scale None), or where its groups hold whole k-blocks (kblock_scale: the kernel's
    KBLOCK_SCALE form) the exact (q - zero) and scale [M, kblocks] float32, each row's scale in each k-block."""
    if qparams is None:
        return np.asarray(W)[:, :K].astype(np.float16, copy=False), 16, None
    bits = 32 * W.shape[1] // K
    group = K // qparams.shape[1]
    if not kblock_scale(bits, group):
        return quant.dequantize(W, qparams, bits, np.float16), bits, None
    M = W.shape[0]
    pairs = qparams.astype(np.float32)  # [M, G, 2]
    q = quant.unpack(W, bits).reshape(M, pairs.shape[1], group).astype(np.float32)
    exact = (q - pairs[..., 1:]).reshape(M, K).astype(np.float16)  # integers of magnitude <= 256: exact
    span = 4 * (128 // bits)  # k per k-block
    return exact, bits, np.ascontiguousarray(pairs[:, np.arange(K // span) * span // group, 0])


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, (ctypes.c_float,)
_EXPF = np.frompyfunc(_LIBM.expf, 1, 1)


def _expf(a: np.ndarray) -> np.ndarray:
    """The C library's expf, element by element: the executor's expf (correctly rounded results can differ by an ulp)."""
    return np.asarray(_EXPF(a), np.float32).reshape(a.shape)


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (np.float32(1.0) + _expf(-a))


# -- the RMSNorm kernels' two input forms ---------------------------------------------------------------------------
def prepared_ss(ssp: np.ndarray, K: int) -> np.ndarray:
    """Σ x² [T] of a prepared input from its parts ssp [T, ceil(K / SS_SPAN)], in prepared_scales' order: lane l
    adds parts l, l + 32, ... from +0 in order, then the lanes' sums in a butterfly (l + l ^ 1, then ^ 2, ..., ^ 16).
    (Parts past the last are +0 here: adding them changes no sum, as the kernel's skipping them.)"""
    parts = -(-K // SS_SPAN)
    rows = token_rows(ssp)[:, :parts].astype(np.float32)
    padded = np.zeros((rows.shape[0], -(-parts // 32) * 32), np.float32)
    padded[:, :parts] = rows
    lanes = np.zeros((rows.shape[0], 32), np.float32)
    for chunk in padded.reshape(rows.shape[0], -1, 32).transpose(1, 0, 2):  # parts l, l + 32, ... of each lane
        lanes = lanes + chunk
    m = 1
    while m < 32:
        lanes = lanes + lanes[:, np.arange(32) ^ m]
        m *= 2
    return lanes[:, 0].copy()


def _norm_dot(b16: np.ndarray, bits: int, scale, prepared: bool, first, second, K: int):
    """(dot [T, M], ss [T]) of an RMSNorm kernel: A and Σ x² from the prepared input (first, second = xn, ssp) or,
    in gemv_logits_x, from x and the norm weights (first, second = x, norm_w; mma_rows sums x^2 as the kernel does)."""
    if prepared:
        a16 = np.ascontiguousarray(token_rows(first)[:, :K], np.float16)
        return mma_rows(b16, a16, bits, scale=scale)[0], prepared_ss(second, K)
    x32, a16 = _normed(first, second, K)
    return mma_rows(b16, a16, bits, x32, scale)


# -- the kernels -----------------------------------------------------------------------------------------------------
def qkv_rope(W, qparams, xn, ssp, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads, n_kv_heads, hd,
             max_seq, eps):
    b16, bits, scale = _weights(W, qparams, d)
    dot, ss = _norm_dot(b16, bits, scale, True, xn, ssp, d)
    rows = dot.shape[0]
    y = (dot * _rms_scale(ss, d, eps)[:, None]) + bias[:b16.shape[0]].astype(np.float32)  # [rows, all heads * hd]
    y = y.reshape(rows, n_heads + 2 * n_kv_heads, hd)
    slots, positions = row_positions(step_rows, state, rows)
    angles = rope[positions]  # [rows, hd/2, 2]: each row's cos and sin at its position
    cos, sin = angles[:, None, :, 0], angles[:, None, :, 1]
    qk = y[:, : n_heads + n_kv_heads]
    first_half, second_half = qk[..., : hd // 2].copy(), qk[..., hd // 2:].copy()
    qk[..., : hd // 2] = first_half * cos - second_half * sin
    qk[..., hd // 2:] = second_half * cos + first_half * sin
    token_rows(q_out)[:, : n_heads * hd] = y[:, :n_heads].reshape(rows, -1)
    keys, values = (c.reshape(-1, n_kv_heads, max_seq, hd) for c in (k_cache, v_cache))  # [slots, ...]
    keys[slots, :, positions] = y[:, n_heads: n_heads + n_kv_heads].astype(np.float16)  # [rows, kv_heads, hd]
    values[slots, :, positions] = y[:, n_heads + n_kv_heads:].astype(np.float16)


def residual(W, qparams, inp, x, M, K, norm_w=None, xn=None, ssp=None):
    b16, bits, scale = _weights(W, qparams, K)
    a16 = token_rows(inp)[:, :K].astype(np.float32).astype(np.float16)
    dot, _ = mma_rows(b16[:M], a16, bits, scale=None if scale is None else scale[:M])
    xs = token_rows(x)
    xs[:, :M] = xs[:, :M] + dot
    if norm_w is not None:
        write_prepared(xs, norm_w, xn, ssp, M)


def gate_up_silu(W, qparams, xn, ssp, h, ff, d, eps):
    b16, bits, scale = _weights(W, qparams, d)
    dot, ss = _norm_dot(b16[:2 * ff], bits, None if scale is None else scale[:2 * ff], True, xn, ssp, d)
    scale = _rms_scale(ss, d, eps)[:, None]
    gate, up = dot[:, :ff] * scale, dot[:, ff:] * scale
    token_rows(h)[:, :ff] = _silu(gate) * up


def logits_rows(prepared, first, second, W, logits, V, d, eps):
    dot, ss = _norm_dot(np.asarray(W)[:V, :d].astype(np.float16, copy=False), 16, None, prepared, first, second, d)
    out = dot * _rms_scale(ss, d, eps)[:, None]
    for lt, row in zip(logit_rows(logits, V, len(out)), out):
        lt[:V] = row


def _quantized(W) -> bool:
    return np.asarray(W).dtype == np.uint32  # quant.py's qweight; an FP16 W otherwise (qparams and group unread)


def gemv_qkv_rope(xn, ssp, W, qparams, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads, n_kv_heads,
                  hd, max_seq, eps, group):
    """Per token row t of a prepared input (xn [T, d] float16 = x * norm_w, ssp: its Σ x² parts; ops/prepare.py):
    q|k|v = W · rmsnorm(x[t]) + bias, then RoPE; q_out[t] [heads hd] f32, k_cache / v_cache [slots, kv_heads,
    max_seq, hd] f16 written in row t's slot at its position. W: FP16 [M, d], or quant.py's qweight with its qparams
    (and group)."""
    qkv_rope(W, qparams if _quantized(W) else None, xn, ssp, bias, q_out, k_cache, v_cache, rope, state,
             step_rows, d, n_heads, n_kv_heads, hd, max_seq, eps)


def gemv_residual(inp, W, qparams, x, norm_w, xn, ssp, M, K, group):
    """x[t, :M] += W [M, K] · in[t, :K] per token row t (1-D: one row; `in` float16: attention's output, or h); then the next RMSNorm kernel's prepared
    input from the new x: xn[t, :M] = fp16(x * norm_w), ssp[t] its Σ x² parts (prepare)."""
    residual(W, qparams if _quantized(W) else None, inp, x, M, K, norm_w, xn, ssp)


def gemv_gate_up_silu(xn, ssp, W, qparams, h, ff, d, eps, group):
    """h[t, :ff] = fp16(silu(gate) * up) (h float16), gate|up = W [2 ff, d] · rmsnorm(x[t]) per token row t of a
    prepared input."""
    gate_up_silu(W, qparams if _quantized(W) else None, xn, ssp, h, ff, d, eps)


def gemv_logits(xn, ssp, W, logits, V, d, eps):
    """logits[t, :V] = W [V, d] · rmsnorm(x[t]) per token row t of a prepared input, rows at logits_stride(V) (FP16
    W only)."""
    logits_rows(True, xn, ssp, W, logits, V, d, eps)


def gemv_logits_x(x, norm_w, W, logits, V, d, eps):
    """gemv_logits on float32 rows x and the norm weights."""
    logits_rows(False, x, norm_w, W, logits, V, d, eps)
