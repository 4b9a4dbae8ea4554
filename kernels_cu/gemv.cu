// gemv.cu — the decode step's matrix-vector products, each with its neighbours fused in, for TOKENS token
// rows at once: 1 for a decode step, k + 1 for a speculative verify step (the last token and k drafts).
//
//   gemv_qkv_rope      q|k|v = W_qkv · rmsnorm(x) + b   + RoPE on q and k, k and v written to the KV cache
//   gemv_residual      x += W · in                  (o_proj on the attention output, down_proj on h)
//   gemv_gate_up_silu  h = silu(W_gate · n) * (W_up · n),  n = rmsnorm(x)
//   gemv_logits        logits = W_lm_head · rmsnorm(x)
//
// Launch: 1-D grid, THREADS (128) threads; each block owns ROWS output rows and all 128 threads
// sweep K together in 16-byte vectors (split-K inside the block, reduced through shared memory),
// with UNROLL x ROWS streaming loads in flight per thread. RMSNorm is free here: the block reads
// all of x for the dot product anyway, so it sums x^2 on the way and scales the result.
// Shapes: W [M, K] FP16 row-major, K % 8 == 0, any M; x, in: [TOKENS, K] float32 (row t at t * K), outputs
// [TOKENS, M] likewise, except logits: row t at t * logits_stride(V) (V rounded up to 4, common.cuh); 16-byte
// aligned rows. Token row t's sequence slot and position come from the step's rows table (common.cuh: a decode
// step's one row, a verify step's k + 1 rows of one slot, a batched step's rows of B slots); only gemv_qkv_rope
// reads them (RoPE's angle, the KV cache row it writes).
// Rows that need each other share a block: RoPE pairs (j, j + hd/2) of one head, and the gate
// and up rows (r, ff + r) of one SwiGLU unit.
// Token rows: each weight vector a thread loads is multiplied with all TOKENS rows of x, so W is read once
// for all of them. Row t's arithmetic is exactly the 1-row kernel's on that row, whatever TOKENS, ROWS and
// UNROLL are: thread i always adds the products of its vectors i, i + THREADS, i + 2 THREADS, ... in that
// order, with explicit fmaf (NVRTC would contract a*b + c on its own, and could decide differently when the
// code around it differs), then the same warp butterfly and the same sum over warps in order; the epilogues'
// arithmetic is explicit too (__fadd_rn, __fmul_rn, __fdiv_rn: nothing left to contract). So a verify step's and a
// batched step's logits equal the plain steps' bit for bit (tests/runtime/test_verify.py, tests/runtime/ops/test_batch_kernels.py;
// tests/runtime/test_sass_dataflow.py compares the variants' machine code).
// Overlap: each kernel lets the next one launch at once (pdl_launch_dependents) and issues its first
// batch of weight loads before pdl_wait(), so under programmatic dependent launch (the decode graph's
// `overlap` mode) a block streams its weights while the previous kernel's tail runs.
// What is not about FP16 weights (token rows, the block's rows, the block reduction, the epilogues) is in
// gemv.cuh, shared with gemv_quant.cu (the same kernels on INT4 / INT8 weights).
#ifndef ROWS
#define ROWS 4  // output rows per block (even: pairs)
#endif
#ifndef UNROLL
#define UNROLL 4  // 16-byte loads per row per thread in one batch
#endif
#include "gemv.cuh"

// Resident blocks per SM that ptxas must leave room for: at most 65536 / (5 * 128) = 102 registers.
// Without it the split first batch (below) takes 108-115 registers and only 4 blocks fit: fewer
// loads in flight per SM. 0 spills either way (CI checks). More token rows hold more sums: fewer blocks.
#ifndef MIN_BLOCKS
#define MIN_BLOCKS (TOKENS == 1 ? 5 : TOKENS <= 3 ? 4 : TOKENS <= 5 ? 3 : 2)
#endif

// One block's weight rows and the batch of streaming loads in flight: w[u][r] is row r's vector
// base + u * THREADS. Kernels issue the first batch before pdl_wait(): it reads only W, which no kernel
// writes, so under programmatic dependent launch the block streams its weights while the kernel before
// it is still finishing. For K = 4096 (ROWS 4, UNROLL 4) that first batch is the block's whole slice.
struct RowLoads {
    const uint4* row[ROWS];
    uint4 w[UNROLL][ROWS];
};

__device__ __forceinline__ void load_batch(RowLoads& b, int base, int nvec) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // issue every load of the batch before the first use
        const int v = base + u * THREADS;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) b.w[u][r] = v < nvec ? load_stream(b.row[r] + v) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void first_batch(RowLoads& b, const half_t* __restrict__ W, const int (&rows)[ROWS],
                                            int K) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) b.row[r] = reinterpret_cast<const uint4*>(W + (size_t)rows[r] * K);
    load_batch(b, threadIdx.x, K / 8);
}

