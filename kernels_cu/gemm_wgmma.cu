// gemm_wgmma.cu — the prefill (prompt) path's matrix products on Hopper's warpgroup tensor cores (sm_90a).
//
//   gemm_wgmma   C[M, N] = A[M, K] · W[N, K]^T   (+ C when accumulate != 0)
//
// The same function, parameters and contract as gemm (gemm.cu), only a bigger block tile and the wgmma
// path: the plan may launch either. Compiled for the arch-specific target sm_90a only (wgmma.mma_async
// exists nowhere else; cullama/runtime/ops/gemm_wgmma.py sets ARCH_SPECIFIC).
//
// Shapes (as gemm): A (activations, M = prompt rows) and W (weights) FP16 row-major, row stride K, with
// K % 8 == 0 and 16-byte aligned base pointers (every 8-half chunk of a row is one 16-byte copy); C
// float32 row-major, row stride N. Any M >= 1, N >= 1: edge tiles are zero-filled on load (rows past M
// or N, columns past this block's K range) and bounds-checked on store.
//
// Variants (compile-time defines, defaults in brackets; cullama/runtime/ops/gemm_wgmma.py lists those compiled):
//   GW_TILE_N      [192]  block tile N = the wgmma's N (64, 128, 192 or 256): 128 x 192 default, see below
//   GW_WARPGROUPS  [2]    consumer warpgroups: block tile M = 64 x GW_WARPGROUPS, 128 threads each
//   GW_STAGES      [5]    shared-memory ring depth (>= 3): GW_STAGES - 2 K tiles in flight; at most what
//                         fits 227 KB: 5 at 128 x 192, 4 at 128 x 256, 6 at 128 x 128
//   GW_SWIZZLE     [128]  128: the 128-byte-swizzle layout; 0: the interleaved (no-swizzle) core-matrix
//                         layout, kept as a fallback (bank conflicts on the cp.async writes)
// Launch: grid (ceil(N / GW_TILE_N), ceil(M / GW_TILE_M), S), GW_THREADS threads, GW_SMEM_BYTES of DYNAMIC
// shared memory (over 48 KB: the function must first be allowed it, cuFuncSetAttribute(
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), cullama/runtime/backends/func_attr.py). Defaults: 256 threads,
// 5 x (128 + 192) x 128 B + 1024 B of alignment slack = 205824 B; one block per SM.
//
// Why 128 x 192 (LLaMA-2-7B at a 256-row prefill chunk, 132 SMs, one block each): tiles of qkv (N 12288)
// 2 x 64 = 128, gate_up (22016) 2 x 115 = 230 (two waves, 87 % full), o_proj / down (4096) 2 x 22 = 44,
// split 3 ways = 132. 128 x 256 gives 96 / 172 / 32 (73 % / 65 % / split 4) with 25 % less L2 traffic per
// flop; 128 x 128 gives 192 / 344 / 64 with 25 % more. Both are variants, to be settled by measurement.
// Block-to-tile order: the grid's linear block index L = blockIdx.y * gridDim.x + blockIdx.x is the tile
// id (split-K counters and slots), and the tile is (row tile L % gridDim.y, column tile L / gridDim.y),
// so the blocks that share a W column tile run side by side and W streams from HBM about once.
//
// Split-K (S = gridDim.z > 1; deterministic): exactly gemm.cu's protocol with GW_TILE_K = 64. Block z takes K
// range [z Kz, min(K, (z + 1) Kz)), Kz = ceil(K / S) rounded up to a multiple of 64 (a range may be empty:
// its partial is 0). Each block stores its float32 partial tile into `workspace`, __threadfence()s, and
// bumps tile_count[L] once; the block that sees S - 1 sums the S partials in the fixed order z = 0..S-1
// (L1-bypassing loads), adds C when accumulate, stores C and sets tile_count[L] = 0 for the next launch.
// With S = 1 it stores C directly and never touches workspace or tile_count (any valid pointers).
//   workspace (float32, at least S * tiles * GW_TILE_M * GW_TILE_N, tiles = gridDim.x * gridDim.y): the
//   partial of (z, L) is slot z * tiles + L of GW_TILE_M * GW_TILE_N floats, as float2s: float2
//   p * GW_THREADS + threadIdx.x holds acc[2p], acc[2p + 1] of that thread (gw_slot_float2). Writer and
//   reader are the same thread; only float2s with row < M and col < N are written and read.
//   tile_count (uint32, at least tiles elements) is all zero before a launch and after it.
//
// Block: warpgroup g (threads 128 g .. 128 g + 127, i.e. warps 4g .. 4g + 3) owns rows 64 g .. 64 g + 63
// of the tile and all GW_TILE_N columns: per 16 of K one wgmma.mma_async.sync.aligned.m64n<GW_TILE_N>k16
// .f32.f16.f16, A and B both from shared memory through matrix descriptors, GW_TILE_N / 2 float
// accumulators a thread. K advances in tiles of 64 (128 bytes of a row) through a GW_STAGES ring filled
// by every thread with cp.async (16 B, .cg, zero-fill), exactly as gemm.cu. Iteration kt:
//   cp.async.wait_group(STAGES - 3)   this thread's copies of tile kt have landed
//   fence.proxy.async.shared::cta     ... and are visible to the async proxy, which wgmma reads through
//   __syncthreads()                   everyone's copies landed; every warpgroup has retired tile kt - 2
//   wgmma.fence; 4 x wgmma (the k16 steps of tile kt); wgmma.commit_group
//   cp.async tile kt + STAGES - 2 into the slot of tile kt - 2; commit (an empty group past the end)
//   wgmma.wait_group(1)                tile kt - 1 is done (tile kt may still run)
// so the tensor cores always hold one queued group (tile kt - 1 runs while tile kt is issued) and
// STAGES - 2 tiles of loads are in flight. Every warpgroup issues its wgmma even when its 64 rows all lie
// at or past M (they are zeros, never stored): under a branch that ptxas cannot prove warpgroup-uniform
// it serializes every wgmma of the kernel (C7518, "wgmma.mma_async instructions are serialized"), which
// tests/runtime/ops/test_gemm_wgmma.py checks the compile log for.
//
// Section numbers below are those of PTX ISA 9.0 (they move between versions; the titles do not).
// Shared-memory layout (PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix Layout", K-major, both operands): the
// dynamic buffer is aligned up to 1024 B at run time; stage s holds the A tile (GW_TILE_M rows) then the W
// tile (GW_TILE_N rows), each row 64 halves = 128 B, every tile 1024-aligned (gw_a_base, gw_w_base).
//   GW_SWIZZLE 128: row r at byte 128 r; its 16-byte chunk c (k = 8c .. 8c + 7) at ((c ^ (r % 8)) << 4)
//     (gw_chunk_offset). Eight rows make one 1024-byte swizzle atom, 1024-aligned (the repeating pattern
//     starts on a 1024-byte boundary, so the descriptor's base offset is 0).
//   GW_SWIZZLE 0: core matrix (8 rows x 16 B, rows 16 B apart) of row group r / 8 and chunk c at byte
//     1024 (r / 8) + 128 c, row r % 8 at 16 (r % 8) inside it.
// Matrix descriptor (PTX ISA 9.7.15.5.1.2.2 "Matrix Descriptor Format"; gw_desc): bits 0-13 start address
// >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 base
// offset (0), 62-63 swizzle mode (1 = 128-byte swizzle, 0 = none). Canonical K-major layouts (in 16-byte
// units, T = 8 halves; cute's make_gmma_desc writes the same): 128B swizzle ((8,m),2):((8,SBO),1) then
// Swizzle<3,4,3> on the byte address (bits 4-6 ^= bits 7-9): row i of the operand at start + (i / 8) SBO
// + (i % 8) 128, its two k chunks 16 B apart, LBO unused ("assumed 1"), SBO = 1024 (one atom). No
// swizzle ((8,m),2):((1,SBO),LBO): LBO = 128 (the next k chunk's core matrix), SBO = 1024.
//   Warpgroup g's A operand of k16 step j: start = A tile + 64 g rows (8192 B, 8 atoms) + 32 j bytes (128B
//   swizzle: the hardware adds the row and chunk offsets, then XORs the absolute address, so advancing
//   the start by 32 B selects chunks 2j, 2j + 1 of every row) or + 256 j (no swizzle: two core matrices).
//   B operand of step j: W tile + the same k offset, GW_TILE_N rows. tests/runtime/ops/test_gemm_wgmma.py compiles the
//   block marked "layout" below on the host and checks, for every element of every operand of every k16
//   step, that the byte the descriptor makes the tensor core read is the byte this kernel's cp.async wrote.
// Accumulators (PTX ISA 9.7.15.5.1.1.1, "WGMMA .m64nNk16 register fragment layout for accumulator
// matrix D"), thread t of warpgroup g, lane l = t % 32, warp w = (t / 32) % 4, register j < GW_TILE_N / 2:
//   row 64 g + 16 w + l / 4 + 8 ((j / 2) % 2), column 8 (j / 4) + 2 (l % 4) + j % 2   (gw_acc_row/col)
// so acc[2p], acc[2p + 1] are two adjacent columns of one row (a float2 of the workspace).
#include "mma.cuh"

