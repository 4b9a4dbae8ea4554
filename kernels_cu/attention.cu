// attention.cu — softmax(q·K^T * scale)·V over the KV cache, for the decode step and for a prompt chunk.
//
//   attention_decode   one new token: flash-decoding, the keys it sees split across gridDim.y blocks per
//                      kv head; the last block of each kv head to finish combines the splits. The token rows
//                      are gridDim.z, each with its slot and position from the rows table (common.cuh): a
//                      verify step's k + 1 rows of one sequence, a batched step's rows of B sequences. Row t
//                      runs exactly the one-row computation over its own slot's keys, its own splits
//                      included, so each row is bit for bit what a decode step of that sequence at that
//                      position computes, whatever the other rows are
//   attention_prefill  a prompt chunk: row r (position start + r) attends causally to its keys; a block
//                      takes ROWS_Q rows of one kv head, so each key is loaded once per ROWS_Q rows
//
// The keys a query at position p sees: p - window + 1 .. p (and >= 0), `window` the sliding window (Mistral's
// sliding_window; a window >= max_seq: every key 0..p, plain causal attention). Decode splits only those keys,
// so a long context costs the window, not its length; prefill starts each block at its first row's first key
// and masks the rest per row. The KV cache keeps every position (max_seq of them).
//
// Variants: HEAD_DIM (a power of two, 8..128), GROUP (query heads per kv head, 1..8) and, for prefill
// only, ROWS_Q (query rows per block, 1..8), all compile-time. Launch: grid (n_kv_heads, splits) for
// decode ((n_kv_heads, splits, rows) for a verify step), (n_kv_heads, ceil(n_rows / ROWS_Q)) for prefill;
// THREADS (128) threads. Inside a block, LPK = HEAD_DIM / 8 lanes share one key (a 16-byte load of 8
// halves each), so a warp covers 32 / LPK keys at once and every key of K and V is loaded once for all
// the block's queries: the GROUP query heads of its kv head (decode), times ROWS_Q rows (prefill). Each
// lane group keeps an online softmax (m, l, acc) per query for its keys, UNROLL keys per batch with all
// their loads issued first; lane groups merge through shuffles, warps through shared memory.
// Shapes: q [rows, n_heads * HD] float32 (decode: rows = gridDim.z, 1 for a decode step); q_rows, out_rows
// [rows, n_heads * HD] FP16; k_cache, v_cache: decode [slots, n_kv_heads, max_seq, HD] FP16 (this layer's, every
// slot's), prefill [n_kv_heads, max_seq, HD] (this layer's, the prompt's slot's); state [slots, STATE_LEN], rows
// [rows, ROW_FIELDS] int32 (decode); part [rows, n_heads, splits, HD + 2] float32 (acc[HD], m, l: unnormalised
// sums of one split); count [rows, n_kv_heads] uint32, zero between launches; out [rows, n_heads * HD] FP16 (o_proj's
// input as it multiplies it: rounded once here, not in each of its blocks).
// Query head h uses kv head h / GROUP.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef ROWS_Q
#define ROWS_Q 1                                 // prefill only: query rows per block
#endif
#define THREADS 128
#define WARPS (THREADS / WARP)
#define LPK (HEAD_DIM / 8)                       // lanes per key
#define KEYS_PER_WARP (WARP / LPK)               // keys one warp covers at once
#define LANE_GROUPS (THREADS / LPK)              // keys one block covers at once
#ifndef UNROLL
#define UNROLL (GROUP >= 4 ? 2 : 4)              // keys per lane group per batch (loads in flight)
#endif
#define PART_STRIDE (HEAD_DIM + 2)

#if HEAD_DIM < 8 || HEAD_DIM > 128 || (HEAD_DIM & (HEAD_DIM - 1))
#error "HEAD_DIM must be a power of two from 8 to 128"
#endif
#if GROUP < 1 || GROUP > 8
#error "GROUP must be 1..8"
#endif

// e^(a - b), where a may be -inf (an empty state or a masked key) and b >= a: 0 then, never NaN.
__device__ __forceinline__ float exp_diff(float a, float b) { return a == NEG_INF ? 0.f : expf(a - b); }