// dot[t][r] = W[rows[r], :] · (x_t ⊙ g) (g = 1 without NORM), ss[t] = Σ x_t² (NORM only), for the rows that
// first_batch set up and the TOKENS rows of x ([TOKENS, K]). Block-wide; on return (after a barrier) thread
// t < TOKENS gets token row t's sums from reduced(), summed over the warps in order.
template <bool NORM>
__device__ __forceinline__ void block_dot_rows(RowLoads& b, int K, const float* __restrict__ x,
                                               const half_t* __restrict__ g, RowSums& sums) {
    const int nvec = K / 8;
    float acc[TOKENS][ROWS], ss[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        ss[t] = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;
    }
    for (int base = threadIdx.x; base < nvec; base += THREADS * UNROLL) {
        if (base != (int)threadIdx.x) load_batch(b, base, nvec);  // the first batch is already in flight
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int v = base + u * THREADS;
            if (v >= nvec) continue;  // not break: a break can keep the loop from unrolling
            float wv[ROWS][8];  // each weight vector converted once, for every token row
#pragma unroll
            for (int r = 0; r < ROWS; ++r) unpack8(b.w[u][r], wv[r]);
            float gv[8];
            if (NORM) unpack8(reinterpret_cast<const uint4*>(g)[v], gv);
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                const float4* xt = reinterpret_cast<const float4*>(x + (size_t)t * K);
                const float4 x0 = xt[2 * v], x1 = xt[2 * v + 1];
                float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                if (NORM) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        ss[t] = fmaf(xv[i], xv[i], ss[t]);
                        xv[i] = __fmul_rn(xv[i], gv[i]);
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[t][r] = fmaf(wv[r][i], xv[i], acc[t][r]);
                }
            }
        }
    }
    block_reduce<NORM>(acc, ss, sums);
}

// grid: ceil(qkv_dim / ROWS); rows are RoPE pairs. W_qkv [(n_heads + 2 n_kv_heads) * hd, d]; the bias and
// outputs as qkv_rope_store (gemv.cuh) says.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_qkv_rope(const float* __restrict__ x, const half_t* __restrict__ norm_w, const half_t* __restrict__ W,
              const half_t* __restrict__ bias, float* __restrict__ q_out, half_t* __restrict__ k_cache,
              half_t* __restrict__ v_cache, const float* __restrict__ rope, const int* __restrict__ state,
              const int* __restrict__ step_rows, int d, int n_heads, int n_kv_heads, int hd, int max_seq, float eps) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    qkv_rows(rows, n_heads, n_kv_heads, hd);
    RowLoads loads;
    first_batch(loads, W, rows, d);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<true>(loads, d, x, norm_w, sums);
    qkv_rope_store(sums, d, eps, bias, q_out, k_cache, v_cache, rope, state, step_rows, n_heads, n_kv_heads, hd,
                   max_seq);
}

// grid: ceil(M / ROWS). x [TOKENS, M] float32 += W [M, K] · in [TOKENS, K].
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_residual(const float* __restrict__ in, const half_t* __restrict__ W, float* __restrict__ x, int M, int K) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    plain_rows(rows, M);
    RowLoads loads;
    first_batch(loads, W, rows, K);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<false>(loads, K, in, nullptr, sums);
    residual_store(sums, x, M);
}

// grid: ceil(ff / PAIRS). W [2 ff, d]: gate rows then up rows. h [TOKENS, ff] float32.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_gate_up_silu(const float* __restrict__ x, const half_t* __restrict__ norm_w, const half_t* __restrict__ W,
                  float* __restrict__ h, int ff, int d, float eps) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    gate_up_rows(rows, ff);
    RowLoads loads;
    first_batch(loads, W, rows, d);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<true>(loads, d, x, norm_w, sums);
    gate_up_store(sums, h, ff, d, eps);
}

// grid: ceil(V / ROWS). logits [TOKENS, V] float32 = W [V, d] · rmsnorm(x [TOKENS, d]).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_logits(const float* __restrict__ x, const half_t* __restrict__ norm_w, const half_t* __restrict__ W,
            float* __restrict__ logits, int V, int d, float eps) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    plain_rows(rows, V);
    RowLoads loads;
    first_batch(loads, W, rows, d);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<true>(loads, d, x, norm_w, sums);
    const int t = threadIdx.x;
    if (t >= TOKENS) return;
    float dot[ROWS], ss;
    reduced(sums, t, dot, ss);
    const float scale = rms_scale(ss, d, eps);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = blockIdx.x * ROWS + r;
        if (row < V) logits[(size_t)t * logits_stride(V) + row] = __fmul_rn(dot[r], scale);
    }
}
