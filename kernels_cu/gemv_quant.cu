// gemv_quant.cu — gemv.cu's decode kernels on INT4 / INT8 weights (weight-only quantization, W4A16 / W8A16),
// for TOKENS token rows at once: 1 for a decode step, k + 1 for a speculative verify step.
//
//   gemv_qkv_rope      q|k|v = W_qkv · rmsnorm(x) + b   + RoPE on q and k, k and v written to the KV cache
//                      (b: FP16, as AWQ and GPTQ keep Qwen2's biases)
//   gemv_residual      x += W · in                  (o_proj on the attention output, down_proj on h)
//   gemv_gate_up_silu  h = silu(W_gate · n) * (W_up · n),  n = rmsnorm(x)
// (no gemv_logits: the lm_head stays FP16, as AWQ and GPTQ keep it; gemv.cu's runs it)
//
// Weights, cullama/model/quant.py's device format: qweight [M, K * BITS / 32] uint32, each row K / CODES 16-byte vectors
// of CODES = 128 / BITS codes (32 or 16) interleaved for dequant.cuh; qparams [M, K / group, 2] FP16 (scale, zero);
// W[r, k] = (q - zero) * scale. Parameters are gemv.cu's with W replaced by (qweight, qparams) and `group` last.
// Variants (compile-time): BITS (4 | 8), ROWS (output rows per block, even), UNROLL (vectors per row per thread in
// one batch of loads), TOKENS (1..9); cullama/runtime/ops/gemv_quant.py chooses them (defines, rows_per_block).
// Launch: gemv.cu's: 1-D grid, THREADS (128) threads; qkv ceil(pairs / PAIRS), residual ceil(M / ROWS), gate_up
// ceil(ff / PAIRS) blocks. Each block owns ROWS rows; its threads sweep K together, thread i taking vectors i,
// i + THREADS, ... of every row, ROWS x UNROLL streaming 16-byte code loads and as many 4-byte (scale, zero) loads
// in flight per thread; then gemv.cuh's block reduction and epilogue.
// Shapes: K % CODES == 0, group % CODES == 0 and K % group == 0 (a vector lies in one group; group = K: one per
// row); any M; x, in and the outputs as in gemv.cu ([TOKENS, width] float32 rows, 16-byte aligned).
// Arithmetic: each pair of codes becomes the FP16 pair (q - zero) in registers, exactly (dequant.cuh: a lop3 or
// prmt and one FP16x2 subtraction), then two float32 values; a vector's products with x are summed in float32,
// part = Σ (q_e - zero) x_e over its codes in order, and the group's scale applied once per vector:
// acc = fmaf(part, scale, acc). So W is never formed: the float32 result differs from Σ W[r, k] x_k (quant.py's
// exact weights, the twin) by float32 rounding only. Row t's arithmetic is exactly the one-row kernel's whatever
// TOKENS, ROWS and UNROLL are (gemv.cu's argument: the same vectors per thread in the same order, explicit fmaf,
// the same reduction), so a verify step equals the plain steps bit for bit (tests/runtime/test_sass_dataflow.py compares the
// variants' machine code, QUAD_UNROLL's rolled loop against the unrolled one iteration by iteration).
// Overlap: as gemv.cu, the first batch of code and (scale, zero) loads is issued before pdl_wait().
#ifndef BITS
#define BITS 4
#endif
#ifndef ROWS
#define ROWS 8
#endif
#ifndef UNROLL
#define UNROLL 1
#endif
#include "gemv.cuh"
#include "dequant.cuh"

