// gemm.cuh — what the prefill GEMMs on mma.sync share, whatever their weights are stored as (gemm.cu: FP16,
// copied into shared memory by cp.async; gemm_quant.cu: INT4 / INT8, dequantized into shared memory as FP16): the
// block tile and its warps, A's cp.async ring, the block's K range under split-K, one K tile's ldmatrix + mma.sync,
// and the epilogue with the deterministic split-K combine. Their product, launch and split-K contract are one:
// cullama/runtime/prefill_kernels.py's GemmKernel geometry applies to both.
//
// Split-K (S = gridDim.z > 1; deterministic). Block z takes K range [z Kz, min(K, (z + 1) Kz)), Kz =
// ceil(K / S) rounded up to a multiple of TILE_K (a range may be empty: its partial is 0). Each block
// stores its float32 partial tile into `workspace`, __threadfence()s, and bumps tile_count[tile] (tile =
// blockIdx.y * gridDim.x + blockIdx.x) once; the block that sees S - 1 (the last to arrive) sums the S
// partials in the fixed order z = 0, 1, ..., S - 1 (L1-bypassing loads), adds C when accumulate, stores
// C and sets tile_count[tile] = 0 for the next launch. The sum's order never depends on which block
// arrives last, so the result is bitwise reproducible. With S = 1 the block stores C directly and never
// touches workspace or tile_count (any valid pointers).
//   workspace (float32, at least S * tiles * 64 * 128 elements, tiles = gridDim.x * gridDim.y) in the
//   fragment layout: the partial of (z, tile) is slot z * tiles + tile, 64 * 128 floats, as 16 x 256
//   float2: float2 p * THREADS + threadIdx.x holds acc[i][j][2h], acc[i][j][2h + 1] of that thread, p =
//   (i * MMA_N + j) * 2 + h (the C columns col, col + 1 of row r, as in the epilogue below). Writer and
//   reader are the same thread index, so any fixed layout works; this one makes every warp's store and
//   load one contiguous 256-byte run. Only float2s with row < M and col < N are written and read.
//   tile_count (uint32, at least tiles elements) is all zero before a launch and after it.
//
// Block: a 64 x 128 tile of C, 8 warps as 2 (M) x 4 (N), each warp a 32 x 32 sub-tile = 2 x 4 MMAs of
// m16n8k16 (32 float accumulators per thread). K advances in tiles of 32 through a STAGES-deep ring
// of shared-memory buffers filled by cp.async (16 B, zero-fill past M, N or K; gemm_quant.cu's W tile is
// dequantized from its ring into one more buffer), so the next tiles' loads are in flight while the tensor
// cores work on this one. Fragments come from shared memory
// with ldmatrix.x4; rows are padded to 40 halves (80 B) so each 8-row ldmatrix phase hits 8 distinct
// 16-byte bank groups (80 r mod 128 = 0, 80, 32, 112, 64, 16, 96, 48 for r = 0..7): conflict-free.
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, "Matrix Fragments
// for mma.m16n8k16"), per lane: g = lane / 4 (groupID), t = lane % 4 (threadID_in_group).
//   A (16 x 16, row-major: [m][k]), 4 x .f16x2 registers, low half = lower k:
//     a0 = A[g    ][2t, 2t+1]      a1 = A[g + 8][2t, 2t+1]
//     a2 = A[g    ][2t+8, 2t+9]    a3 = A[g + 8][2t+8, 2t+9]
//   B (16 x 8, "col": element B[k][n] = W[n][k], so a B column is a W row, k contiguous), 2 x .f16x2:
//     b0 = W[g][2t, 2t+1]          b1 = W[g][2t+8, 2t+9]          (n = g)
//   C / D (16 x 8, float32), 4 registers:
//     c0, c1 = C[g][2t, 2t+1]      c2, c3 = C[g + 8][2t, 2t+1]
// ldmatrix.sync.aligned.m8n8.x4.shared.b16 loads four 8 x 8 b16 matrices: lanes 8j..8j+7 give the
// 16-byte row addresses (rows 0..7) of matrix j, and every lane receives, in register j, row lane / 4,
// elements 2 (lane % 4) and +1 of matrix j, i.e. exactly an "[g][2t, 2t+1]" piece. Hence:
//   A, one m16 x k16 block:  lane -> row (lane % 16), k offset (lane / 16) * 8
//     matrix 0 = rows 0-7 k 0-7 -> a0,  1 = rows 8-15 k 0-7 -> a1,  2 = rows 0-7 k 8-15 -> a2,
//     matrix 3 = rows 8-15 k 8-15 -> a3.
//   W, two n8 tiles x k16:   lane -> W row (lane % 8) + (lane / 16) * 8, k offset ((lane / 8) % 2) * 8
//     matrix 0 = n 0-7 k 0-7 -> b0 of n-tile 0,   1 = n 0-7 k 8-15 -> b1 of n-tile 0,
//     matrix 2 = n 8-15 k 0-7 -> b0 of n-tile 1,  3 = n 8-15 k 8-15 -> b1 of n-tile 1.
#pragma once
#include "mma.cuh"

