"""AWQ and GPTQ checkpoints as they are stored: each quantized linear's tensors, and how to read them.

A quantized linear `M` (e.g. model.layers.0.self_attn.q_proj) with N outputs, K inputs, `bits` per weight and
groups of g inputs (g = K for group_size -1; G = K / g groups) is stored in place of M.weight as:

    AWQ, GEMM layout (AutoAWQ)                      GPTQ (AutoGPTQ, GPTQModel)
    M.qweight  int32 [K, N / 8]                     M.qweight  int32 [K bits / 32, N]
    M.qzeros   int32 [G, N / 8]                     M.qzeros   int32 [G, N bits / 32]
    M.scales   float16 [G, N]                       M.scales   float16 [G, N]
                                                    M.g_idx    int32 [K]

- AWQ packs 8 codes along the outputs: nibble i (bits 4i .. 4i + 3) of word j holds output 8 j + AWQ_ORDER[i];
  qzeros is packed the same way. W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n].
- GPTQ packs E = 32 / bits codes along the inputs in plain order: bits e*bits .. of word i hold input E i + e;
  qzeros packs E zeros along the outputs the same way. checkpoint_format "gptq" stores each zero minus one
  (read: stored + 1, so a 4-bit 15 is 16: the stored field wraps), "gptq_v2" the zero itself. Input k belongs to
  group g_idx[k]: k // g without act-order; with desc_act the inputs were quantized in another order and g_idx
  is a permutation of that grouping (every group holds g inputs). W[n, k] = (q[k, n] - z[g_idx[k], n]) *
  s[g_idx[k], n].

read() turns a linear into codes [N, K], scale and zero [N, G] and its input order; quant.pack and quant.params
then make cullama's device format of them (weights.py). Sorting the inputs by g_idx (stable) makes every group
contiguous: perm [K], column k of the sorted weight is input perm[k] (identity without act-order). Everything the
formats leave open is checked here, before a weight reaches the device: shapes and dtypes (check()), every g_idx a
valid grouping and every scale finite (check_data()); each failure is one line naming the tensor.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import quant
from .config import Quantization
from ..common.errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (of 8) held by nibble i of an AWQ word
STORED = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
DTYPES = {"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"}
FP16_OVERFLOW = 65520.0  # the least magnitude that rounds to inf in FP16 (65504 is its largest finite value)


def group_size(q: Quantization, K: int) -> int:
    """Inputs per group of a linear with K inputs (group_size -1: all of them)."""
    return K if q.group == -1 else q.group


def shapes(q: Quantization, N: int, K: int) -> dict[str, tuple[int, ...]]:
    """The stored tensors of one quantized linear (suffix -> shape). Assumes check_sizes passed."""
    per_word, G = 32 // q.bits, K // group_size(q, K)
    if q.method == "awq":
        return {"qweight": (K, N // per_word), "qzeros": (G, N // per_word), "scales": (G, N)}
    return {"qweight": (K // per_word, N), "qzeros": (G, N // per_word), "scales": (G, N), "g_idx": (K,)}


def check_sizes(q: Quantization, module: str, N: int, K: int) -> None:
    """CheckpointError unless a linear of N outputs and K inputs can be stored in this format and read into
    cullama's (quant.QuantFormat's shape contract: a 16-byte vector of codes lies in one group)."""
    g, per_word, vector = group_size(q, K), 32 // q.bits, quant.VECTOR[q.bits]
    if K % g:
        raise CheckpointError(f"{module}: quantization_config.group_size {q.group} does not divide its {K} inputs")
    packed = N if q.method == "awq" else K  # AWQ packs along the outputs, GPTQ along the inputs
    if packed % per_word or N % per_word:
        raise CheckpointError(f"{module}: {N} outputs and {K} inputs do not pack {per_word} {q.bits}-bit codes "
                              "to a word")
    if K % vector or g % vector:
        raise CheckpointError(f"{module}: {K} inputs in groups of {g} are not supported (cullama's {q.bits}-bit "
                              f"kernels need both to be multiples of {vector})")


def check(q: Quantization, module: str, N: int, K: int, stored: Callable[[str], tuple[str, tuple] | None],
          where) -> None:
    """The stored tensors of one linear against the format: present, of the right dtype and shape. stored(name)
    gives (dtype, shape) or None for a missing tensor; `where` names the checkpoint in errors."""
    check_sizes(q, module, N, K)
    for suffix, shape in shapes(q, N, K).items():
        name = f"{module}.{suffix}"
        found = stored(name)
        if found is None:
            raise CheckpointError(f"{where}: missing tensor {name} ({q.method} stores {', '.join(STORED[q.method])} "
                                  "per quantized linear)")
        dtype, got = found
        if dtype != DTYPES[suffix]:
            raise CheckpointError(f"{where}: {name}: dtype {dtype} is not {DTYPES[suffix]} ({q.method}'s {suffix})")
        if tuple(got) != shape:
            raise CheckpointError(f"{where}: {name}: expected shape {list(shape)} for {N} outputs and {K} inputs "
                                  f"in {q.bits}-bit groups of {group_size(q, K)}, found {list(got)}")


# -- reading --------------------------------------------------------------------------------------------
def _unpack_words(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """int32 words [..., W] -> codes [..., W * 32 / bits] uint8, field e of word w at index w E + order[e]
    (plain order by default)."""
    per_word, mask = 32 // bits, np.uint32((1 << bits) - 1)
    words = np.ascontiguousarray(words).view(np.uint32)
    out = np.empty((*words.shape, per_word), np.uint8)
    for field, index in enumerate(order or range(per_word)):
        out[..., index] = (words >> np.uint32(bits * field)) & mask
    return out.reshape(*words.shape[:-1], -1)


def unpack_awq(qweight: np.ndarray, qzeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """AWQ's qweight [K, N / 8] and qzeros [G, N / 8] -> codes [N, K] uint8 and zeros [N, G] (as stored)."""
    return _unpack_words(qweight, bits, AWQ_ORDER).T, _unpack_words(qzeros, bits, AWQ_ORDER).T