// ---- layout: begin (plain C++; tests/runtime/ops/test_gemm_wgmma.py compiles this block on the host) -------------
#ifndef GW_TILE_N
#define GW_TILE_N 192
#endif
#ifndef GW_WARPGROUPS
#define GW_WARPGROUPS 2
#endif
#ifndef GW_STAGES
#define GW_STAGES 5
#endif
#ifndef GW_SWIZZLE
#define GW_SWIZZLE 128
#endif
#ifndef GW_FN
#define GW_FN __device__ __forceinline__
#endif

#define GW_TILE_M (64 * GW_WARPGROUPS)   // TILE_M in cullama/runtime/ops/gemm_wgmma.py
#define GW_THREADS (128 * GW_WARPGROUPS) // THREADS
#define GW_TILE_K 64                     // K per stage: one 128-byte row (the 128-byte swizzle width)
#define GW_ROW_BYTES 128
#define GW_A_BYTES (GW_TILE_M * GW_ROW_BYTES)
#define GW_W_BYTES (GW_TILE_N * GW_ROW_BYTES)
#define GW_STAGE_BYTES (GW_A_BYTES + GW_W_BYTES)
#define GW_SMEM_BYTES (GW_STAGES * GW_STAGE_BYTES + 1024)  // + slack to align the buffer to 1024 B
#define GW_A_COPIES (GW_TILE_M * 8 / GW_THREADS)            // 16-byte copies per thread per stage: 4
#define GW_W_COPIES (GW_TILE_N * 8 / GW_THREADS)
#define GW_ACC (GW_TILE_N / 2)                             // float accumulators per thread
#define GW_KSTEP_BYTES (GW_SWIZZLE == 128 ? 32 : 256)      // descriptor start advance per k16 step