// Each warp's softmax state of NQ queries (acc rows stay 16-byte aligned for float4 stores).
template <int NQ>
struct State {
    float acc[WARPS][NQ][HEAD_DIM];
    float m[WARPS][NQ];
    float l[WARPS][NQ];
};

// Online softmax of the NQ queries in q over keys [begin, end) of one kv head, UNR keys per lane group
// per batch. q holds this lane's 8 dimensions (sub * 8 ..) of each query. CAUSAL (prefill): query j is
// row r = j / GROUP and sees only the keys [lim - window, lim), lim = min(first_end + r, end) (first_end is
// row 0's limit, end the last row's); otherwise first_end and window are unused. On return (after a barrier)
// red holds each warp's state; combine_warps() merges them.
template <int NQ, int UNR, bool CAUSAL>
__device__ __forceinline__ void attend_queries(const float (&q)[NQ][8], const half_t* __restrict__ kc,
                                               const half_t* __restrict__ vc, int begin, int end, int first_end,
                                               int window, float scale, State<NQ>* red) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int sub = lane % LPK, grp = threadIdx.x / LPK;
    float m[NQ], l[NQ], acc[NQ][8];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        m[j] = NEG_INF;
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
    }
    kc += sub * 8;
    vc += sub * 8;
    for (int base = begin; base < end; base += LANE_GROUPS * UNR) {  // base is block-uniform
        uint4 kr[UNR], vr[UNR];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {  // every load of the batch before the first use
            const int key = base + u * LANE_GROUPS + grp;
            kr[u] = key < end ? load_stream(kc + (size_t)key * HEAD_DIM) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int key = base + u * LANE_GROUPS + grp;
            vr[u] = key < end ? load_stream(vc + (size_t)key * HEAD_DIM) : make_uint4(0, 0, 0, 0);
        }
        float s[UNR][NQ];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            float kf[8];
            unpack8(kr[u], kf);
            const int key = base + u * LANE_GROUPS + grp;
            const bool valid = key < end;
            const int past = key - first_end;  // causal: row r sees this key iff past < r (and key < end)
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += q[j][i] * kf[i];
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                // the window: past >= lim - first_end - window (block-uniform but for r: hoisted)
                const bool seen = !CAUSAL || (past < j / GROUP && past >= min(j / GROUP, end - first_end) - window);
                s[u][j] = valid && seen ? dot * scale : NEG_INF;
            }
        }
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float mx = m[j];
#pragma unroll
            for (int u = 0; u < UNR; ++u) mx = fmaxf(mx, s[u][j]);
            const float c = exp_diff(m[j], mx);
            l[j] *= c;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][i] *= c;
            m[j] = mx;
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            float vf[8];
            unpack8(vr[u], vf);
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                const float p = exp_diff(s[u][j], m[j]);
                l[j] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[j][i] += p * vf[i];
            }
        }
    }
    // Merge the lane groups of this warp: lanes sub, sub + LPK, sub + 2 LPK, ... hold the same dims.
#pragma unroll
    for (int o = LPK; o < WARP; o <<= 1) {
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[j], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[j], o);
            const float mx = fmaxf(m[j], mo);
            const float c = exp_diff(m[j], mx), co = exp_diff(mo, mx);
            l[j] = l[j] * c + lo * co;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][i] = acc[j][i] * c + __shfl_xor_sync(0xffffffffu, acc[j][i], o) * co;
            m[j] = mx;
        }
    }
    if (lane < LPK) {
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float4* a = reinterpret_cast<float4*>(red->acc[warp][j] + sub * 8);
            a[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            a[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
            if (sub == 0) {
                red->m[warp][j] = m[j];
                red->l[warp][j] = l[j];
            }
        }
    }
    __syncthreads();
}

// The block's state of query j: acc[d] (d < HEAD_DIM), m and l, merged over the warps in a fixed order.
template <int NQ>
__device__ __forceinline__ float combine_warps(const State<NQ>* red, int j, int d, float& m, float& l) {
    m = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red->m[w][j]);
    float a = 0.f;
    l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float c = exp_diff(red->m[w][j], m);
        a += red->acc[w][j][d] * c;
        l += red->l[w][j] * c;
    }
    return a;
}

