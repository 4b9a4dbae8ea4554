// gemm_quant.cu — gemm.cu's prefill matrix product on INT4 / INT8 weights (weight-only quantization), on the
// tensor cores (mma.sync, sm_80 and newer).
//
//   gemm_quant   C[M, N] = A[M, K] · W[N, K]^T   (+ C when accumulate != 0),   W[n, k] = fp16((q - zero) * scale)
//
// Parameters: gemm.cu's with W replaced by cullama/model/quant.py's device format and the group size last: qweight
// [N, K * BITS / 32] uint32 (16-byte vectors of CODES = 128 / BITS codes), qparams [N, K / group, 2] FP16 (scale,
// zero). Variants: BITS (4 | 8), a compile-time define (cullama/runtime/ops/gemm_quant.py).
// Shapes: A [>= M, K] FP16 and C [>= M, N] float32 as in gemm.cu; K % CODES == 0, group % CODES == 0, K % group
// == 0 (quant.py's contract: a 16-byte vector of codes lies in one group); any M >= 1, N >= 1.
// Launch and split-K: exactly gemm.cu's (grid (ceil(N / 128), ceil(M / 64), S), THREADS (256) threads, workspace
// and tile_count as gemm.cuh says), so cullama/runtime/prefill_kernels.py's MMA_GEMM geometry and split rule apply.
// Block (gemm.cuh's 64 x 128 tile, 8 warps of 32 x 32): per K tile of 32, A's tile and the W tile's codes (128
// rows x 16 bytes at 4 bits, 32 at 8) arrive by cp.async in a STAGES-deep ring; then each thread dequantizes 16
// codes of one W row (thread t: row t / 2, codes 16 (t % 2) ..) into the block's FP16 W tile: (q - zero) exactly
// (dequant.cuh) times the scale in FP16, rounded once to nearest even, which is quant.dequantize(..., float16);
// a barrier; and the warps run gemm.cuh's ldmatrix + mma.sync on it. Two barriers per K tile: the W tile is
// one buffer, refilled once every warp is done with the previous one. A thread's (scale, zero) word for the next
// tile is loaded one tile ahead into a register (a group spans one or more K tiles at 4 bits; at 8 bits a tile
// row's two vectors may lie in two groups of 16, and each thread's 16 codes are one vector).
// Past a split's K range codes are zero-filled and the (scale, zero) word is 0: those weights are 0 (never read
// from past a row's groups). Past N codes are zero-filled and the word is row N - 1's: those columns are not stored.
// Shared memory: A 15360 B + codes 6144 (4 bits) / 12288 (8 bits) + the W tile 10240 = 31744 / 37888 B (static).
// Overlap: the prologue's code copies and the first (scale, zero) load come before pdl_wait() (weights); A after.
#ifndef BITS
#define BITS 4
#endif
#include "gemm.cuh"
#include "dequant.cuh"

#if BITS != 4 && BITS != 8
#error "BITS must be 4 or 8"
#endif
#define CODES (128 / BITS)                 // codes per 16-byte vector (quant.VECTOR)
#define ROW_WORDS (TILE_K * BITS / 32)     // a W tile row's codes in 32-bit words: 4 or 8
#define ROW_CHUNKS (ROW_WORDS / 4)         // its 16-byte chunks: 1 or 2
#define THREAD_WORDS (ROW_WORDS / 2)       // the words one thread dequantizes (two threads per row): 2 or 4

struct QuantTiles {
    ATiles a;
    uint32_t codes[STAGES][TILE_N][ROW_WORDS];  // the W tiles' codes, as stored
    half_t w[TILE_N][PITCH];                    // the dequantized W tile that the MMAs read
};

// cp.async of W's K tile `kt` (codes of columns k0 + 32 kt ..) into ring slot `stage`: TILE_N * ROW_CHUNKS chunks,
// thread tid copies chunk tid (at 4 bits threads 128..255 copy none). Chunks past k1 or N are zero-filled.
__device__ __forceinline__ void load_tile_codes(QuantTiles& s, int stage, int kt,
                                                const unsigned int* __restrict__ qweight, int N, int K, int k0,
                                                int k1, int n0) {
    if ((int)threadIdx.x >= TILE_N * ROW_CHUNKS) return;
    const int row = threadIdx.x / ROW_CHUNKS, chunk = threadIdx.x % ROW_CHUNKS;
    const int k = k0 + kt * TILE_K + chunk * CODES;
    const bool ok = k < k1 && n0 + row < N;
    const unsigned int* src = qweight + ((size_t)(n0 + row) * K + k) / (32 / BITS);
    cp_async16(smem_addr(&s.codes[stage][row][chunk * 4]), ok ? src : qweight, ok);
}

