// prefill.cu — the prompt path's row-wise glue between its GEMMs (gemm.cu), one token row per block.
//
//   embed_rows      x_rows[r] = float(embed[ids[r]]), or NaN everywhere for an id outside [0, vocab)
//   embed_rows_prepared  the same, and each row's prepared RMSNorm input (prepare.cuh) for a decode-step form
//   rmsnorm_rows    out_rows[r] = fp16(x_rows[r] * rsqrt(mean(x_rows[r]^2) + eps) * w)
//   rope_kv_rows    q|k|v row + bias -> RoPE on q and k; q_rows[r] = fp16(q), k and v into the KV cache at start + r
//   silu_mul_rows   h_rows[r, i] = fp16(silu(gate) * up), gate|up = gu_rows[r, i], gu_rows[r, ff + i]
//
// Launch: grid (n) = one block per token row (the launch's row count is its grid; the NumPy twins get
// it as `grid`), THREADS (256, ROW_THREADS in cullama/runtime/plan.py) threads sweep the row. No variants.
// Each kernel waits (pdl_wait) before it reads anything, and lets the next kernel launch at once: under
// programmatic dependent launch (overlap mode) the GEMM after it streams its weights meanwhile.
// Shapes: rows are contiguous with the row strides given below; d % 8 == 0 and ff % 8 == 0 (16-byte
// vectors; cullama.runtime.plan.check_supported guarantees both), hd even. The same math as gemv_mma.cu's fused
// decode kernels (rmsnorm in gemv_* and bias + RoPE + cache write in gemv_qkv_rope), on whole rows.
#include "common.cuh"
#include "prepare.cuh"
#include "rope.cuh"

#define THREADS 256  // ROW_THREADS

__device__ __forceinline__ float silu(float a) { return a / (1.f + expf(-a)); }

// ids [n] int32; embed [vocab, d] FP16; x_rows [n, d] float32.
// The ids are a prompt's, a verify step's drafts or a batched step's last picks: the host checks the first two and
// the sample kernel writes the third, but the gather is bounded here as well (as sample bounds its drafts), so that
// no id can make it read outside embed: a row with an id outside [0, vocab) becomes NaN, its logits NaN, and its
// sample finds no usable logit (NO_TOKEN), which fails that row's request alone.
__device__ __forceinline__ const half_t* embedding_row(const int* __restrict__ ids, const half_t* __restrict__ embed,
                                                       int d, int vocab) {
    const int id = ids[blockIdx.x];
    return id < 0 || id >= vocab ? nullptr : embed + (size_t)id * d;  // nullptr: the row is NaN
}