// grid (n_kv_heads, splits, rows). Row t = blockIdx.z is position p = row_pos(step_rows, state, t) of its slot:
// it sees that slot's keys [first, n), n = p + 1, first = max(0, n - window); split s takes [first + s c,
// min(n, first + (s + 1) c)), c = ceil((n - first) / splits) (decided here from the row's own n, so one captured
// graph serves every length, and the splits, fixed per config, never depend on the other rows); an empty split
// writes acc = 0, m = -inf, l = 0. The last block of a (row, kv head) to finish
// combines its splits in order s = 0, 1, ... into out and zeroes its count for the next launch. Rows only
// offset the pointers: every row runs the same instructions on its own data, whatever gridDim.z is.
extern "C" __global__ void __launch_bounds__(THREADS)
attention_decode(const float* __restrict__ q, const half_t* __restrict__ k_cache, const half_t* __restrict__ v_cache,
                 float* part, unsigned int* count, half_t* __restrict__ out, const int* __restrict__ state,
                 const int* __restrict__ step_rows, int max_seq, float scale, int window) {
    __shared__ __align__(16) State<GROUP> red;
    __shared__ bool is_last;
    pdl_launch_dependents();  // o_proj's blocks may start streaming their weights next to this grid
    pdl_wait();               // q and this position's k, v come from the kernel before
    const int kv = blockIdx.x, split = blockIdx.y, splits = gridDim.y, row = blockIdx.z;
    const int heads = gridDim.x * GROUP;
    q += (size_t)row * heads * HEAD_DIM;
    out += (size_t)row * heads * HEAD_DIM;
    part += (size_t)row * heads * splits * PART_STRIDE;
    count += (size_t)row * gridDim.x;
    const int n = min(row_pos(step_rows, state, row) + 1, max_seq);
    const int first = max(n - window, 0);  // the sliding window's oldest key (0: the whole context)
    const int chunk = (n - first + splits - 1) / splits;
    const int begin = min(first + split * chunk, n), end = min(begin + chunk, n);
    const int sub = (threadIdx.x % WARP) % LPK;

    float qr[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float4* qp = reinterpret_cast<const float4*>(q + (kv * GROUP + g) * HEAD_DIM + sub * 8);
        const float4 a = qp[0], b = qp[1];
        qr[g][0] = a.x; qr[g][1] = a.y; qr[g][2] = a.z; qr[g][3] = a.w;
        qr[g][4] = b.x; qr[g][5] = b.y; qr[g][6] = b.z; qr[g][7] = b.w;
    }
    const size_t kv_off = ((size_t)row_slot(step_rows, row) * gridDim.x + kv) * max_seq * HEAD_DIM;  // the row's slot's
    attend_queries<GROUP, UNROLL, false>(qr, k_cache + kv_off, v_cache + kv_off, begin, end, 0, 0, scale, &red);

    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += THREADS) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float m, l;
        const float a = combine_warps(&red, g, d, m, l);
        float* p = part + ((size_t)(kv * GROUP + g) * splits + split) * PART_STRIDE;
        p[d] = a;
        if (d == 0) {
            p[HEAD_DIM] = m;
            p[HEAD_DIM + 1] = l;
        }
    }

    // Last block: every split's part is visible once count reaches splits.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(count + kv, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += THREADS) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        const float* p = part + (size_t)(kv * GROUP + g) * splits * PART_STRIDE;
        float m = NEG_INF;
        for (int s = 0; s < splits; ++s) m = fmaxf(m, load_coherent(p + s * PART_STRIDE + HEAD_DIM));
        float a = 0.f, l = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float c = exp_diff(load_coherent(p + s * PART_STRIDE + HEAD_DIM), m);
            a += load_coherent(p + s * PART_STRIDE + d) * c;
            l += load_coherent(p + s * PART_STRIDE + HEAD_DIM + 1) * c;
        }
        out[(kv * GROUP + g) * HEAD_DIM + d] = f2h(a / l);
    }
    if (threadIdx.x == 0) count[kv] = 0u;
}