static_assert(GW_TILE_N % 64 == 0 && GW_TILE_N >= 64 && GW_TILE_N <= 256, "GW_TILE_N: 64, 128, 192 or 256");
static_assert(GW_WARPGROUPS == 1 || GW_WARPGROUPS == 2, "GW_WARPGROUPS: 1 or 2");
static_assert(GW_STAGES >= 3, "GW_STAGES >= 3: tiles kt - 1 (in the tensor cores) and kt, and one loading");
static_assert(GW_SWIZZLE == 128 || GW_SWIZZLE == 0, "GW_SWIZZLE: 128 or 0");
static_assert(GW_SMEM_BYTES <= 232448, "an H100 / H200 block has at most 227 KB of shared memory");

// Byte offset, from a 1024-aligned tile base, of the 16-byte chunk `chunk` (k = 8 chunk .. 8 chunk + 7
// of this K tile) of tile row `row` (see the header).
GW_FN uint32_t gw_chunk_offset(int row, int chunk) {
#if GW_SWIZZLE == 128
    return (uint32_t)(row * GW_ROW_BYTES + ((chunk ^ (row & 7)) << 4));
#else
    return (uint32_t)((row >> 3) * 1024 + chunk * 128 + (row & 7) * 16);
#endif
}

// Shared addresses of stage `stage`'s A and W tiles; `smem` is the 1024-aligned buffer start.
GW_FN uint32_t gw_a_base(uint32_t smem, int stage) { return smem + (uint32_t)(stage * GW_STAGE_BYTES); }
GW_FN uint32_t gw_w_base(uint32_t smem, int stage) {
    return smem + (uint32_t)(stage * GW_STAGE_BYTES + GW_A_BYTES);
}