#define TILE_M 64    // GEMM_TILE_M in cullama/runtime/plan.py
#define TILE_N 128   // GEMM_TILE_N
#define THREADS 256  // GEMM_THREADS
#define TILE_K 32    // K per pipeline stage: 4 chunks of 8 halves (16 B) per row
#define STAGES 3     // shared-memory ring depth: STAGES - 1 tiles in flight while one is computed
#define PITCH 40     // shared row pitch in halves: TILE_K + 8 of padding (80 B, 16-byte aligned)
#define WARPS_N 4    // warps along N; 8 / WARPS_N = 2 along M
#define WARP_TILE_M 32
#define WARP_TILE_N 32
#define MMA_M (WARP_TILE_M / 16)  // 2 m16 tiles per warp
#define MMA_N (WARP_TILE_N / 8)   // 4 n8 tiles per warp
#define CHUNKS (TILE_K / 8)       // 16-byte chunks per tile row
#define SLOT_FLOAT2 (TILE_M * TILE_N / 2)  // float2s per split-K workspace slot (one partial tile)

// At least 3 blocks per SM on sm_90 and newer (<= 85 registers; shared memory would allow 4): splitting the
// prologue around pdl_wait() cost 9 registers and, without this bound, the third block. Before sm_90, ptxas
// needs more registers than that for this code (76 bytes of spills on sm_80 / 86 / 89 at 3 blocks) and an
// sm_86 / sm_89 SM holds only 2 blocks' shared memory anyway: 2 there.
#if __CUDA_ARCH__ >= 900
#define GEMM_MIN_BLOCKS 3
#else
#define GEMM_MIN_BLOCKS 2
#endif

// A's shared ring: [stage][row][k], rows padded to PITCH.
typedef half_t ATiles[STAGES][TILE_M][PITCH];

// Issue the cp.asyncs of A's K tile `kt` (columns k0 + 32 kt ..) into ring slot `stage`: rows m0..m0+63, 256
// chunks, one per thread: thread tid copies chunk tid % 4 of row tid / 4 (4 consecutive threads read one row's 64
// contiguous bytes). K is the row stride; columns at or past k1 (this block's K range end) read as 0 (K % 8 == 0
// and k0, k1 are multiples of 8: a chunk is wholly in or out).
__device__ __forceinline__ void load_tile_a(ATiles& a, int stage, int kt, const half_t* __restrict__ A, int M, int K,
                                            int k0, int k1, int m0) {
    const int row = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const int k = k0 + kt * TILE_K + chunk * 8;
    const bool ok = k < k1 && m0 + row < M;
    cp_async16(smem_addr(&a[stage][row][chunk * 8]), ok ? A + (size_t)(m0 + row) * K + k : A, ok);
}

// This block's K range [k0, k1) and its number of K tiles: all of K when S = gridDim.z = 1.
struct KRange {
    int k0, k1, tiles;
};

__device__ __forceinline__ KRange block_k_range(int K) {
    const int splits = gridDim.z;
    const int kz = ((K + splits - 1) / splits + TILE_K - 1) / TILE_K * TILE_K;
    KRange r;
    r.k0 = min(K, (int)blockIdx.z * kz);
    r.k1 = min(K, r.k0 + kz);
    r.tiles = (r.k1 - r.k0 + TILE_K - 1) / TILE_K;
    return r;
}

