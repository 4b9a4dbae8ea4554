// gemv.cuh — what the decode step's matrix-vector kernels share, whatever their weights are stored as (gemv.cu:
// FP16; gemv_quant.cu: INT4 / INT8): the token rows, the output rows a block owns, the sum of the threads' dot
// products over the block, and the fused epilogues (RMSNorm's scale, RoPE + the KV-cache write, SiLU * up, the
// residual add, q|k|v's bias). A kernel is: its block's rows (*_rows), its first weight loads, pdl_wait(), its own dot product
// loop ending in block_reduce(), then the epilogue (*_store), which thread t < TOKENS runs for token row t.
// The including .cu defines ROWS (output rows per block, even) first.
#pragma once
#include "common.cuh"
#include "rope.cuh"

#ifndef TOKENS
#define TOKENS 1  // token rows per launch: 1 = a decode step, k + 1 = a verify step of k drafts, B = a batched step
#endif
#define THREADS 128
#define PAIRS (ROWS / 2)

#if TOKENS < 1 || TOKENS > 9
#error "TOKENS must be 1..9 (a verify step of at most 8 drafts; a batched step's group of rows)"
#endif
#if ROWS % 2
#error "ROWS must be even: RoPE pairs and gate/up pairs share a block"
#endif

// The per-warp sums in shared memory; reduced() adds them up, in warp order, for one token row.
struct RowSums {
    float partial[THREADS / WARP][TOKENS][ROWS + 1];  // per warp: the ROWS dot products, then ss
};

// Each thread's dot products acc[t][r] and sums of squares ss[t] (0 without NORM) -> sums: a warp butterfly,
// then lane 0 of each warp stores its warp's; on return (after a barrier) reduced() can read them.
template <bool NORM>
__device__ __forceinline__ void block_reduce(float (&acc)[TOKENS][ROWS], float (&ss)[TOKENS], RowSums& sums) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[t][r] = warp_sum(acc[t][r]);
        if (NORM) ss[t] = warp_sum(ss[t]);
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) sums.partial[warp][t][r] = acc[t][r];
            sums.partial[warp][t][ROWS] = ss[t];
        }
    }
    __syncthreads();
}

// Token row t's sums over the warps, in warp order: dot[r] for the block's ROWS rows, and ss.
__device__ __forceinline__ void reduced(const RowSums& sums, int t, float (&dot)[ROWS], float& ss) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        dot[r] = 0.f;
        for (int w = 0; w < THREADS / WARP; ++w) dot[r] = __fadd_rn(dot[r], sums.partial[w][t][r]);
    }
    ss = 0.f;
    for (int w = 0; w < THREADS / WARP; ++w) ss = __fadd_rn(ss, sums.partial[w][t][ROWS]);
}

// The epilogues' arithmetic is explicit (__fadd_rn, __fmul_rn, __fdiv_rn): nothing for ptxas to contract one way
// in one variant and another way in another (tests/runtime/test_sass_dataflow.py).
__device__ __forceinline__ float rms_scale(float ss, int K, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)K), eps));
}

__device__ __forceinline__ float silu(float a) { return __fdiv_rn(a, __fadd_rn(1.f, expf(-a))); }

// -- the rows of a block: clamped to the last one past the end (computed, never stored) ----------------------
// q|k|v: RoPE pairs (j, j + hd/2) of one head; PAIRS pairs per block.
__device__ __forceinline__ void qkv_rows(int (&rows)[ROWS], int n_heads, int n_kv_heads, int hd) {
    const int half_hd = hd / 2, n_pairs = (n_heads + 2 * n_kv_heads) * half_hd;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int p = min((int)blockIdx.x * PAIRS + i, n_pairs - 1);
        const int row0 = (p / half_hd) * hd + p % half_hd;
        rows[2 * i] = row0;
        rows[2 * i + 1] = row0 + half_hd;
    }
}

// ROWS consecutive rows of M (o_proj, down, lm_head).
__device__ __forceinline__ void plain_rows(int (&rows)[ROWS], int M) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = min((int)blockIdx.x * ROWS + r, M - 1);
}

