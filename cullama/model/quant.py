"""The quantized weight format on the device: how INT4 and INT8 weights are packed for the kernels.

Every quantized source (AWQ and GPTQ checkpoints, quantizing an FP16 checkpoint on load) ends in this one
layout; the kernels (kernels_cu/gemv_mma.cu, gemm_quant.cu) and their twins know only it. A quantized
linear W [M, K] (M output rows, K inputs; the FP16 layout's [M, K] row-major, fused q|k|v and gate|up rows
stacked the same way) with `bits` in {4, 8} and a group size `group` along K is two device tensors:

    qweight  uint32 [M, K * bits / 32]   row r's codes along K, E = 32 / bits per word: word j holds the codes
                                         of k = j E .. j E + E - 1 in the interleaved order below
    qparams  float16 [M, K / group, 2]   per row and group: (scale, zero), next to each other (one 4-byte load)

    W[r, k] = (q[r, k] - zero[r, k // group]) * scale[r, k // group]

- A code q is unsigned, 0 <= q < 2**bits. A zero is an integer 0 <= zero <= 2**bits (GPTQ's v1 format stores
  zero - 1, so 16 occurs for 4 bits), held exactly by FP16. Symmetric formats use zero = 2**(bits - 1).
- Interleaved order, so that a mask of 0x000F000F (4 bits) or 0x00FF00FF (8 bits) after a shift by s * bits
  gives codes 2s and 2s + 1 in the low and high 16-bit halves: OR-ed into 0x6400 (FP16 1024) each half is
  1024 + q exactly, and subtracting 1024 + zero in FP16 leaves q - zero exactly (integers below 2048).
      4 bits: nibble i (bits 4i .. 4i + 3) holds code ORDER[4][i],  ORDER[4] = 0, 2, 4, 6, 1, 3, 5, 7
      8 bits: byte i (bits 8i .. 8i + 7) holds code ORDER[8][i],    ORDER[8] = 0, 2, 1, 3
  (AWQ's own nibble order is this one; GPTQ packs codes in plain order along K, and the loader repacks.)
- Shape contract: K % VECTOR[bits] == 0 (a 16-byte vector of a row, 32 codes of 4 bits or 16 of 8, is one
  load), group % VECTOR[bits] == 0 and K % group == 0 (a vector lies in one group). A group of K is one group.
- Arithmetic: (q - zero) * scale is exact in float32 (a 9-bit integer times an 11-bit significand), so the
  float32 weight is one value whatever computes it: the decode kernels and `dequantize` agree bit for bit. The
  prefill GEMM feeds the tensor cores FP16: that product rounded to nearest even (`dequantize(..., np.float16)`,
  what __hmul of the two exact FP16 operands gives, and what AutoAWQ's own FP16 dequantization computes).

This module is the format's definition: pack and unpack codes, dequantize, and quantize FP16 weights with
round to nearest (the on-load `--quantize int8 | int4`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BITS = (4, 8)
ORDER = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}  # code index held by nibble / byte i of a word
VECTOR = {4: 32, 8: 16}  # codes per 16-byte vector: the kernels' load, and the least K and group
INT4_GROUP = 128  # on-load int4's group along K (AWQ's and GPTQ's usual choice)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """bits per weight and the group size along K (None in a config: one group per row, group = K)."""

    bits: int
    group: int

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, not {self.bits}")
        if self.group <= 0 or self.group % VECTOR[self.bits]:
            raise ValueError(f"a {self.bits}-bit group must be a positive multiple of {VECTOR[self.bits]}, "
                             f"not {self.group}")

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def check(self, M: int, K: int) -> None:
        """ValueError unless W [M, K] can have this format (see the shape contract)."""
        if M <= 0 or K <= 0 or K % VECTOR[self.bits] or K % self.group:
            raise ValueError(f"a [{M}, {K}] weight cannot be {self.bits}-bit with groups of {self.group}: K must "
                             f"be a multiple of {VECTOR[self.bits]} and of the group")

    def shapes(self, M: int, K: int) -> dict[str, tuple[int, ...]]:
        """The device tensors of W [M, K]: qweight [M, K bits / 32] uint32, qparams [M, K / group, 2] float16."""
        self.check(M, K)
        return {"qweight": (M, K * self.bits // 32), "qparams": (M, K // self.group, 2)}

    def nbytes(self, M: int, K: int) -> int:
        """Bytes a decode step reads for W [M, K]: its codes and its (scale, zero) pairs."""
        return M * K * self.bits // 8 + M * (K // self.group) * 4


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes q [M, K] (integers in [0, 2**bits)) -> qweight [M, K * bits / 32] uint32 in the interleaved order."""
    q = np.asarray(q)
    per_word = 32 // bits
    if q.ndim != 2 or q.shape[1] % per_word:
        raise ValueError(f"codes must be [M, K] with K a multiple of {per_word}, not {list(q.shape)}")
    if q.size and (q.min() < 0 or q.max() >= 1 << bits):
        raise ValueError(f"{bits}-bit codes must lie in [0, {1 << bits})")
    words = q.astype(np.uint32).reshape(q.shape[0], -1, per_word)  # [M, K / E, E]
    out = np.zeros(words.shape[:2], np.uint32)
    for slot, code in enumerate(ORDER[bits]):
        out |= words[:, :, code] << np.uint32(bits * slot)
    return out


