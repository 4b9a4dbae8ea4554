// dequant.cuh — INT4 / INT8 weight codes to FP16 in registers, in cullama/model/quant.py's device format; shared by
// gemv_mma.cu (decode: FP16 B fragments for mma) and gemm_quant.cu (prefill: FP16 tiles for mma).
//
// A 32-bit word of qweight holds 32 / BITS codes interleaved (quant.py ORDER) so that codes 2s and 2s + 1 sit in
// the low and high 16-bit halves of one masked word. Put next to the exponent of FP16 1024 (0x6400, whose ulp is
// 1), each half reads as the FP16 value 1024 + q exactly; subtracting the pair (1024 + zero, 1024 + zero) leaves
// q - zero exactly (an integer of magnitude <= 256). Per pair of codes that is one lop3 or prmt and one FP16x2
// subtraction, where a conversion per code (I2F) would cost a quarter-rate instruction each:
//   4 bits: pair s = lop3(w >> 4s, 0x000F000F, 0x64006400) = ((w >> 4s) & 0x000F000F) | 0x64006400,  s = 0..3
//   8 bits: pair s = prmt(w, 0x64646464): bytes s and s + 2 of w, each under a byte 0x64,             s = 0..1
// Templates take the code width as CODE_BITS (the kernels define BITS as a macro). The executor maps the inline PTX
// below (cullama/runtime/emu/ptx.h, "quantized weights" section).
#pragma once
#include "common.cuh"

#define FP16_1024X2 0x64006400u  // FP16 1024 in both halves

// (a & b) | c in one instruction: lop3's immLut is the truth table of F(a, b, c) over a = 0xF0, b = 0xCC, c = 0xAA.
#define LUT_A_AND_B_OR_C 0xEA

template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
    return d;
}

// Byte permute (the default mode): byte i of the result is byte (SEL >> 4i) & 7 of {b, a} (a = bytes 0..3).
template <int SEL>
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "n"(SEL));
    return d;
}

// FP16x2 arithmetic, each half rounded to nearest even (exact where the kernels use it, except hmul2's product).
__device__ __forceinline__ uint32_t hadd2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// A word's high (low) half in both halves, as two 16-bit moves: ptxas folds them into the FP16x2 instruction that
// reads the result (its operand selector .H1_H1 / .H0_H0), where a prmt stays an instruction of its own (4 an
// iteration of gemv_mma.cu's INT4 loop at 16 rows, 0.06 lane-instructions a weight byte).
__device__ __forceinline__ uint32_t hi_x2(uint32_t a) {
    uint32_t d;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; mov.b32 %0, {hi, hi}; }" : "=r"(d) : "r"(a));
    return d;
}

__device__ __forceinline__ uint32_t lo_x2(uint32_t a) {
    uint32_t d;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; mov.b32 %0, {lo, lo}; }" : "=r"(d) : "r"(a));
    return d;
}

// A group's (scale, zero) word of qparams (scale in the low half) -> (1024 + zero) in both halves: exact, as
// zero <= 256 is an integer and FP16's ulp is 1 from 1024 to 2048.
__device__ __forceinline__ uint32_t zero_bias(uint32_t params) { return hadd2(hi_x2(params), FP16_1024X2); }

// The scale in both halves (gemm_quant's FP16 multiply).
__device__ __forceinline__ uint32_t scale_x2(uint32_t params) { return lo_x2(params); }

// Codes 2s and 2s + 1 of word w as the FP16 pair (q - zero) (low half: code 2s), s = 0 .. 16 / CODE_BITS - 1: a
// constant once the callers' loops are unrolled (prmt's selector must be an immediate).
template <int CODE_BITS>
__device__ __forceinline__ uint32_t code_pair(uint32_t w, uint32_t bias, int s) {
    static_assert(CODE_BITS == 4 || CODE_BITS == 8, "4- or 8-bit codes");
    uint32_t biased;  // (1024 + q[2s], 1024 + q[2s + 1])
    if constexpr (CODE_BITS == 4) {
        biased = lop3<LUT_A_AND_B_OR_C>(w >> (4 * s), 0x000F000Fu, FP16_1024X2);
    } else {
        biased = s == 0 ? prmt<0x4240>(w, 0x64646464u) : prmt<0x4341>(w, 0x64646464u);
    }
    return hsub2(biased, bias);
}

// 4 bits, one shift a word (Marlin's dequantization, exact as code_pair<4>): pairs 0 and 2 (bits 0-3 | 16-19 of w and
// of w >> 8) under the exponent of 1024 as above; pairs 1 and 3 (bits 4-7 | 20-23) masked in place under the exponent
// of FP16 64 (0x5400, whose ulp is 1/16), so that bits 4-7 read as 64 + q exactly, less (64 + zero) (bias64).
#define FP16_64X2 0x54005400u  // FP16 64 in both halves

__device__ __forceinline__ uint32_t zero_bias64(uint32_t params) { return hadd2(hi_x2(params), FP16_64X2); }

// Pair s (0..3) of word w as code_pair<4>(w, bias, s), given w8 = w >> 8 (shared by pairs 2 and 3).
__device__ __forceinline__ uint32_t code_pair4(uint32_t w, uint32_t w8, uint32_t bias, uint32_t bias64, int s) {
    const uint32_t src = s < 2 ? w : w8;
    return s % 2 == 0 ? hsub2(lop3<LUT_A_AND_B_OR_C>(src, 0x000F000Fu, FP16_1024X2), bias)
                      : hsub2(lop3<LUT_A_AND_B_OR_C>(src, 0x00F000F0u, FP16_64X2), bias64);
}

// A word's codes (32 / CODE_BITS of them) as FP16 pairs (q - zero): pairs[s] holds codes 2s and 2s + 1.
template <int CODE_BITS>
__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t bias, uint32_t (&pairs)[16 / CODE_BITS]) {
#pragma unroll
    for (int s = 0; s < 16 / CODE_BITS; ++s) pairs[s] = code_pair<CODE_BITS>(w, bias, s);
}
