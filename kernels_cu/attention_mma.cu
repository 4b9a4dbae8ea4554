// attention_mma.cu — the prompt (prefill) path's causal attention on the tensor cores (flash-attention 2).
//
//   attention_prefill_mma   a prompt chunk: row r (position start + r) attends causally to its keys
//
// The same parameters, function and output as attention_prefill (attention.cu), whose NumPy twin is this
// kernel's twin too (cullama/runtime/ops/attention_mma.py): out_rows[r] = softmax(q_rows[r] · K^T * scale) · V over
// the keys max(0, n - window)..n - 1, n = min(start + r + 1, max_seq), of the query head's kv head (window: the
// sliding window; >= max_seq: every key from 0), FP16 out, for rows r < n_rows; rows >= n_rows are neither read
// nor written. Any scale (it is applied before the row maximum).
//
// Shapes (as attention_prefill): q_rows, out_rows [rows >= n_rows, n_heads * HEAD_DIM] FP16, row stride
// gridDim.x * GROUP * HEAD_DIM; k_cache, v_cache [n_kv_heads, max_seq, HEAD_DIM] FP16 (this layer's, already
// holding the chunk's keys); query head h uses kv head h / GROUP. Base pointers 16-byte aligned.
//
// Variants (compile-time defines, defaults in brackets; cullama/runtime/ops/attention_mma.py lists those compiled):
//   HEAD_DIM  [128]  16, 32, 64 or 128. Not 8: the k of m16n8k16 is 16, so Q·K^T needs HEAD_DIM >= 16; the
//                    plan keeps the scalar attention_prefill for head_dim 8 (e.g. stories260K).
//   GROUP     [1]    query heads per kv head: 1, 2, 4 or 8
//   WARPS     [4]    warps per block, 2 or 4: a block holds AM_BLOCK_Q = 16 WARPS queries (2 leaves more,
//                    smaller blocks, for grids that would not fill the GPU; the plan uses 4)
// Launch: grid (n_kv_heads, ceil(n_rows / AM_ROWS)), AM_THREADS = 32 WARPS threads, static shared memory only
// (2 x 64 x (HEAD_DIM + 8) x 2 B: 34816 B at HEAD_DIM 128). AM_ROWS = 16 WARPS / GROUP prompt rows per block
// (64 / GROUP at WARPS 4). A grid taller than needed is harmless: blocks past n_rows exit at once.
//
// Block (kv head x, rows row0 = y AM_ROWS .. row0 + AM_ROWS - 1): its AM_BLOCK_Q queries are those rows x the
// GROUP query heads of kv head x, query j = row j / GROUP, head j % GROUP. A row's GROUP heads are contiguous
// in q_rows, so the block's Q tile is simply rows row0.. of q_rows, columns x GROUP HEAD_DIM .., read as
// [AM_BLOCK_Q, HEAD_DIM]; every K and V row the block loads serves all of its queries. Warp w owns queries
// 16 w .. 16 w + 15 (one m16 tile) and all HEAD_DIM columns of their output. Row r sees keys [first(r), lim(r)),
// lim(r) = min(start + row0 + r + 1, end), end = min(start + row0 + rows, max_seq) (rows: the block's real
// rows; padding queries past them use lim = end, compute junk from zero-filled q and are never stored), first(r)
// = max(lim(r) - window, 0): never empty.
//
// Key loop: tiles of AM_TILE_K = 64 keys, aligned to key 0, kt = first(0) / 64 .. ceil(end / 64) - 1 (a sliding
// window skips the tiles before the block's first key). Per tile a warp does
//   S = Q K^T      16 x 64 scores: 8 n8 tiles x HEAD_DIM / 16 k16 steps of mma.m16n8k16 (Q: A fragments
//                  held in registers for the whole loop; K: B fragments by ldmatrix, no .trans)
//   mask           only in tiles that reach past the warp's smallest limit (the diagonal and the end), or start
//                  before its largest first key (the window's edge): key >= lim(query) or key < first(query)
//                  -> -inf. A warp skips the mma work of a tile none of its queries sees.
//   softmax        FP32 online softmax on the accumulators: x = s * scale * log2(e), row max over the
//                  quad (shfl.xor 1, 2), m_new = max(m, rowmax), O and l *= 2^(m - m_new), p = 2^(x - m_new)
//                  (ex2.approx; -inf -> 0); l keeps this lane's partial row sums (quad-summed at the end)
//   O += P V       P's C fragments, rounded to FP16, are directly the A fragments of the k16 steps (below);
//                  V: B fragments by ldmatrix.trans; HEAD_DIM / 8 n8 tiles x 4 k16 steps
// and at the end O / l goes out as FP16 (one 32-bit store per pair of columns).
//
// Shared memory and pipeline. Two tiles, K and V, each [64][AM_PITCH] halves with AM_PITCH = HEAD_DIM + 8:
// a row is 16 B longer than its data (row strides 48, 80, 144, 272 B for HEAD_DIM 16..128), so the 8 row
// addresses of an ldmatrix phase fall in 8 distinct 16-byte bank groups: conflict-free (the pad is never
// read; both checked by the tests). The
// Q tile is staged once through the V tile (AM_BLOCK_Q <= 64 rows). Loads are cp.async.cg (16 B, zero-fill
// for keys outside the block's [first(0), end) and query rows >= rows); K and V alternate in the two slots as flash-attention 2 does, so
// that one tile is always landing while the other is computed on, in 2 x 17 KB at HEAD_DIM 128 (all static:
// the plan has no dynamic shared memory; a K and V double buffer would need 68 KB and the opt-in):
//   prologue   cp.async Q -> V slot, K_kt0 -> K slot (kt0: the first tile); wait; barrier; Q -> A fragments
//   tile kt    wait (K_kt landed); barrier [K_kt visible; all warps done with V_{kt-1} or Q]
//              cp.async V_kt -> V slot;  S = Q K_kt^T, mask, softmax, P
//              wait (V_kt landed); barrier [V_kt visible; all warps done with K_kt]
//              cp.async K_kt+1 -> K slot (if any);  O += P V_kt
// so V_kt's load overlaps Q K_kt^T and the softmax, and K_kt+1's overlaps P V_kt.
// Registers: O HEAD_DIM / 2 floats, Q HEAD_DIM / 8 words, S 32 floats, P 16 words a thread, and ldmatrix
// fragments in flight; __launch_bounds__(AM_THREADS, 2): 232 at HEAD_DIM 128, WARPS 4 (2 blocks of 128 threads
// use 59.4k of the 64k registers; 3 would need <= 168 and spill), 159 at 64, 108-114 at 32, no spills.
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (as gemm.cu's header), per lane:
// g = lane / 4, t = lane % 4.  A (16 x 16, [m][k]): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
// a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9].  B (16 x 8, [k][n]): b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g].  C (16 x 8): c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]  (am_acc_*).
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i; lane l gets in register i row l / 4,
// elements 2 (l % 4), +1 of matrix i; with .trans it gets elements (2 (l % 4), l / 4), (2 (l % 4) + 1, l / 4).
//   Q, k16 step ks (A): lane -> tile row 16 w + l % 16, column 16 ks + 8 (l / 16)       (am_q_ldm_*)
//     matrices: rows 0-7 / 8-15 x k 0-7, then the same x k 8-15 -> a0, a1, a2, a3.
//   K, keys 16 p .. 16 p + 15, k16 step ks (B, B[k][n] = K[key n][dim k]: a key row is k-contiguous, the
//     "col" layout): lane -> key 16 p + l % 8 + 8 (l / 16), dim 16 ks + 8 ((l / 8) % 2)  (am_k_ldm_*)
//     matrices: keys 0-7 dims 0-7 -> b0, keys 0-7 dims 8-15 -> b1 of n-tile 2p; keys 8-15 -> n-tile 2p + 1.
//   V, keys 16 kk .. 16 kk + 15 (k16 step kk of P V), dims 16 p .. (B[k][n] = V[key k][dim n]: stored
//     [key][dim], so .trans): lane -> key 16 kk + l % 16, dim 16 p + 8 (l / 16)           (am_v_ldm_*)
//     matrices: keys 0-7 / 8-15 of dims 0-7 -> b0, b1 of n-tile 2p; of dims 8-15 -> b0, b1 of n-tile 2p + 1.
//   P -> A (the C-to-A reuse): S's n8 tiles 2 kk and 2 kk + 1 cover keys 16 kk .. 16 kk + 15, and C[g][2t, 2t+1]
//     of tile 2 kk is A[g][2t, 2t+1] of step kk: a0 = (c0, c1) of tile 2 kk, a1 = (c2, c3) of it, a2 = (c0, c1)
//     of tile 2 kk + 1, a3 = (c2, c3) of it (am_p_tile, am_p_elem), packed by cvt.rn.f16x2.f32.
// tests/runtime/ops/test_attention_mma.py compiles the block marked "layout" below on the host and runs a lane-level NumPy
// emulation of this kernel on those functions (PTX fragment semantics, cp.async/barrier hazards) against the
// twin.
#include "mma.cuh"

// ---- layout: begin (plain C++; tests/runtime/ops/test_attention_mma.py compiles this block on the host) -------------
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef AM_FN
#define AM_FN __device__ __forceinline__
#endif

#define AM_THREADS (32 * WARPS)                             // THREADS in cullama/runtime/ops/attention_mma.py
#define AM_BLOCK_Q (16 * WARPS)                             // queries (row, head) per block
#define AM_ROWS (AM_BLOCK_Q / GROUP)                        // prompt rows per block: rows_per_block()
#define AM_TILE_K 64                                        // keys per tile
#define AM_PITCH (HEAD_DIM + 8)                             // shared row pitch in halves (16 B of padding)
#define AM_CHUNKS (HEAD_DIM / 8)                            // 16-byte chunks per row
#define AM_Q_COPIES (AM_BLOCK_Q * AM_CHUNKS / AM_THREADS)   // 16-byte copies per thread: the Q tile
#define AM_KV_COPIES (AM_TILE_K * AM_CHUNKS / AM_THREADS)   // one K or V tile
#define AM_KSTEPS (HEAD_DIM / 16)                           // k16 steps of Q K^T
#define AM_SN (AM_TILE_K / 8)                               // n8 tiles of S (keys)
#define AM_ON (HEAD_DIM / 8)                                // n8 tiles of O (dims)
#define AM_PSTEPS (AM_TILE_K / 16)                          // k16 steps of P V

static_assert(HEAD_DIM == 16 || HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128,
              "HEAD_DIM: 16, 32, 64 or 128 (8 is the scalar attention_prefill's)");
static_assert(GROUP == 1 || GROUP == 2 || GROUP == 4 || GROUP == 8, "GROUP: 1, 2, 4 or 8");
static_assert(WARPS == 2 || WARPS == 4, "WARPS: 2 or 4");
static_assert(AM_BLOCK_Q <= AM_TILE_K, "the Q tile is staged through the V tile");
static_assert(AM_Q_COPIES * AM_THREADS == AM_BLOCK_Q * AM_CHUNKS && AM_Q_COPIES >= 1, "Q copies");
static_assert(AM_KV_COPIES * AM_THREADS == AM_TILE_K * AM_CHUNKS && AM_KV_COPIES >= 1, "K/V copies");

AM_FN int am_min(int a, int b) { return a < b ? a : b; }

// Block geometry: first row, real rows, key end (keys [0, end) are loaded), key tiles.
AM_FN int am_row0(int block_y) { return block_y * AM_ROWS; }
AM_FN int am_rows(int row0, int n_rows) { return am_min(AM_ROWS, n_rows - row0); }
AM_FN int am_key_end(int start, int row0, int rows, int max_seq) { return am_min(start + row0 + rows, max_seq); }
AM_FN int am_tiles(int end) { return (end + AM_TILE_K - 1) / AM_TILE_K; }

// Query j (0 .. AM_BLOCK_Q - 1) of a block: its row, and the offset (halves) of its element d in q_rows and
// out_rows from the block's base (row row0, first head of the kv head); row_stride in halves.
AM_FN int am_query_row(int j) { return j / GROUP; }
AM_FN size_t am_query_offset(int j, int d, size_t row_stride) {
    return (size_t)(j / GROUP) * row_stride + (size_t)((j % GROUP) * HEAD_DIM + d);
}
// Keys query j sees: [am_first, am_limit). pos0 = start + row0, the position of the block's row 0; window: the
// sliding window (>= max_seq: none).
AM_FN int am_limit(int j, int pos0, int end) { return am_min(pos0 + j / GROUP + 1, end); }
AM_FN int am_first(int j, int pos0, int end, int window) {
    const int first = am_limit(j, pos0, end) - window;
    return first > 0 ? first : 0;
}
// The first key tile: the one holding the block's first key.
AM_FN int am_first_tile(int pos0, int end, int window) { return am_first(0, pos0, end, window) / AM_TILE_K; }

// cp.async copy i of thread tid (Q: i < AM_Q_COPIES; K, V: i < AM_KV_COPIES): tile row (query or key) and
// 16-byte chunk. Consecutive threads copy consecutive chunks of a row.
AM_FN int am_copy_row(int tid, int i) { return (tid + i * AM_THREADS) / AM_CHUNKS; }
AM_FN int am_copy_chunk(int tid, int i) { return (tid + i * AM_THREADS) % AM_CHUNKS; }
// Offset in halves of (row, column) in a shared tile.
AM_FN int am_smem(int row, int col) { return row * AM_PITCH + col; }

// ldmatrix.x4 row addresses (tile row, column) of a lane, as tabulated in the header.
AM_FN int am_q_ldm_row(int warp, int lane) { return warp * 16 + lane % 16; }
AM_FN int am_q_ldm_col(int lane, int ks) { return ks * 16 + (lane / 16) * 8; }
AM_FN int am_k_ldm_row(int lane, int pair) { return pair * 16 + lane % 8 + (lane / 16) * 8; }
AM_FN int am_k_ldm_col(int lane, int ks) { return ks * 16 + ((lane / 8) % 2) * 8; }
AM_FN int am_v_ldm_row(int lane, int kk) { return kk * 16 + lane % 16; }
AM_FN int am_v_ldm_col(int lane, int pair) { return pair * 16 + (lane / 16) * 8; }

// Accumulator element e (0..3) of n8 tile n of a lane (S and O alike): its query (of the block) and column
// (key in the tile, or dim).
AM_FN int am_acc_query(int warp, int lane, int e) { return warp * 16 + lane / 4 + (e / 2) * 8; }
AM_FN int am_acc_col(int lane, int n, int e) { return n * 8 + (lane % 4) * 2 + e % 2; }

// P as the A operand of k16 step kk: half h (0 low, 1 high) of register r is element am_p_elem(r, h) of S's
// n8 tile am_p_tile(kk, r).
AM_FN int am_p_tile(int kk, int r) { return 2 * kk + r / 2; }
AM_FN int am_p_elem(int r, int h) { return (r % 2) * 2 + h; }

// Warp-uniform decisions for the tile starting at key0: does any query of warp w see one of its keys (else
// the warp skips its mma work), and does some query of the warp not see all of them (then mask)? A warp's
// queries are consecutive, so their limits and first keys grow with j: its first query has the smallest of both,
// its last the largest.
AM_FN bool am_warp_active(int warp, int key0, int pos0, int end, int window) {
    return key0 < am_limit(warp * 16 + 15, pos0, end) && key0 + AM_TILE_K > am_first(warp * 16, pos0, end, window);
}
AM_FN bool am_tile_masked(int warp, int key0, int pos0, int end, int window) {
    return key0 + AM_TILE_K > am_limit(warp * 16, pos0, end) || key0 < am_first(warp * 16 + 15, pos0, end, window);
}
// ---- layout: end -----------------------------------------------------------------------------------------

#define LOG2E 1.4426950408889634f

// 2^x (MUFU.EX2; -inf -> +0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as FP16 (round to nearest even) in one word, lo in the low half (the lower address / lower k).
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source -> upper half
    return r;
}

