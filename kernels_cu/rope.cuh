// rope.cuh — one RoPE pair of the fused q|k|v projection: rotate it (q and k heads) and store it
// (q to its output, k and v into this layer's KV cache at `pos`). Shared by gemv_qkv_rope (decode)
// and rope_kv_rows (prefill) so that both paths rotate and lay out the cache identically.
//
// Pair p = head * hd/2 + j holds dims j and j + hd/2 of head `head`, heads ordered q (n_heads),
// k (n_kv_heads), v (n_kv_heads). Rotate-half: (y0, y1) -> (y0 cos - y1 sin, y1 cos + y0 sin),
// cos, sin = cs[2j], cs[2j + 1] with cs = rope[pos] ([hd/2, 2] float32).
// k_cache, v_cache: [n_kv_heads, max_seq, hd] FP16.
#pragma once
#include "common.cuh"

// Pair p's head and its dim j < hd / 2. hd is a power of two (cullama.runtime.plan.check_supported): a shift and a
// mask, not an integer division per pair (a dozen instructions each, in every qkv block's address setup).
__device__ __forceinline__ int pair_head(int p, int hd) { return p >> (__ffs(hd) - 2); }
__device__ __forceinline__ int pair_dim(int p, int hd) { return p & (hd / 2 - 1); }

__device__ __forceinline__ void store_value(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_value(half_t* p, float v) { *p = f2h(v); }

template <typename QT>  // float (decode) or half_t (prefill)
__device__ __forceinline__ void rope_store_pair(int p, float y0, float y1, const float* __restrict__ cs,
                                                QT* __restrict__ q_out, half_t* __restrict__ k_cache,
                                                half_t* __restrict__ v_cache, int pos, int n_heads,
                                                int n_kv_heads, int hd, int max_seq) {
    const int half_hd = hd / 2, head = pair_head(p, hd), j = pair_dim(p, hd);
    if (head < n_heads + n_kv_heads) {  // q and k rotate; v does not
        const float2 c_s = reinterpret_cast<const float2*>(cs)[j];  // one 8-byte load (cs: rope's row, 8-aligned)
        const float c = c_s.x, s = c_s.y;
        // Rounded products, never contracted into an FMA: every caller rotates a pair bit for bit alike
        // (decode and verify rows are compared bit for bit; NVRTC contracts a*b + c where it likes).
        const float r0 = __fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, s));
        const float r1 = __fadd_rn(__fmul_rn(y1, c), __fmul_rn(y0, s));
        y0 = r0;
        y1 = r1;
    }
    if (head < n_heads) {
        store_value(q_out + head * hd + j, y0);
        store_value(q_out + head * hd + j + half_hd, y1);
    } else {
        const bool is_k = head < n_heads + n_kv_heads;
        const int kv_head = head - n_heads - (is_k ? 0 : n_kv_heads);
        half_t* cache = (is_k ? k_cache : v_cache) + ((size_t)kv_head * max_seq + pos) * hd;
        cache[j] = f2h(y0);
        cache[j + half_hd] = f2h(y1);
    }
}