def unpack(qweight: np.ndarray, bits: int) -> np.ndarray:
    """qweight [M, K * bits / 32] uint32 -> codes [M, K] uint8: the inverse of pack."""
    qweight = np.asarray(qweight, np.uint32)
    per_word, mask = 32 // bits, np.uint32((1 << bits) - 1)
    out = np.empty((*qweight.shape, per_word), np.uint8)  # [M, K / E, E]
    for slot, code in enumerate(ORDER[bits]):
        out[:, :, code] = (qweight >> np.uint32(bits * slot)) & mask
    return out.reshape(qweight.shape[0], -1)


def params(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """scale [M, G] and zero [M, G] -> qparams [M, G, 2] float16 (scale, zero). Zeros must be integers from 0 to
    256 (FP16 holds them exactly)."""
    z = np.asarray(zero, np.float64)
    if not np.all((z >= 0) & (z <= 256) & (z == np.rint(z))):  # NaN fails every comparison
        raise ValueError("zero points must be integers from 0 to 256")
    out = np.empty((*np.shape(scale), 2), np.float16)
    out[..., 0] = scale
    out[..., 1] = zero
    return out


def dequantize(qweight: np.ndarray, qparams: np.ndarray, bits: int, dtype=np.float32) -> np.ndarray:
    """W [M, K] from the device tensors: float32 exact (the decode kernels' weights), or float16 (that value
    rounded to nearest even: the prefill GEMM's weights)."""
    q = unpack(qweight, bits)  # [M, K]
    M, K = q.shape
    pairs = qparams.astype(np.float32)  # [M, G, 2]
    w = q.reshape(M, pairs.shape[1], -1).astype(np.float32)  # [M, G, group]: each group against its pair
    w -= pairs[..., 1:]
    w *= pairs[..., :1]
    return w.reshape(M, K).astype(dtype, copy=False)


# -- quantizing FP16 weights on load (round to nearest, no calibration) -----------------------------------------
def quantize(w: np.ndarray, fmt: QuantFormat) -> tuple[np.ndarray, np.ndarray]:
    """W [M, K] (FP16 or float32) -> (qweight, qparams) in `fmt`, round to nearest (half to even):
        8 bits: symmetric per group (per output channel when group = K): scale = max|w| / 127, zero = 128;
        4 bits: asymmetric per group, as AWQ stores it: scale = (max - min) / 15, zero = round(-min / scale).
    Codes are computed with the scale as stored (FP16), so dequantize() gives each weight within half a step.
    A group of zeros gets scale 0 (its weights dequantize to 0 exactly)."""
    w = np.asarray(w, np.float32)
    M, K = w.shape
    fmt.check(M, K)
    g = w.reshape(M, K // fmt.group, fmt.group)  # [M, G, group]
    top = (1 << fmt.bits) - 1
    if fmt.bits == 8:
        scale = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float16)  # [M, G]
        zero = np.full(scale.shape, 128, np.float32)
    else:
        lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)  # the range always holds 0
        scale = ((hi - lo) / np.float32(top)).astype(np.float16)  # [M, G]
        s32 = scale.astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(s32 > 0, np.clip(np.rint(-lo / s32), 0, top), 0).astype(np.float32)
    s32 = scale.astype(np.float32)[..., None]  # [M, G, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint(g / s32), 0) + zero[..., None]
    q = np.clip(q, 0, top).astype(np.uint8).reshape(M, K)
    return pack(q, fmt.bits), params(scale, zero)