struct Tiles {
    half_t k[AM_TILE_K * AM_PITCH];
    half_t v[AM_TILE_K * AM_PITCH];  // also the Q tile, before the key loop
};

// cp.async one K or V tile: keys key0 .. key0 + 63 of this kv head (`src`: its row 0), zeros for keys outside
// [begin, end) (the block's keys: its first row's first, its last row's limit), which no query sees: a cache row
// before the window, whatever it holds, never meets a zero probability (0 x NaN would be NaN).
__device__ __forceinline__ void load_kv_tile(half_t* dst, const half_t* __restrict__ src, int key0, int begin,
                                             int end) {
#pragma unroll
    for (int i = 0; i < AM_KV_COPIES; ++i) {
        const int row = am_copy_row(threadIdx.x, i), chunk = am_copy_chunk(threadIdx.x, i);
        const bool ok = key0 + row < end && key0 + row >= begin;
        const half_t* from = ok ? src + (size_t)(key0 + row) * HEAD_DIM + chunk * 8 : src;
        cp_async16(smem_addr(dst + am_smem(row, chunk * 8)), from, ok);
    }
}

extern "C" __global__ void __launch_bounds__(AM_THREADS, 2)
attention_prefill_mma(const half_t* __restrict__ q_rows, const half_t* __restrict__ k_cache,
                      const half_t* __restrict__ v_cache, half_t* __restrict__ out_rows, int start, int n_rows,
                      int max_seq, float scale, int window) {
    __shared__ __align__(128) Tiles s;
    pdl_launch_dependents();  // the next GEMM may start streaming its weights
    pdl_wait();               // before the early return too: every block orders after the kernel before
    const int row0 = am_row0(blockIdx.y);
    if (row0 >= n_rows) return;  // a grid taller than needed (block-uniform, before any barrier)
    const int rows = am_rows(row0, n_rows);
    const int pos0 = start + row0;
    const int end = am_key_end(start, row0, rows, max_seq);
    const int begin = am_first(0, pos0, end, window), first_tile = am_first_tile(pos0, end, window);
    const int n_tiles = am_tiles(end);
    const size_t row_stride = (size_t)gridDim.x * GROUP * HEAD_DIM;
    const size_t block_off = (size_t)row0 * row_stride + (size_t)blockIdx.x * GROUP * HEAD_DIM;
    const size_t kv_off = (size_t)blockIdx.x * max_seq * HEAD_DIM;
    const half_t* __restrict__ kc = k_cache + kv_off;
    const half_t* __restrict__ vc = v_cache + kv_off;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;

    // Prologue: the Q tile through the V slot and the first K tile, one group.
#pragma unroll
    for (int i = 0; i < AM_Q_COPIES; ++i) {
        const int j = am_copy_row(threadIdx.x, i), chunk = am_copy_chunk(threadIdx.x, i);
        const bool ok = am_query_row(j) < rows;
        cp_async16(smem_addr(s.v + am_smem(j, chunk * 8)),
                   ok ? q_rows + block_off + am_query_offset(j, chunk * 8, row_stride) : q_rows, ok);
    }
    load_kv_tile(s.k, kc, first_tile * AM_TILE_K, begin, end);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[AM_KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < AM_KSTEPS; ++ks)
        ldmatrix_x4(qf[ks], smem_addr(s.v + am_smem(am_q_ldm_row(warp, lane), am_q_ldm_col(lane, ks))));

    const float scale_log2 = scale * LOG2E;
    int first[2], lim[2];  // keys [first, lim) the lane's two queries (rows g, g + 8 of the warp's m16 tile) see
    float m[2], l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        first[h] = am_first(am_acc_query(warp, lane, 2 * h), pos0, end, window);
        lim[h] = am_limit(am_acc_query(warp, lane, 2 * h), pos0, end);
        m[h] = NEG_INF;
        l[h] = 0.f;
    }
    float o[AM_ON][4];