extern "C" __global__ void __launch_bounds__(THREADS)
embed_rows(const int* __restrict__ ids, const half_t* __restrict__ embed, float* __restrict__ x_rows, int d,
           int vocab) {
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    pdl_wait();               // the rows come from the kernel before
    const half_t* e = embedding_row(ids, embed, d, vocab);
    float4* dst = reinterpret_cast<float4*>(x_rows + (size_t)blockIdx.x * d);
    if (!e) {
        const float4 poison = make_float4(QUIET_NAN, QUIET_NAN, QUIET_NAN, QUIET_NAN);
        for (int v = threadIdx.x; v < d / 4; v += THREADS) dst[v] = poison;
        return;
    }
    const uint4* src = reinterpret_cast<const uint4*>(e);
    for (int v = threadIdx.x; v < d / 8; v += THREADS) {
        float f[8];
        unpack8(src[v], f);
        dst[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
        dst[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// embed_rows for a decode-step form (a verify step's or a batch group's rows): x_rows [n, d] as embed_rows writes
// them, and each row's prepared RMSNorm input (prepare.cuh) for the step's first gemv_qkv_rope: xn_rows [n, d] FP16
// with norm_w [d] FP16 (layer 0's attention norm), ssp_rows [n, ceil(d / SS_SPAN)] float32.
extern "C" __global__ void __launch_bounds__(THREADS)
embed_rows_prepared(const int* __restrict__ ids, const half_t* __restrict__ embed, const half_t* __restrict__ norm_w,
                    float* __restrict__ x_rows, half_t* __restrict__ xn_rows, float* __restrict__ ssp_rows, int d,
                    int vocab) {
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    pdl_wait();               // the rows come from the kernel before
    const size_t r = blockIdx.x, parts = (d + SS_SPAN - 1) / SS_SPAN;
    embed_prepared(embedding_row(ids, embed, d, vocab), QUIET_NAN, norm_w, x_rows + r * d, xn_rows + r * d,
                   ssp_rows + r * parts, d, THREADS);
}

// x_rows [n, d] float32; w [d] FP16; out_rows [n, d] FP16.
extern "C" __global__ void __launch_bounds__(THREADS)
rmsnorm_rows(const float* __restrict__ x_rows, const half_t* __restrict__ w, half_t* __restrict__ out_rows, int d,
             float eps) {
    __shared__ float scratch[WARP];
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    pdl_wait();               // the rows come from the kernel before
    const int r = blockIdx.x;
    const float4* x = reinterpret_cast<const float4*>(x_rows + (size_t)r * d);
    float ss = 0.f;
    for (int v = threadIdx.x; v < d / 8; v += THREADS) {
        const float4 a = x[2 * v], b = x[2 * v + 1];
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
    }
    const float scale = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
    uint4* out = reinterpret_cast<uint4*>(out_rows + (size_t)r * d);
    for (int v = threadIdx.x; v < d / 8; v += THREADS) {  // second pass: the row is in L1 / L2 now
        const float4 a = x[2 * v], b = x[2 * v + 1];
        float g[8];
        unpack8(reinterpret_cast<const uint4*>(w)[v], g);
        const float y[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = (y[i] * scale) * g[i];  // the reference's order: (x * scale) * w
        out[v] = make_uint4(pack_h2(o[0], o[1]), pack_h2(o[2], o[3]), pack_h2(o[4], o[5]), pack_h2(o[6], o[7]));
    }
}

// qkv_rows [n, (n_heads + 2 n_kv_heads) hd] float32 = [q | k | v]; bias [(n_heads + 2 n_kv_heads) hd] FP16
// (Qwen2's; zeros for a model without), added first; rope [max_seq, hd / 2, 2] float32 (cos, sin); q_rows
// [n, n_heads hd] FP16; k_cache, v_cache [n_kv_heads, max_seq, hd] FP16 (this layer's). Row r is position
// start + r; each thread takes whole RoPE pairs (rope.cuh: q and k rotate, v is copied).
extern "C" __global__ void __launch_bounds__(THREADS)
rope_kv_rows(const float* __restrict__ qkv_rows, const half_t* __restrict__ bias, const float* __restrict__ rope,
             half_t* __restrict__ q_rows,
             half_t* __restrict__ k_cache, half_t* __restrict__ v_cache, int start, int n_heads, int n_kv_heads,
             int hd, int max_seq) {
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    pdl_wait();               // the rows come from the kernel before
    const int r = blockIdx.x, pos = start + r, half_hd = hd / 2;
    const int n_pairs = (n_heads + 2 * n_kv_heads) * half_hd;
    const float* row = qkv_rows + (size_t)r * n_pairs * 2;
    const float* cs = rope + (size_t)pos * half_hd * 2;
    half_t* q_out = q_rows + (size_t)r * n_heads * hd;
    for (int p = threadIdx.x; p < n_pairs; p += THREADS) {
        const int head = p / half_hd, j = p % half_hd, at = head * hd + j;
        rope_store_pair(p, __fadd_rn(row[at], h2f(bias[at])), __fadd_rn(row[at + half_hd], h2f(bias[at + half_hd])),
                        cs, q_out, k_cache, v_cache, pos, n_heads, n_kv_heads, hd, max_seq);
    }
}

// gu_rows [n, 2 ff] float32 (gate | up); h_rows [n, ff] FP16. Four columns per thread per step.
extern "C" __global__ void __launch_bounds__(THREADS)
silu_mul_rows(const float* __restrict__ gu_rows, half_t* __restrict__ h_rows, int ff) {
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    pdl_wait();               // the rows come from the kernel before
    const int r = blockIdx.x;
    const float4* gate = reinterpret_cast<const float4*>(gu_rows + (size_t)r * 2 * ff);
    const float4* up = reinterpret_cast<const float4*>(gu_rows + (size_t)r * 2 * ff + ff);
    uint2* h = reinterpret_cast<uint2*>(h_rows + (size_t)r * ff);
    for (int v = threadIdx.x; v < ff / 4; v += THREADS) {
        const float4 g = gate[v], u = up[v];
        h[v] = make_uint2(pack_h2(silu(g.x) * u.x, silu(g.y) * u.y), pack_h2(silu(g.z) * u.z, silu(g.w) * u.w));
    }
}