// 64-bit wgmma matrix descriptor of a K-major operand starting at shared address `addr`.
GW_FN uint64_t gw_desc(uint32_t addr) {
#if GW_SWIZZLE == 128
    const uint64_t lbo = 16, sbo = 1024, mode = 1;  // LBO unused by swizzled K-major layouts: encoded 1
#else
    const uint64_t lbo = 128, sbo = 1024, mode = 0;
#endif
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (mode << 62);
}

// Descriptors of k16 step `ks` (0..3) of a stage: warpgroup `wg`'s 64 rows of A, and all of W.
GW_FN uint64_t gw_a_desc(uint32_t a_base, int wg, int ks) {
    return gw_desc(a_base + (uint32_t)(wg * 64 * GW_ROW_BYTES + ks * GW_KSTEP_BYTES));
}
GW_FN uint64_t gw_w_desc(uint32_t w_base, int ks) { return gw_desc(w_base + (uint32_t)(ks * GW_KSTEP_BYTES)); }

// Copy `i` of thread `tid` in a stage: tile row and chunk (A: i < GW_A_COPIES; W: i < GW_W_COPIES). Eight
// consecutive threads read one row's 128 contiguous bytes.
GW_FN int gw_load_row(int tid, int i) { return (tid + i * GW_THREADS) >> 3; }
GW_FN int gw_load_chunk(int tid) { return tid & 7; }

// Tile row and column of accumulator register j of thread tid (the PTX fragment layout; see the header).
GW_FN int gw_acc_row(int tid, int j) {
    return (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2) + ((j >> 1) & 1) * 8;
}
GW_FN int gw_acc_col(int tid, int j) { return (j >> 2) * 8 + (tid & 3) * 2 + (j & 1); }

// The float2 of a split-K workspace slot that holds acc[2p], acc[2p + 1] of thread tid.
GW_FN int gw_slot_float2(int tid, int p) { return p * GW_THREADS + tid; }

// Tile of linear block index `linear` (< tiles_m * tiles_n): row tiles vary fastest (see the header).
GW_FN int gw_tile_m(int linear, int tiles_m) { return linear % tiles_m; }
GW_FN int gw_tile_n(int linear, int tiles_m) { return linear / tiles_m; }

// K range [*k0, *k1) of split z of `splits` (empty when *k0 == *k1).
GW_FN void gw_k_range(int K, int splits, int z, int* k0, int* k1) {
    const int kz = ((K + splits - 1) / splits + GW_TILE_K - 1) / GW_TILE_K * GW_TILE_K;
    *k0 = z * kz < K ? z * kz : K;
    *k1 = *k0 + kz < K ? *k0 + kz : K;
}
// ---- layout: end -----------------------------------------------------------------------------------------