// This thread's (scale, zero) words: row n0 + threadIdx.x / 2 of qparams (clamped to N - 1: never read past N).
__device__ __forceinline__ const uint32_t* params_row(const half_t* __restrict__ qparams, int N, int K, int n0,
                                                      int group) {
    return reinterpret_cast<const uint32_t*>(qparams) + (size_t)min(n0 + (int)threadIdx.x / 2, N - 1) * (K / group);
}

// The word for K tile kt, whose codes start at k = k0 + 32 kt + 16 (threadIdx.x % 2); 0 past k1 (a split's end).
// Its group k / group is (k / 16) / (group / 16), by common.cuh's div_by_magic with magic = div_magic(group / 16)
// (group % 16 == 0: CODES divides it; exact while K < 741455): a division here held temporaries through the loop
// that spilled under NVRTC 13.5 at 8 bits.
__device__ __forceinline__ uint32_t tile_params(const uint32_t* __restrict__ row, int kt, int k0, int k1,
                                                uint32_t magic) {
    const int k = k0 + kt * TILE_K + (threadIdx.x % 2) * 16;  // >= 0
    return k < k1 ? row[div_by_magic(k >> 4, magic)] : 0u;
}

// The thread's 16 codes of ring slot `stage` into the W tile as FP16 (q - zero) * scale, in k order.
__device__ __forceinline__ void dequant_tile(QuantTiles& s, int stage, uint32_t params) {
    const int row = threadIdx.x / 2, half = threadIdx.x % 2;
    const uint32_t bias = zero_bias(params), scale = scale_x2(params);
    const uint32_t* words = &s.codes[stage][row][half * THREAD_WORDS];
    uint32_t out[8];  // FP16 pairs: codes 2i and 2i + 1 of the thread's 16
#pragma unroll
    for (int j = 0; j < THREAD_WORDS; ++j) {
        uint32_t pairs[16 / BITS];
        dequant_word<BITS>(words[j], bias, pairs);
#pragma unroll
        for (int p = 0; p < 16 / BITS; ++p) out[j * (16 / BITS) + p] = hmul2(pairs[p], scale);
    }
    uint4* dst = reinterpret_cast<uint4*>(&s.w[row][half * 16]);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
gemm_quant(const half_t* __restrict__ A, const unsigned int* __restrict__ qweight, const half_t* __restrict__ qparams,
           float* __restrict__ C, float* workspace, unsigned int* tile_count, int M, int N, int K, int accumulate,
           int group) {
    __shared__ __align__(128) QuantTiles s;
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

    // Prologue, as gemm.cu's: tiles 0 .. STAGES-2 in flight, one commit group each; the codes (and this thread's
    // first (scale, zero) word) before pdl_wait(), A after.
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
        if (st < n_ktiles) load_tile_codes(s, st, st, qweight, N, K, k0, k1, n0);
    const uint32_t* prow = params_row(qparams, N, K, n0, group);
    const uint32_t magic = div_magic(group / 16);
    uint32_t params = tile_params(prow, 0, k0, k1, magic);
    pdl_wait();  // everything below may read what the previous kernel wrote
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_ktiles) load_tile_a(s.a, st, st, A, M, K, k0, k1, m0);
        cp_async_commit();
    }

    for (int kt = 0; kt < n_ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // tile kt's A and codes have landed (gemm.cu's count of groups)
        __syncthreads();              // for every thread; and every warp is done with tile kt - 1 (slot and W tile)
        {
            const int next = kt + STAGES - 1;
            if (next < n_ktiles) {
                load_tile_a(s.a, next % STAGES, next, A, M, K, k0, k1, m0);
                load_tile_codes(s, next % STAGES, next, qweight, N, K, k0, k1, n0);
            }
            cp_async_commit();
        }
        const int stage = kt % STAGES;
        dequant_tile(s, stage, params);
        params = tile_params(prow, kt + 1, k0, k1, magic);  // in flight during this tile's MMAs
        __syncthreads();  // the W tile is complete
        mma_tile(acc, s.a[stage], s.w, wm, wn, lane);
    }
    // Every real tile's group was waited for inside the loop; only empty groups can remain.
    store_tile(acc, C, workspace, tile_count, M, N, m0, n0, wm, wn, accumulate, is_last);
}
