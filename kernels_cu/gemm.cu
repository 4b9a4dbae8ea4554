// gemm.cu — the prefill (prompt) path's matrix products, on the tensor cores.
//
//   gemm   C[M, N] = A[M, K] · W[N, K]^T   (+ C when accumulate != 0)
//
// Shapes: A (activations, M = prompt rows 1..256) and W (weights, N up to 32000) FP16 row-major with
// K % 8 == 0 and 16-byte aligned base pointers (every 8-half chunk of a row is one 16-byte copy);
// C float32 row-major, row stride N. Any M >= 1, N >= 1: edge tiles are zero-filled on load and
// bounds-checked on store. No compile-time variants.
// Launch: grid (ceil(N / 128), ceil(M / 64), S), THREADS (256) threads; see GEMM_TILE_M / GEMM_TILE_N /
// GEMM_THREADS and gemm_splits (which picks S) in cullama/runtime/plan.py.
// The split-K contract, the block's warps and the fragment layouts are in gemm.cuh (shared with gemm_quant.cu,
// the same product on INT4 / INT8 weights); here, W's cp.async tiles and the pipeline around them.
#include "gemm.cuh"

// Shared tiles, [stage][row][k] with padded rows: 3 x (64 + 128) x 40 x 2 B = 46080 B (static limit 48 KB;
// 46081 B with the split-K arrival flag).
struct Tiles {
    ATiles a;
    half_t w[STAGES][TILE_N][PITCH];
};

// Issue the cp.asyncs of W's K tile `kt` (columns k0 + 32 kt ..) into ring slot `stage`: rows n0..n0+127, 512
// chunks, two per thread, as load_tile_a (gemm.cuh) does A's: thread tid copies chunk tid % 4 of rows tid / 4 and
// tid / 4 + 64. Columns at or past k1 read as 0.
__device__ __forceinline__ void load_tile_w(Tiles& s, int stage, int kt, const half_t* __restrict__ W, int N,
                                            int K, int k0, int k1, int n0) {
    const int row = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const int k = k0 + kt * TILE_K + chunk * 8;
#pragma unroll
    for (int i = 0; i < TILE_N / (THREADS / CHUNKS); ++i) {
        const int r = row + i * (THREADS / CHUNKS);
        const bool ok = k < k1 && n0 + r < N;
        cp_async16(smem_addr(&s.w[stage][r][chunk * 8]), ok ? W + (size_t)(n0 + r) * K + k : W, ok);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
gemm(const half_t* __restrict__ A, const half_t* __restrict__ W, float* __restrict__ C, float* workspace,
     unsigned int* tile_count, int M, int N, int K, int accumulate) {
    __shared__ __align__(128) Tiles s;
    __shared__ bool is_last;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    const int m0 = blockIdx.y * TILE_M, n0 = blockIdx.x * TILE_N;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int wm = (warp / WARPS_N) * WARP_TILE_M;  // this warp's sub-tile inside the block tile
    const int wn = (warp % WARPS_N) * WARP_TILE_N;
    const KRange range = block_k_range(K);
    const int k0 = range.k0, k1 = range.k1, n_ktiles = range.tiles;

    float acc[MMA_M][MMA_N][4];
    zero_acc(acc);

    // Prologue: tiles 0 .. STAGES-2 in flight, one commit group each (empty groups past the end keep
    // the group count, and so the wait below, uniform). Their W halves go first, before pdl_wait(): W
    // is a weight, which no kernel writes, so under programmatic dependent launch they stream while the
    // kernel before this one finishes; A comes after. Group 0 holds every prologue W copy (groups
    // complete in order), so tile st's data is complete when group st is.
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
        if (st < n_ktiles) load_tile_w(s, st, st, W, N, K, k0, k1, n0);
    pdl_wait();  // everything below may read what the previous kernel wrote
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_ktiles) load_tile_a(s.a, st, st, A, M, K, k0, k1, m0);
        cp_async_commit();
    }

    for (int kt = 0; kt < n_ktiles; ++kt) {
        // Groups committed so far: STAGES - 1 + kt; tile kt is group kt, so once at most STAGES - 2
        // remain in flight it has landed (for this thread's copies; the barrier makes it everyone's).
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // also: every warp is done with tile kt - 1, whose slot is refilled next
        {
            const int next = kt + STAGES - 1;
            if (next < n_ktiles) {
                load_tile_a(s.a, next % STAGES, next, A, M, K, k0, k1, m0);
                load_tile_w(s, next % STAGES, next, W, N, K, k0, k1, n0);
            }
            cp_async_commit();
        }
        const int stage = kt % STAGES;
        mma_tile(acc, s.a[stage], s.w[stage], wm, wn, lane);
    }
    // Every real tile's group was waited for inside the loop; only empty groups can remain.
    store_tile(acc, C, workspace, tile_count, M, N, m0, n0, wm, wn, accumulate, is_last);
}
