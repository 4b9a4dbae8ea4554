// mma.cuh — the tensor-core and asynchronous-copy primitives the prefill kernels share (gemm.cu,
// gemm_wgmma.cu, attention_mma.cu): shared-memory addresses, 16-byte cp.async with zero fill, ldmatrix,
// mma.sync m16n8k16 (fragment layouts: gemm.cu's header) and coherent loads of split-K partials.
#pragma once
#include "common.cuh"

// Shared address (32-bit, .shared window) of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    uint32_t a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, bypassing L1 (.cg). valid == false copies 0 source bytes and fills the
// 16 destination bytes with zeros (src must still be a valid address; callers pass the base).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// Four 8 x 8 b16 matrices from shared memory: lanes 8j..8j+7 give the row addresses of matrix j; each
// lane receives, in register j, row lane / 4, elements 2 (lane % 4) and +1 of matrix j (.trans: column).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += A (16 x 16) · B (16 x 8), FP16 inputs, FP32 accumulators (layouts in gemm.cu's header). volatile, as
// CUTLASS's: a warp-collective .sync.aligned instruction, which the compiler must never move (under a branch,
// across a barrier) or merge with another, whatever its operands.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats written by another block of this launch (8-byte aligned): ld.global.cg bypasses L1, as
// load_coherent in common.cuh. asm volatile with a memory clobber (unlike __ldcg) so that the compiler
// never moves it above the arrival barrier and fence (ptxas remains free to batch a partial's loads).
__device__ __forceinline__ float2 load_coherent2(const float2* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
    return v;
}