#if BITS != 4 && BITS != 8
#error "BITS must be 4 or 8"
#endif
#define CODES (128 / BITS)        // codes per 16-byte vector (quant.VECTOR)
#define WORD_QUADS (8 / BITS)     // quads of codes per 32-bit word: the unit of the dot product's inner loop
// A decode step unrolls a vector's quads (each row's word is then a register, each shift a constant); a verify
// step keeps them rolled: its token rows need the registers that hoisting the next quads' x loads would take
// (unrolled, 9 INT4 token rows spill on sm_120 at 255 registers; rolled, they take ~200), and its word selects and
// shifts are shared by every token row.
#define QUAD_UNROLL (TOKENS == 1 ? CODES / 4 : 1)
// Resident blocks per SM that ptxas must leave room for (registers at most 65536 / (MIN_BLOCKS * 128): 128, 168,
// 255). A decode block of 4 rows fits 128 registers with no spills on sm_80 .. sm_120; 8 rows need more (ptxas
// spills on sm_80 / sm_100 at 128) and 3 such blocks still keep 48 KB of codes in flight per SM. More token rows
// hold more sums: up to 3 fit 128 registers, up to 6 168, 7 to 9 need 2 blocks' worth (~165-213 on sm_80 ..
// sm_120). 0 spills everywhere (CI checks).
#ifndef MIN_BLOCKS
#define MIN_BLOCKS (TOKENS == 1 ? (ROWS >= 8 ? 3 : 4) : TOKENS <= 3 ? 4 : TOKENS <= 6 ? 3 : 2)
#endif

// One block's rows and the batch of loads in flight: w[u][r] and p[u][r] are row r's vector base + u * THREADS
// and the (scale, zero) word of its group.
struct QuantLoads {
    const uint4* row[ROWS];        // row r's code vectors
    const uint32_t* params[ROWS];  // row r's (scale, zero) words, one per group
    int vecs, group_vecs;          // per row: K / CODES vectors; per group: group / CODES
    uint4 w[UNROLL][ROWS];
    uint32_t p[UNROLL][ROWS];
};

__device__ __forceinline__ void load_batch(QuantLoads& b, int base) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // issue every load of the batch before the first use
        const int v = base + u * THREADS;
        const bool inside = v < b.vecs;
        const int group = inside ? v / b.group_vecs : 0;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            b.w[u][r] = inside ? load_stream(b.row[r] + v) : make_uint4(0, 0, 0, 0);
            b.p[u][r] = inside ? b.params[r][group] : 0u;
        }
    }
}

__device__ __forceinline__ void first_batch(QuantLoads& b, const unsigned int* __restrict__ qweight,
                                            const half_t* __restrict__ qparams, const int (&rows)[ROWS], int K,
                                            int group) {
    b.vecs = K / CODES, b.group_vecs = group / CODES;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        b.row[r] = reinterpret_cast<const uint4*>(qweight) + (size_t)rows[r] * b.vecs;
        b.params[r] = reinterpret_cast<const uint32_t*>(qparams) + (size_t)rows[r] * (K / group);
    }
    load_batch(b, threadIdx.x);
}