// This thread's completed shared-memory writes (generic proxy: cp.async) become visible to the async
// proxy (wgmma operand reads). Each writing thread issues it before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// wgmma.fence: orders this warpgroup's earlier register accesses (the accumulators: zeroed, or read by
// nothing else) before the wgmma.mma_async that follow. Warpgroup-wide, like the next two.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(pending) : "memory");
}

// Ties the accumulators to the asm statements around it, so that the compiler neither reads them
// before wgmma.wait_group nor moves their zeroing past wgmma.fence.
__device__ __forceinline__ void fence_operands(float (&d)[GW_ACC]) {
#pragma unroll
    for (int j = 0; j < GW_ACC; ++j) asm volatile("" : "+f"(d[j])::"memory");
}

// The accumulator operand list of one m64n<GW_TILE_N>k16 wgmma: GW_ACC "+f" registers, then the two
// descriptors (and scale-d = 1: D = A B + D). PTX operand numbers are spelled out per tile width.
#define GW_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define GW_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define GW_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define GW_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define GW_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define GW_R5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define GW_R6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define GW_R7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define GW_F16(d, b)                                                                                        \
    "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]),         \
        "+f"(d[b + 6]), "+f"(d[b + 7]), "+f"(d[b + 8]), "+f"(d[b + 9]), "+f"(d[b + 10]), "+f"(d[b + 11]),   \
        "+f"(d[b + 12]), "+f"(d[b + 13]), "+f"(d[b + 14]), "+f"(d[b + 15])
#if GW_TILE_N == 64
#define GW_REGS GW_R0 ", " GW_R1
#define GW_TAIL "%32, %33, p, 1, 1, 0, 0;\n" // descriptors A, B; scale-d; scale-a, -b = 1; no transposes
#define GW_SCALE "%34"
#define GW_OPERANDS(d) GW_F16(d, 0), GW_F16(d, 16)
#elif GW_TILE_N == 128
#define GW_REGS GW_R0 ", " GW_R1 ", " GW_R2 ", " GW_R3
#define GW_TAIL "%64, %65, p, 1, 1, 0, 0;\n"
#define GW_SCALE "%66"
#define GW_OPERANDS(d) GW_F16(d, 0), GW_F16(d, 16), GW_F16(d, 32), GW_F16(d, 48)
#elif GW_TILE_N == 192
#define GW_REGS GW_R0 ", " GW_R1 ", " GW_R2 ", " GW_R3 ", " GW_R4 ", " GW_R5
#define GW_TAIL "%96, %97, p, 1, 1, 0, 0;\n"
#define GW_SCALE "%98"
#define GW_OPERANDS(d) GW_F16(d, 0), GW_F16(d, 16), GW_F16(d, 32), GW_F16(d, 48), GW_F16(d, 64), GW_F16(d, 80)
#else
#define GW_REGS GW_R0 ", " GW_R1 ", " GW_R2 ", " GW_R3 ", " GW_R4 ", " GW_R5 ", " GW_R6 ", " GW_R7
#define GW_TAIL "%128, %129, p, 1, 1, 0, 0;\n"
#define GW_SCALE "%130"
#define GW_OPERANDS(d)                                                                                      \
    GW_F16(d, 0), GW_F16(d, 16), GW_F16(d, 32), GW_F16(d, 48), GW_F16(d, 64), GW_F16(d, 80), GW_F16(d, 96), \
        GW_F16(d, 112)
#endif
#define GW_STR2(x) #x
#define GW_STR(x) GW_STR2(x)

// d (64 x GW_TILE_N of this warpgroup) += A (64 x 16, K-major, descriptor da) · B (16 x GW_TILE_N, K-major:
// W rows, descriptor db). Asynchronous: complete only after wgmma.commit_group + wgmma.wait_group.
__device__ __forceinline__ void wgmma_k16(float (&d)[GW_ACC], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, " GW_SCALE ", 0;\n"
        "wgmma.mma_async.sync.aligned.m64n" GW_STR(GW_TILE_N) "k16.f32.f16.f16 {" GW_REGS "}, " GW_TAIL "}\n"
        : GW_OPERANDS(d)
        : "l"(da), "l"(db), "r"(1)
        : "memory");
}