#pragma unroll
    for (int n = 0; n < AM_ON; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

    for (int kt = first_tile; kt < n_tiles; ++kt) {
        const int key0 = kt * AM_TILE_K;
        cp_async_wait<0>();
        __syncthreads();  // K_kt visible to all; every warp is done with the V slot (V_{kt-1}, or Q)
        load_kv_tile(s.v, vc, key0, begin, end);
        cp_async_commit();

        const bool active = am_warp_active(warp, key0, pos0, end, window);  // warp-uniform
        uint32_t pf[AM_PSTEPS][4];
        if (active) {
            float sc[AM_SN][4];
#pragma unroll
            for (int n = 0; n < AM_SN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[n][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < AM_KSTEPS; ++ks)
#pragma unroll
                for (int p = 0; p < AM_SN / 2; ++p) {
                    uint32_t b[4];  // b0, b1 of n-tile 2p; b0, b1 of n-tile 2p + 1
                    ldmatrix_x4(b, smem_addr(s.k + am_smem(am_k_ldm_row(lane, p), am_k_ldm_col(lane, ks))));
                    mma_16816(sc[2 * p], qf[ks], b[0], b[1]);
                    mma_16816(sc[2 * p + 1], qf[ks], b[2], b[3]);
                }
            // Scale (log2 units), mask, row maxima.
            const bool masked = am_tile_masked(warp, key0, pos0, end, window);  // warp-uniform
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int n = 0; n < AM_SN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = sc[n][e] * scale_log2;
                    const int key = key0 + am_acc_col(lane, n, e);
                    if (masked && (key >= lim[e / 2] || key < first[e / 2])) x = NEG_INF;
                    sc[n][e] = x;
                    mx[e / 2] = fmaxf(mx[e / 2], x);
                }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            }
            // Rescale the state to the new maxima; a row with no key yet (max -inf) subtracts 0, never NaN.
            float base[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                base[h] = mx[h] == NEG_INF ? 0.f : mx[h];
                const float c = ex2(m[h] - base[h]);
                m[h] = mx[h];
                l[h] *= c;
#pragma unroll
                for (int n = 0; n < AM_ON; ++n) {
                    o[n][2 * h] *= c;
                    o[n][2 * h + 1] *= c;
                }
            }
#pragma unroll
            for (int n = 0; n < AM_SN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = ex2(sc[n][e] - base[e / 2]);
                    l[e / 2] += p;
                    sc[n][e] = p;
                }
#pragma unroll
            for (int kk = 0; kk < AM_PSTEPS; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    pf[kk][r] = pack_f16x2(sc[am_p_tile(kk, r)][am_p_elem(r, 0)],
                                           sc[am_p_tile(kk, r)][am_p_elem(r, 1)]);
        }

        cp_async_wait<0>();
        __syncthreads();  // V_kt visible to all; every warp is done with K_kt
        if (kt + 1 < n_tiles) load_kv_tile(s.k, kc, key0 + AM_TILE_K, begin, end);
        cp_async_commit();

        if (active) {
#pragma unroll
            for (int kk = 0; kk < AM_PSTEPS; ++kk)
#pragma unroll
                for (int p = 0; p < AM_ON / 2; ++p) {
                    uint32_t b[4];  // b0, b1 of n-tile 2p; b0, b1 of n-tile 2p + 1
                    ldmatrix_x4_trans(b, smem_addr(s.v + am_smem(am_v_ldm_row(lane, kk), am_v_ldm_col(lane, p))));
                    mma_16816(o[2 * p], pf[kk], b[0], b[1]);
                    mma_16816(o[2 * p + 1], pf[kk], b[2], b[3]);
                }
        }
    }

    // O / l, FP16, real rows only: columns (d, d + 1) of query j as one 32-bit store.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const float inv = 1.f / l[h];
        const int j = am_acc_query(warp, lane, 2 * h);
        if (am_query_row(j) < rows) {
            half_t* dst = out_rows + block_off;
#pragma unroll
            for (int n = 0; n < AM_ON; ++n)
                *reinterpret_cast<uint32_t*>(dst + am_query_offset(j, am_acc_col(lane, n, 2 * h), row_stride)) =
                    pack_f16x2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        }
    }
}