// gate|up: PAIRS SwiGLU units (r, ff + r) per block.
__device__ __forceinline__ void gate_up_rows(int (&rows)[ROWS], int ff) {
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int r = min((int)blockIdx.x * PAIRS + i, ff - 1);
        rows[2 * i] = r;
        rows[2 * i + 1] = ff + r;
    }
}

// -- the epilogues: thread t < TOKENS writes token row t's outputs --------------------------------------------
// bias [(n_heads + 2 n_kv_heads) hd] FP16, added to each q|k|v output before RoPE (Qwen2's; zeros for a model
// without, as HF adds it: (W · rmsnorm(x)) + b); q_out [TOKENS, n_heads * hd] float32 (after RoPE); k_cache,
// v_cache [slots, n_kv_heads, max_seq, hd] FP16 (this layer's), token row t's written in its slot at its position
// (state [slots, 8], step_rows [TOKENS, 2]: common.cuh); rope [max_seq, hd / 2, 2] float32 (cos, sin).
__device__ __forceinline__ void qkv_rope_store(const RowSums& sums, int d, float eps,
                                               const half_t* __restrict__ bias, float* __restrict__ q_out,
                                               half_t* __restrict__ k_cache, half_t* __restrict__ v_cache,
                                               const float* __restrict__ rope, const int* __restrict__ state,
                                               const int* __restrict__ step_rows, int n_heads, int n_kv_heads, int hd, int max_seq) {
    const int t = threadIdx.x;
    if (t >= TOKENS) return;
    const int half_hd = hd / 2, n_pairs = (n_heads + 2 * n_kv_heads) * half_hd;
    float dot[ROWS], ss;
    reduced(sums, t, dot, ss);
    const float scale = rms_scale(ss, d, eps);
    const int pos = row_pos(step_rows, state, t);
    const size_t slot_off = (size_t)row_slot(step_rows, t) * n_kv_heads * max_seq * hd;  // the row's slot's cache
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int p = blockIdx.x * PAIRS + i;
        if (p >= n_pairs) continue;
        const int row0 = (p / half_hd) * hd + p % half_hd;  // the pair's rows: row0, row0 + hd / 2 (qkv_rows)
        // Rounded products and adds, never contracted: every token row scales and adds alike (verify == decode)
        const float y0 = __fadd_rn(__fmul_rn(dot[2 * i], scale), h2f(bias[row0]));
        const float y1 = __fadd_rn(__fmul_rn(dot[2 * i + 1], scale), h2f(bias[row0 + half_hd]));
        rope_store_pair(p, y0, y1, rope + pos * half_hd * 2, q_out + (size_t)t * n_heads * hd, k_cache + slot_off,
                        v_cache + slot_off, pos, n_heads, n_kv_heads, hd, max_seq);
    }
}

// x [TOKENS, M] float32 += the dot products.
__device__ __forceinline__ void residual_store(const RowSums& sums, float* __restrict__ x, int M) {
    const int t = threadIdx.x;
    if (t >= TOKENS) return;
    float dot[ROWS], ss;
    reduced(sums, t, dot, ss);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = blockIdx.x * ROWS + r;
        if (row < M) x[(size_t)t * M + row] = __fadd_rn(x[(size_t)t * M + row], dot[r]);
    }
}

// h [TOKENS, ff] float32 = silu(gate) * up, both scaled by RMSNorm.
__device__ __forceinline__ void gate_up_store(const RowSums& sums, float* __restrict__ h, int ff, int d, float eps) {
    const int t = threadIdx.x;
    if (t >= TOKENS) return;
    float dot[ROWS], ss;
    reduced(sums, t, dot, ss);
    const float scale = rms_scale(ss, d, eps);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const int r = blockIdx.x * PAIRS + i;
        const float gate = __fmul_rn(dot[2 * i], scale), up = __fmul_rn(dot[2 * i + 1], scale);
        if (r < ff) h[(size_t)t * ff + r] = __fmul_rn(silu(gate), up);
    }
}