// gemv.cu's block_dot_rows on quantized rows: dot[t][r] = W[rows[r], :] · (x_t ⊙ g) (g = 1 without NORM),
// ss[t] = Σ x_t² (NORM only), for the rows first_batch set up and the TOKENS rows of x ([TOKENS, K]); on
// return (after a barrier) thread t < TOKENS gets token row t's sums from reduced().
template <bool NORM>
__device__ __forceinline__ void block_dot_rows(QuantLoads& b, int K, const float* __restrict__ x,
                                               const half_t* __restrict__ g, RowSums& sums) {
    const int nvec = b.vecs;
    float acc[TOKENS][ROWS], ss[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        ss[t] = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.f;
    }
    for (int base = threadIdx.x; base < nvec; base += THREADS * UNROLL) {
        if (base != (int)threadIdx.x) load_batch(b, base);  // the first batch is in flight
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int v = base + u * THREADS;
            if (v >= nvec) continue;  // not break: a break can keep the loop from unrolling
            float part[TOKENS][ROWS];  // Σ (q - zero) x over this vector's codes, per token and row
            uint32_t bias[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                bias[r] = zero_bias(b.p[u][r]);
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) part[t][r] = 0.f;
            }
#pragma unroll QUAD_UNROLL
            for (int c = 0; c < CODES / 4; ++c) {  // the vector's quads: codes k0 .. k0 + 3, of word j
                const int k0 = v * CODES + 4 * c, j = c / WORD_QUADS, q = c % WORD_QUADS;
                // x first (the quad's inputs of every token row, RMSNorm's weights applied), then each row's quad
                // dequantized and multiplied with them: the registers hold 4 inputs per token row and one row's
                // pairs at a time (a verify step's 9 token rows leave no room for more).
                float xv[TOKENS][4];
                float gv[4];
                if (NORM) {
                    const uint2 gw = *reinterpret_cast<const uint2*>(g + k0);
                    gv[0] = lo_f(gw.x), gv[1] = hi_f(gw.x), gv[2] = lo_f(gw.y), gv[3] = hi_f(gw.y);
                }
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) {
                    const float4 x4 = *reinterpret_cast<const float4*>(x + (size_t)t * K + k0);
                    xv[t][0] = x4.x, xv[t][1] = x4.y, xv[t][2] = x4.z, xv[t][3] = x4.w;
                    if (NORM) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            ss[t] = fmaf(xv[t][i], xv[t][i], ss[t]);
                            xv[t][i] = __fmul_rn(xv[t][i], gv[i]);
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const uint32_t word = j == 0 ? b.w[u][r].x : j == 1 ? b.w[u][r].y : j == 2 ? b.w[u][r].z
                                                                                       : b.w[u][r].w;
                    const uint32_t p0 = code_pair<BITS>(word, bias[r], 2 * q);  // codes 4q, 4q + 1 of the word
                    const uint32_t p1 = code_pair<BITS>(word, bias[r], 2 * q + 1);
                    const float w[4] = {lo_f(p0), hi_f(p0), lo_f(p1), hi_f(p1)};  // q - zero
#pragma unroll
                    for (int t = 0; t < TOKENS; ++t) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) part[t][r] = fmaf(w[i], xv[t][i], part[t][r]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float scale = lo_f(b.p[u][r]);
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) acc[t][r] = fmaf(part[t][r], scale, acc[t][r]);
            }
        }
    }
    block_reduce<NORM>(acc, ss, sums);
}

// grid: ceil(pairs / PAIRS), pairs = (n_heads + 2 n_kv_heads) * hd / 2. W_qkv [(n_heads + 2 n_kv_heads) * hd, d];
// the bias and outputs as qkv_rope_store (gemv.cuh) says.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_qkv_rope(const float* __restrict__ x, const half_t* __restrict__ norm_w, const unsigned int* __restrict__ qweight,
              const half_t* __restrict__ qparams, const half_t* __restrict__ bias, float* __restrict__ q_out,
              half_t* __restrict__ k_cache, half_t* __restrict__ v_cache, const float* __restrict__ rope,
              const int* __restrict__ state, const int* __restrict__ step_rows, int d, int n_heads, int n_kv_heads,
              int hd, int max_seq, float eps, int group) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    qkv_rows(rows, n_heads, n_kv_heads, hd);
    QuantLoads loads;
    first_batch(loads, qweight, qparams, rows, d, group);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<true>(loads, d, x, norm_w, sums);
    qkv_rope_store(sums, d, eps, bias, q_out, k_cache, v_cache, rope, state, step_rows, n_heads, n_kv_heads, hd,
                   max_seq);
}

// grid: ceil(M / ROWS). x [TOKENS, M] float32 += W [M, K] · in [TOKENS, K].
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_residual(const float* __restrict__ in, const unsigned int* __restrict__ qweight,
              const half_t* __restrict__ qparams, float* __restrict__ x, int M, int K, int group) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    plain_rows(rows, M);
    QuantLoads loads;
    first_batch(loads, qweight, qparams, rows, K, group);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<false>(loads, K, in, nullptr, sums);
    residual_store(sums, x, M);
}

// grid: ceil(ff / PAIRS). W [2 ff, d]: gate rows then up rows. h [TOKENS, ff] float32.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_gate_up_silu(const float* __restrict__ x, const half_t* __restrict__ norm_w,
                  const unsigned int* __restrict__ qweight, const half_t* __restrict__ qparams, float* __restrict__ h,
                  int ff, int d, float eps, int group) {
    __shared__ RowSums sums;
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    int rows[ROWS];
    gate_up_rows(rows, ff);
    QuantLoads loads;
    first_batch(loads, qweight, qparams, rows, d, group);
    pdl_wait();  // everything below may read what the previous kernel wrote
    block_dot_rows<true>(loads, d, x, norm_w, sums);
    gate_up_store(sums, h, ff, d, eps);
}
