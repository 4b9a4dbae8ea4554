// ptx.h — the C++ of every inline-PTX template in kernels_cu. cullama/emu/asm.py rewrites each asm statement
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

#undef EMU_SITE_PARAMS
}  // namespace emu_ptx