// Issue the cp.asyncs of K tile `kt` (columns k0 + 64 kt ..) of one operand into the tile at shared address
// `dst`: rows r0 .. of `src` (A: M rows from m0, GW_A_COPIES copies a thread; W: N rows from n0, GW_W_COPIES),
// zero-filled past `rows` or this block's K range end k1 (K % 8 == 0, k0 and k1 multiples of 8: a 16-byte
// chunk is wholly in or out).
template <int COPIES>
__device__ __forceinline__ void load_operand(uint32_t dst, const half_t* __restrict__ src, int rows, int r0, int kt,
                                             int K, int k0, int k1) {
    const int tid = threadIdx.x, chunk = gw_load_chunk(tid);
    const int k = k0 + kt * GW_TILE_K + chunk * 8;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
        const int row = gw_load_row(tid, i);
        const bool ok = k < k1 && r0 + row < rows;
        cp_async16(dst + gw_chunk_offset(row, chunk), ok ? src + (size_t)(r0 + row) * K + k : src, ok);
    }
}

__device__ __forceinline__ void load_tile_a(uint32_t smem, int stage, int kt, const half_t* __restrict__ A,
                                            int M, int K, int k0, int k1, int m0) {
    load_operand<GW_A_COPIES>(gw_a_base(smem, stage), A, M, m0, kt, K, k0, k1);
}

__device__ __forceinline__ void load_tile_w(uint32_t smem, int stage, int kt, const half_t* __restrict__ W,
                                            int N, int K, int k0, int k1, int n0) {
    load_operand<GW_W_COPIES>(gw_w_base(smem, stage), W, N, n0, kt, K, k0, k1);
}

extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
gemm_wgmma(const half_t* __restrict__ A, const half_t* __restrict__ W, float* __restrict__ C, float* workspace,
           unsigned int* tile_count, int M, int N, int K, int accumulate) {
    extern __shared__ __align__(16) unsigned char gw_dynamic_smem[];
    __shared__ bool is_last;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    const uint32_t smem = (smem_addr(gw_dynamic_smem) + 1023u) & ~1023u;  // the swizzle atoms need 1024 B
    const int tid = threadIdx.x, wg = tid / 128;
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    const int m0 = gw_tile_m(tile, gridDim.y) * GW_TILE_M, n0 = gw_tile_n(tile, gridDim.y) * GW_TILE_N;
    const int splits = gridDim.z;
    int k0, k1;
    gw_k_range(K, splits, blockIdx.z, &k0, &k1);
    const int n_ktiles = (k1 - k0 + GW_TILE_K - 1) / GW_TILE_K;

    float acc[GW_ACC];
#pragma unroll
    for (int j = 0; j < GW_ACC; ++j) acc[j] = 0.f;
    fence_operands(acc);

    // Prologue: tiles 0 .. STAGES-3 in flight, one commit group each (empty groups keep the count uniform).
    // Their W halves go first, before pdl_wait() (weights: they may stream while the kernel before this
    // one finishes), then A; group 0 holds every prologue W copy, so tile st is complete with group st.
#pragma unroll
    for (int st = 0; st < GW_STAGES - 2; ++st)
        if (st < n_ktiles) load_tile_w(smem, st, st, W, N, K, k0, k1, n0);
    pdl_wait();  // everything below may read what the previous kernel wrote
#pragma unroll
    for (int st = 0; st < GW_STAGES - 2; ++st) {
        if (st < n_ktiles) load_tile_a(smem, st, st, A, M, K, k0, k1, m0);
        cp_async_commit();
    }

    for (int kt = 0; kt < n_ktiles; ++kt) {
        // Groups committed so far: STAGES - 2 + kt; tile kt is group kt.
        cp_async_wait<GW_STAGES - 3>();
        fence_proxy_async();
        __syncthreads();  // tile kt is in shared memory; every warpgroup's wgmma of tile kt - 2 completed
        const int stage = kt % GW_STAGES;
        const uint32_t a = gw_a_base(smem, stage), w = gw_w_base(smem, stage);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < GW_TILE_K / 16; ++ks) wgmma_k16(acc, gw_a_desc(a, wg, ks), gw_w_desc(w, ks));
        wgmma_commit();
        // While the tensor cores work on tiles kt - 1 and kt: tile kt + STAGES - 2 into the slot of tile kt - 2.
        const int next = kt + GW_STAGES - 2;
        if (next < n_ktiles) {
            load_tile_a(smem, next % GW_STAGES, next, A, M, K, k0, k1, m0);
            load_tile_w(smem, next % GW_STAGES, next, W, N, K, k0, k1, n0);
        }
        cp_async_commit();
        wgmma_wait<1>();  // tile kt - 1's products are done: its slot may be refilled after the next barrier
    }
    wgmma_wait<0>();
    fence_operands(acc);
    // Only empty cp.async groups can still be pending; no thread reads the ring again.

    // Epilogue: acc[j] is C[m0 + gw_acc_row(tid, j)][n0 + gw_acc_col(tid, j)].
    if (splits == 1) {
#pragma unroll
        for (int j = 0; j < GW_ACC; ++j) {
            const int row = m0 + gw_acc_row(tid, j), col = n0 + gw_acc_col(tid, j);
            if (row < M && col < N) {
                float* c = C + (size_t)row * N + col;
                *c = accumulate ? *c + acc[j] : acc[j];
            }
        }
        return;
    }

    // Split-K: this block's partial into its workspace slot (layout in the header).
    const size_t slot_float2 = GW_ACC / 2 * GW_THREADS;  // = GW_TILE_M * GW_TILE_N / 2
    float2* part = reinterpret_cast<float2*>(workspace) + ((size_t)blockIdx.z * tiles + tile) * slot_float2;