// -- prefill: ROWS_Q consecutive rows x GROUP heads per block ----------------------------------------
// The same attend_queries() loop as decode, with QUERIES = ROWS_Q * GROUP queries (query j = row r * GROUP +
// head g) sharing every K/V load: a key's 16-byte loads serve all of the block's rows instead of one, and
// the causal mask per row. Keys [begin, end), from the first row's first key to the last row's limit, so only
// ROWS_Q - 1 keys at each end are ever masked per row.
#define QUERIES (ROWS_Q * GROUP)
#ifndef PREFILL_UNROLL
#define PREFILL_UNROLL (QUERIES >= 4 ? 2 : 4)   // keys per lane group per batch; QUERIES <= 4: <= 128 registers
#endif

#if ROWS_Q < 1 || ROWS_Q > 8
#error "ROWS_Q must be 1..8"
#endif

// grid (n_kv_heads, ceil(n_rows / ROWS_Q)). Block y takes rows row0 = y ROWS_Q .. row0 + ROWS_Q - 1 (those
// < n_rows) of kv head x's GROUP query heads; row r is the token at position start + r and attends to keys
// max(0, start + r - window + 1)..start + r, already in the cache. Each K/V row is loaded once for all
// ROWS_Q x GROUP queries. Rows
// >= n_rows are neither read (their q is the last row's) nor written. Row stride of q_rows and out_rows:
// gridDim.x * GROUP * HEAD_DIM.
extern "C" __global__ void __launch_bounds__(THREADS)
attention_prefill(const half_t* __restrict__ q_rows, const half_t* __restrict__ k_cache,
                  const half_t* __restrict__ v_cache, half_t* __restrict__ out_rows, int start, int n_rows,
                  int max_seq, float scale, int window) {
    __shared__ __align__(16) State<QUERIES> red;
    pdl_launch_dependents();  // the next GEMM may start streaming its weights
    pdl_wait();               // before the early return too: every block orders after the kernel before
    const int kv = blockIdx.x, row0 = blockIdx.y * ROWS_Q;
    if (row0 >= n_rows) return;  // a grid taller than needed (block-uniform, before any barrier)
    const int rows = min(ROWS_Q, n_rows - row0);  // the block's real rows
    const size_t row_stride = (size_t)gridDim.x * GROUP * HEAD_DIM, head_off = (size_t)kv * GROUP * HEAD_DIM;
    const int first_end = min(start + row0 + 1, max_seq);      // row 0's keys: [0, first_end)
    const int end = min(start + row0 + rows, max_seq);         // the last real row's
    const int begin = max(first_end - window, 0);              // row 0's first key
    const int sub = (threadIdx.x % WARP) % LPK;

    float qr[QUERIES][8];
#pragma unroll
    for (int r = 0; r < ROWS_Q; ++r) {
        const size_t off = (size_t)(row0 + min(r, rows - 1)) * row_stride + head_off + sub * 8;
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
            unpack8(*reinterpret_cast<const uint4*>(q_rows + off + g * HEAD_DIM), qr[r * GROUP + g]);
    }
    const size_t kv_off = (size_t)kv * max_seq * HEAD_DIM;
    attend_queries<QUERIES, PREFILL_UNROLL, true>(qr, k_cache + kv_off, v_cache + kv_off, begin, end, first_end,
                                                  window, scale, &red);

    // Query j = r * GROUP + g, dim d: element e = j * HEAD_DIM + d, written once, real rows only. A row's
    // GROUP heads are contiguous in out_rows: e goes to (row0 + r) * row_stride + head_off + g * HEAD_DIM + d.
    for (int e = threadIdx.x; e < rows * GROUP * HEAD_DIM; e += THREADS) {
        const int j = e / HEAD_DIM, d = e % HEAD_DIM, r = j / GROUP;
        float m, l;
        const float a = combine_warps(&red, j, d, m, l);
        out_rows[(size_t)(row0 + r) * row_stride + head_off + (e - r * GROUP * HEAD_DIM)] = f2h(a / l);
    }
}
