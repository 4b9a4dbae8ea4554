// ptx.h — the C++ of every inline-PTX template in kernels_cu. cullama/runtime/emu/asm.py rewrites each asm statement
// into a call of the function its literal template maps to (the table there), with the asm's file and line,
// then its operands in order: outputs ("=" and "+") by reference, inputs by value. Register-only work is done
// here; what touches shared memory, blocks or exchanges between threads goes to the runtime (emu_abi.h).
#pragma once
#include "emu_abi.h"

namespace emu_ptx {

#define EMU_SITE_PARAMS const char *file, int line

// cvt.f32.f16 / cvt.rn.f16.f32 / cvt.rn.f16x2.f32 (first source to the upper half) / ex2.approx.ftz.f32
inline void cvt_f32_f16(EMU_SITE_PARAMS, float& d, unsigned short h) { d = emu_h2f(h); }
inline void cvt_rn_f16_f32(EMU_SITE_PARAMS, unsigned short& d, float f) { d = emu_f2h(f); }
inline void cvt_rn_f16x2_f32(EMU_SITE_PARAMS, unsigned& d, float hi, float lo) {
    d = (unsigned)emu_f2h(lo) | ((unsigned)emu_f2h(hi) << 16);
}

inline float flush_subnormal(float x) {  // .ftz: subnormal inputs and results are +-0
    return (emu_float_bits(x) & 0x7f800000u) == 0 ? emu_bits_float(emu_float_bits(x) & 0x80000000u) : x;
}
inline void ex2_approx_ftz_f32(EMU_SITE_PARAMS, float& y, float x) { y = flush_subnormal(__builtin_exp2f(flush_subnormal(x))); }

// Global loads: plain host loads, with the PTX alignment rule checked (a misaligned vector load faults).
inline void check_aligned(EMU_SITE_PARAMS, const void* p, unsigned long long bytes, const char* what) {
    if ((unsigned long long)p % bytes) emu_fail(file, line, "%s of %p: not %llu-byte aligned", what, p, bytes);
}
inline void ld_global_nc_v4_u32(EMU_SITE_PARAMS, unsigned& a, unsigned& b, unsigned& c, unsigned& d, const void* p) {
    check_aligned(file, line, p, 16, "ld.global.nc.v4.u32");
    emu_read_only_load(p, 16);
    const unsigned* w = (const unsigned*)p;
    a = w[0], b = w[1], c = w[2], d = w[3];
}
inline void ld_global_cg_f32(EMU_SITE_PARAMS, float& d, const void* p) {
    check_aligned(file, line, p, 4, "ld.global.cg.f32");
    d = *(const float*)p;
}
inline void ld_global_cg_v2_f32(EMU_SITE_PARAMS, float& x, float& y, const void* p) {
    check_aligned(file, line, p, 8, "ld.global.cg.v2.f32");
    x = ((const float*)p)[0], y = ((const float*)p)[1];
}

// griddepcontrol: blocks run after the whole previous launch here, so waiting and releasing are no-ops.
inline void griddepcontrol_wait(EMU_SITE_PARAMS) {}
inline void griddepcontrol_launch_dependents(EMU_SITE_PARAMS) {}

// The empty template `asm volatile("" : "+f"(x) :: "memory")`: a compiler barrier, nothing to execute.
inline void compiler_barrier(EMU_SITE_PARAMS, float&) {}

// Shared memory and asynchronous copies (runtime.cpp keeps the per-thread groups).
inline void cvta_to_shared(EMU_SITE_PARAMS, unsigned& a, const void* p) { a = emu_shared_address(p, file, line); }
inline void cp_async_cg_16(EMU_SITE_PARAMS, unsigned dst, const void* src, unsigned src_size) {
    emu_cp_async(dst, src, src_size, file, line);
}
inline void cp_async_commit_group(EMU_SITE_PARAMS) { emu_cp_async_commit(); }
inline void cp_async_wait_group(EMU_SITE_PARAMS, int pending) { emu_cp_async_wait(pending, file, line); }
inline void fence_proxy_async_shared_cta(EMU_SITE_PARAMS) { emu_fence_proxy_async(); }

// Warp-collective matrix loads and products: all 32 lanes meet in the runtime.
inline void ldmatrix_x4(EMU_SITE_PARAMS, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    unsigned r[4];
    emu_ldmatrix_x4(r, addr, 0, file, line);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldmatrix_x4_trans(EMU_SITE_PARAMS, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                              unsigned addr) {
    unsigned r[4];
    emu_ldmatrix_x4(r, addr, 1, file, line);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void mma_m16n8k16_f32_f16(EMU_SITE_PARAMS, float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                 unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    float d[4] = {d0, d1, d2, d3};
    const unsigned a[4] = {a0, a1, a2, a3};
    emu_mma_m16n8k16(d, a, b0, b1, file, line);
    d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
}

// wgmma: warpgroup-collective; mma_async takes the N / 2 accumulator registers, then the two descriptors and
// the scale-d operand. The runtime keeps the registers' addresses until the wait_group that retires them.
inline void wgmma_fence(EMU_SITE_PARAMS) { emu_wgmma_sync(0, 0, file, line); }
inline void wgmma_commit_group(EMU_SITE_PARAMS) { emu_wgmma_sync(1, 0, file, line); }
inline void wgmma_wait_group(EMU_SITE_PARAMS, int pending) { emu_wgmma_sync(2, pending, file, line); }

template <int N>
struct Wgmma {
    float* acc[N / 2];
    int filled = 0;
    unsigned long long tail[3];
    int tail_filled = 0;
    void take(float& r) { acc[filled++] = &r; }
    void take(unsigned long long v) { tail[tail_filled++] = v; }
    void take(int v) { tail[tail_filled++] = (unsigned long long)v; }
};
template <int N, class... Ops>
inline void wgmma_m64k16_f32_f16(EMU_SITE_PARAMS, Ops&&... ops) {
    static_assert(sizeof...(Ops) == N / 2 + 3, "N / 2 accumulators, two descriptors, scale-d");
    Wgmma<N> w;
    (w.take(ops), ...);
    emu_wgmma_mma(N, w.acc, w.tail[0], w.tail[1], (int)w.tail[2], file, line);
}
template <class... Ops> inline void wgmma_m64n64k16_f32_f16(EMU_SITE_PARAMS, Ops&&... ops) { wgmma_m64k16_f32_f16<64>(file, line, ops...); }
template <class... Ops> inline void wgmma_m64n128k16_f32_f16(EMU_SITE_PARAMS, Ops&&... ops) { wgmma_m64k16_f32_f16<128>(file, line, ops...); }
template <class... Ops> inline void wgmma_m64n192k16_f32_f16(EMU_SITE_PARAMS, Ops&&... ops) { wgmma_m64k16_f32_f16<192>(file, line, ops...); }
template <class... Ops> inline void wgmma_m64n256k16_f32_f16(EMU_SITE_PARAMS, Ops&&... ops) { wgmma_m64k16_f32_f16<256>(file, line, ops...); }

// -- quantized weights (kernels_cu/dequant.cuh): integer and FP16x2 register operations, as the PTX ISA defines
// them for every operand value (tests/runtime/emu/test_emu_quant_ptx.py checks each exhaustively or by truth table).
// lop3.b32: bit i of d is bit (a_i << 2 | b_i << 1 | c_i) of the 8-bit immLut.
inline void lop3_b32(EMU_SITE_PARAMS, unsigned& d, unsigned a, unsigned b, unsigned c, int lut) {
    unsigned r = 0;
    for (int m = 0; m < 8; ++m)  // minterm m = (a, b, c) bits: every bit position where the inputs read m
        if ((lut >> m) & 1) r |= (m & 4 ? a : ~a) & (m & 2 ? b : ~b) & (m & 1 ? c : ~c);
    d = r;
}

// prmt.b32, default mode: nibble i of the selector (low 16 bits) picks byte i of d from the 8 bytes {b, a}
// (a = bytes 0..3, b = 4..7) by its low 3 bits; with its high bit set, that byte's sign bit fills all 8 bits.
inline void prmt_b32(EMU_SITE_PARAMS, unsigned& d, unsigned a, unsigned b, int selector) {
    const unsigned long long bytes = (unsigned long long)b << 32 | a;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned s = ((unsigned)selector >> (4 * i)) & 0xFu, byte = (unsigned)(bytes >> (8 * (s & 7u))) & 0xFFu;
        r |= (s & 8u ? (byte & 0x80u ? 0xFFu : 0u) : byte) << (8 * i);
    }
    d = r;
}

// mov.b32 {lo, hi}, a; mov.b32 d, {hi, hi} (or {lo, lo}): a half of a in both halves of d
inline void hi_x2(EMU_SITE_PARAMS, unsigned& d, unsigned a) { d = (a >> 16) | (a & 0xFFFF0000u); }
inline void lo_x2(EMU_SITE_PARAMS, unsigned& d, unsigned a) { d = (a & 0xFFFFu) | (a << 16); }

// binary16 of a double holding an exact sum or product of two halves, rounded to nearest even (overflow: inf;
// subnormal results kept: no .ftz). NaN results are the canonical NaN 0x7FFF, as the GPU's FP16 units give.
inline unsigned short f16_rn(double v) {
    if (v != v) return 0x7fffu;
    const unsigned short sign = __builtin_signbit(v) ? 0x8000u : 0u;
    const double a = __builtin_fabs(v);
    if (a >= 65520.0) return sign | 0x7c00u;  // the rounding boundary above 65504: inf (and inf itself)
    int e;
    __builtin_frexp(a, &e);                                          // 2^(e-1) <= a < 2^e
    const double ulp = __builtin_ldexp(1.0, e - 11 < -24 ? -24 : e - 11);  // a half's spacing there (2^-24 lowest)
    const double r = __builtin_rint(a / ulp) * ulp;                  // ties to even; exact: a power-of-two scale
    return sign | emu_f2h((float)r);                                 // r is a half: converted exactly
}

inline double f16_value(unsigned short h) { return (double)emu_h2f(h); }

// f16x2 add / sub / mul with .rn: each 16-bit half on its own. A sum or difference of two halves, and a product,
// is exact in double, so f16_rn rounds once, as the hardware does.
enum F16x2Op { F16X2_ADD, F16X2_SUB, F16X2_MUL };
inline unsigned f16x2(F16x2Op op, unsigned a, unsigned b) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        const double x = f16_value((unsigned short)(a >> 16 * h)), y = f16_value((unsigned short)(b >> 16 * h));
        const double v = op == F16X2_ADD ? x + y : op == F16X2_SUB ? x - y : x * y;
        r |= (unsigned)f16_rn(v) << 16 * h;
    }
    return r;
}
inline void add_rn_f16x2(EMU_SITE_PARAMS, unsigned& d, unsigned a, unsigned b) { d = f16x2(F16X2_ADD, a, b); }
inline void sub_rn_f16x2(EMU_SITE_PARAMS, unsigned& d, unsigned a, unsigned b) { d = f16x2(F16X2_SUB, a, b); }
inline void mul_rn_f16x2(EMU_SITE_PARAMS, unsigned& d, unsigned a, unsigned b) { d = f16x2(F16X2_MUL, a, b); }

#undef EMU_SITE_PARAMS
}  // namespace emu_ptx