__device__ __forceinline__ void zero_acc(float (&acc)[MMA_M][MMA_N][4]) {
#pragma unroll
    for (int i = 0; i < MMA_M; ++i)
#pragma unroll
        for (int j = 0; j < MMA_N; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// acc += this warp's 32 x 32 sub-tile (rows wm.., columns wn..) of one K tile: a_tile [TILE_M][PITCH] and w_tile
// [TILE_N][PITCH] in shared memory, fragments by ldmatrix.x4 (lane -> row and k offset as tabulated above).
__device__ __forceinline__ void mma_tile(float (&acc)[MMA_M][MMA_N][4], const half_t (&a_tile)[TILE_M][PITCH],
                                         const half_t (&w_tile)[TILE_N][PITCH], int wm, int wn, int lane) {
    const int a_row = lane % 16, a_k = (lane / 16) * 8;
    const int w_row = lane % 8 + (lane / 16) * 8, w_k = ((lane / 8) % 2) * 8;
#pragma unroll
    for (int ks = 0; ks < TILE_K; ks += 16) {
        uint32_t a[MMA_M][4], b[MMA_N / 2][4];
#pragma unroll
        for (int i = 0; i < MMA_M; ++i) ldmatrix_x4(a[i], smem_addr(&a_tile[wm + i * 16 + a_row][ks + a_k]));
#pragma unroll
        for (int j = 0; j < MMA_N / 2; ++j)  // b[j] = {b0, b1 of n-tile 2j; b0, b1 of n-tile 2j + 1}
            ldmatrix_x4(b[j], smem_addr(&w_tile[wn + j * 16 + w_row][ks + w_k]));
#pragma unroll
        for (int i = 0; i < MMA_M; ++i)
#pragma unroll
            for (int j = 0; j < MMA_N; ++j)
                mma_16816(acc[i][j], a[i], b[j / 2][(j % 2) * 2], b[j / 2][(j % 2) * 2 + 1]);
    }
}

// The block's C tile from its accumulators (this warp's sub-tile at wm, wn of the tile at m0, n0): stored
// (+ C when accumulate) when S = 1; else the split-K protocol above, `is_last` a __shared__ flag of the kernel.
__device__ __forceinline__ void store_tile(float (&acc)[MMA_M][MMA_N][4], float* __restrict__ C, float* workspace,
                                           unsigned int* tile_count, int M, int N, int m0, int n0, int wm, int wn,
                                           int accumulate, bool& is_last) {
    const int lane = threadIdx.x % WARP, splits = gridDim.z;
    // acc[i][j][e] is C[m0 + wm + 16 i + g + 8 (e / 2)][n0 + wn + 8 j + 2 t + e % 2].
    const int g = lane / 4, t = lane % 4;
    if (splits == 1) {
#pragma unroll
        for (int i = 0; i < MMA_M; ++i)
#pragma unroll
            for (int j = 0; j < MMA_N; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + wm + i * 16 + g + (e / 2) * 8;
                    const int col = n0 + wn + j * 8 + t * 2 + (e % 2);
                    if (row < M && col < N) {
                        float* c = C + (size_t)row * N + col;
                        *c = accumulate ? *c + acc[i][j][e] : acc[i][j][e];
                    }
                }
        return;
    }

    // Split-K: this block's partial into its workspace slot (layout in the header). Its store loop below is
    // kept apart from the one above on purpose: one shared loop kept acc live through this path and cost
    // 7 registers (80 -> 87 a thread, 3 -> 2 blocks an SM).
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    float2* part = reinterpret_cast<float2*>(workspace) + ((size_t)blockIdx.z * tiles + tile) * SLOT_FLOAT2 +
                   threadIdx.x;
    // Whether the float2 partial (i, j, h), rows g + 8 h of acc[i][j], lies inside C
    const auto inside_c = [&](int i, int j, int h) {
        return m0 + wm + i * 16 + g + h * 8 < M && n0 + wn + j * 8 + t * 2 < N;
    };
#pragma unroll
    for (int i = 0; i < MMA_M; ++i)
#pragma unroll
        for (int j = 0; j < MMA_N; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (inside_c(i, j, h)) {
                    float2 v;
                    v.x = acc[i][j][2 * h];
                    v.y = acc[i][j][2 * h + 1];
                    part[((i * MMA_N + j) * 2 + h) * THREADS] = v;
                }
            }

    // Arrival: every partial store of this block is visible device-wide before its count increment.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(tile_count + tile, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // The last block: C = (C +) sum of the S partials, z = 0, 1, ... in order (deterministic).
    // Which of the thread's float2 partials lie inside C, bit p for partial p: one register, where 16 (row, col)
    // tests kept live across the loop spilled under NVRTC 13.5's sm_90 80-register bound (3 blocks an SM). Built
    // here, not before the partial stores above for both loops: that spilled gemm.cu under NVRTC 12.9 too.
    unsigned int inside = 0u;
#pragma unroll
    for (int i = 0; i < MMA_M; ++i)
#pragma unroll
        for (int j = 0; j < MMA_N; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (inside_c(i, j, h)) inside |= 1u << ((i * MMA_N + j) * 2 + h);
    float2 sum[MMA_M * MMA_N * 2];
#pragma unroll
    for (int p = 0; p < MMA_M * MMA_N * 2; ++p) sum[p].x = sum[p].y = 0.f;
    const float2* slot = reinterpret_cast<const float2*>(workspace) + (size_t)tile * SLOT_FLOAT2 + threadIdx.x;
    for (int z = 0; z < splits; ++z, slot += (size_t)tiles * SLOT_FLOAT2) {
#pragma unroll
        for (int p = 0; p < MMA_M * MMA_N * 2; ++p)
            if (inside >> p & 1u) {
                const float2 v = load_coherent2(slot + p * THREADS);
                sum[p].x += v.x;
                sum[p].y += v.y;
            }
    }
#pragma unroll
    for (int i = 0; i < MMA_M; ++i)
#pragma unroll
        for (int j = 0; j < MMA_N; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + wm + i * 16 + g + (e / 2) * 8;
                const int col = n0 + wn + j * 8 + t * 2 + (e % 2);
                const float2 v = sum[(i * MMA_N + j) * 2 + e / 2];
                const float x = e % 2 ? v.y : v.x;
                if (row < M && col < N) {
                    float* c = C + (size_t)row * N + col;
                    *c = accumulate ? *c + x : x;
                }
            }
    if (threadIdx.x == 0) tile_count[tile] = 0u;
}
