// prepare.cuh — the prepared RMSNorm input (gemv_mma.cu's X_PREP): what a kernel that writes a token row of x [d]
// leaves beside it for the RMSNorm GEMV that reads x next, so that GEMV's blocks only load it:
//   xn [d] FP16    = fp16(x * norm_w)                 (x * norm_w rounded to FP32 by __fmul_rn, then to FP16)
//   ssp [parts]    part p = Σ x² over x[p SS_SPAN .. p SS_SPAN + SS_SPAN - 1], one fmaf chain from +0 in element
//                  order (the last part shorter where SS_SPAN does not divide d); parts = ceil(d / SS_SPAN)
// Its writers: gemv_residual's epilogue (x after o_proj and down), sample (the next token's embedding) and
// embed_rows_prepared (a verify or batched step's embeddings). One definition here, so every writer's bits are the
// same and gemv_mma.cu's prepared_scales adds the parts alike whoever wrote them; the NumPy twin is
// cullama/runtime/ops/gemv_mma.py prepare().
#pragma once
#include "common.cuh"

#define SS_SPAN 32  // x elements per Σ x² part: the rows of one gemv_residual block at the plans' NTILES 4

// The FP16 input of an RMSNorm GEMV for element v of x with norm weight w.
__device__ __forceinline__ half_t norm_input(float v, half_t w) { return f2h(__fmul_rn(v, h2f(w))); }

// One part's Σ x² of its first n elements (n <= SS_SPAN), element i from value(i).
template <class Value>
__device__ __forceinline__ float ss_part(Value value, int n) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < SS_SPAN; ++i) {
        if (i < n) {
            const float v = value(i);
            ss = __fmaf_rn(v, v, ss);
        }
    }
    return ss;
}

// A row of x that is an embedding row e [d] FP16 (nullptr: every element `fill`, a row without a token), by the
// block's `threads` threads: x [d] float32, and its prepared input xn [d] and ssp [ceil(d / SS_SPAN)].
__device__ __forceinline__ void embed_prepared(const half_t* __restrict__ e, float fill,
                                               const half_t* __restrict__ norm_w, float* __restrict__ x,
                                               half_t* __restrict__ xn, float* __restrict__ ssp, int d,
                                               int threads) {
    for (int i = threadIdx.x; i < d; i += threads) {
        const float v = e ? h2f(e[i]) : fill;
        x[i] = v;
        xn[i] = norm_input(v, norm_w[i]);
    }
    for (int p = threadIdx.x; p * SS_SPAN < d; p += threads) {
        ssp[p] = ss_part([&](int i) { return e ? h2f(e[p * SS_SPAN + i]) : fill; }, d - p * SS_SPAN);
    }
}