def unpack_gptq(qweight: np.ndarray, qzeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's qweight [K E', N] (packed along K) and qzeros [G, N / E] -> codes [N, K] uint8 and zeros [N, G]
    (as stored: the v1 format's zero - 1)."""
    codes = _unpack_words(np.ascontiguousarray(qweight.T), bits)  # [N, K]: word rows become a row's runs
    return codes, _unpack_words(qzeros, bits).T


def perm_of(g_idx: np.ndarray) -> np.ndarray | None:
    """The input order that makes every group contiguous (a stable sort by g_idx), None where it already is."""
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    return None if np.array_equal(perm, np.arange(len(perm))) else perm


def check_data(q: Quantization, module: str, N: int, K: int, tensor: Callable[[str], np.ndarray], where) -> None:
    """The checks that read data (small tensors only): the scales finite, and g_idx a grouping of the inputs
    into groups of g (each of the K / g groups holds exactly g inputs)."""
    scales = tensor(f"{module}.scales")
    bad = np.flatnonzero(~np.isfinite(scales.reshape(-1)))
    if bad.size:
        at = ", ".join(map(str, np.unravel_index(int(bad[0]), scales.shape)))
        raise CheckpointError(f"{where}: {module}.scales holds {float(scales.reshape(-1)[bad[0]])} at [{at}] (NaN "
                              "and inf scales are refused)")
    if q.method == "gptq":
        g, G = group_size(q, K), K // group_size(q, K)
        g_idx = tensor(f"{module}.g_idx")
        counts = np.bincount(np.clip(g_idx, 0, G), minlength=G + 1)
        if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= G or not np.all(counts[:G] == g):
            raise CheckpointError(f"{where}: {module}.g_idx is not a valid grouping of {K} inputs into {G} groups "
                                  f"of {g} (values {int(g_idx.min())} to {int(g_idx.max())})")


def read(q: Quantization, module: str, tensor: Callable[[str], np.ndarray], where=None) -> tuple:
    """One linear as (codes [N, K] uint8, scale [N, G] float16, zero [N, G] float32, perm [K] int32 or None),
    its inputs already in the order perm gives (groups contiguous): W[:, perm][n, k] = (codes[n, k] - zero[n,
    k // g]) * scale[n, k // g]. tensor(name) reads a stored tensor; check and check_data have passed. A weight
    FP16 cannot hold is a CheckpointError naming the scale (check_fp16); `where` names the checkpoint in it."""
    qweight, qzeros, scales = (tensor(f"{module}.{s}") for s in ("qweight", "qzeros", "scales"))
    if q.method == "awq":
        codes, zeros = unpack_awq(qweight, qzeros, q.bits)
        perm = None
    else:
        codes, zeros = unpack_gptq(qweight, qzeros, q.bits)
        perm = perm_of(tensor(f"{module}.g_idx"))
        if perm is not None:
            codes = codes[:, perm]
    zero = zeros.astype(np.float32) + (1 if q.zero_stored_minus_one else 0)  # 4 bits: a stored 15 is 16
    scale = np.ascontiguousarray(scales.T)
    check_fp16(module, codes, scale, zero, perm, where)
    return codes, scale, zero, perm


def check_fp16(module: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, perm, where=None) -> None:
    """CheckpointError unless every weight (code - zero) * scale rounds to a finite FP16: the prefill GEMM takes
    its weights in FP16, where one past 65504 is inf and the model's numbers then NaN (finite scales of 65504
    passed check_data, and generation failed with "no token can be drawn"). Exact, from each group's codes
    farthest from its zero; the arguments as read() has them (codes in perm's order, groups contiguous)."""
    N, K = codes.shape
    grouped = codes.reshape(N, scale.shape[1], -1)  # [N, G, g]
    far = np.maximum(np.abs(grouped.max(axis=2) - zero), np.abs(grouped.min(axis=2) - zero))  # [N, G] float32
    bad = np.flatnonzero(far * np.abs(scale.astype(np.float32)) >= FP16_OVERFLOW)  # exact: 9 bits times 11
    if not bad.size:
        return
    n, group = (int(i) for i in np.unravel_index(int(bad[0]), far.shape))
    offsets = grouped[n, group].astype(np.float32) - zero[n, group]
    j = int(np.argmax(np.abs(offsets)))
    k = group * grouped.shape[2] + j
    k = k if perm is None else int(perm[k])  # the input's index in the model's order
    weight = float(offsets[j] * scale[n, group].astype(np.float32))
    raise CheckpointError(f"{f'{where}: ' if where else ''}{module}.scales[{group}, {n}] is "
                          f"{float(scale[n, group]):g}: the weight [{n}, {k}] dequantizes to {weight:g}, past FP16's "
                          "largest value (65504)")