#pragma unroll
    for (int p = 0; p < GW_ACC / 2; ++p) {
        const int row = m0 + gw_acc_row(tid, 2 * p), col = n0 + gw_acc_col(tid, 2 * p);
        if (row < M && col < N) {
            float2 v;
            v.x = acc[2 * p];
            v.y = acc[2 * p + 1];
            part[gw_slot_float2(tid, p)] = v;
        }
    }

    // Arrival: every partial store of this block is visible device-wide before its count increment.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(tile_count + tile, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // The last block: C = (C +) the sum of the S partials, z = 0, 1, ... in order (deterministic), in two
    // halves of the accumulator pairs (a whole tile's sums and load addresses at once spill at GW_TILE_N 256).
    const float2* slot = reinterpret_cast<const float2*>(workspace) + (size_t)tile * slot_float2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float sum[GW_ACC / 2];
#pragma unroll
        for (int j = 0; j < GW_ACC / 2; ++j) sum[j] = 0.f;
        const float2* s = slot;
        for (int z = 0; z < splits; ++z, s += (size_t)tiles * slot_float2) {
#pragma unroll
            for (int q = 0; q < GW_ACC / 4; ++q) {
                const int p = half * (GW_ACC / 4) + q;
                const int row = m0 + gw_acc_row(tid, 2 * p), col = n0 + gw_acc_col(tid, 2 * p);
                if (row < M && col < N) {
                    const float2 v = load_coherent2(s + gw_slot_float2(tid, p));
                    sum[2 * q] += v.x;
                    sum[2 * q + 1] += v.y;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < GW_ACC / 2; ++i) {
            const int j = half * (GW_ACC / 2) + i;
            const int row = m0 + gw_acc_row(tid, j), col = n0 + gw_acc_col(tid, j);
            if (row < M && col < N) {
                float* c = C + (size_t)row * N + col;
                *c = accumulate ? *c + sum[i] : sum[i];
            }
        }
    }
    if (tid == 0) tile_count[tile] = 0u;
}
