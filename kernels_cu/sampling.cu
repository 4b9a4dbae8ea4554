// sampling.cu — the decode step's last kernel: the next token, picked on the device exactly as
// cullama.runtime.sampling.sample (the NumPy specification) picks it, then the next step set up.
//
//   sample         token = sample(logits, params, seen, step); state[TOKEN] = token; state[STEP] += 1;
//                  state[POS] += 1; seen[token] = 1; x[0:d] = embed[token] as float32 (the next input) and its
//                  prepared RMSNorm input for layer 0's gemv_qkv_rope (prepare.cuh: xn, ssp with norm_w),
//                  for the slot of each token row (rows table, common.cuh): its own params, seen and state.
//                  A slot whose state[MASKED] is set (constrained decoding) draws only the ids its mask row
//                  allows: row r of the step reads masks[slot][offset r] (below); a slot without it reads no
//                  mask at all. Where no token can be drawn (every logit NaN or -inf): state[TOKEN] = NO_TOKEN (-1),
//                  seen untouched, x = 0 (and its xn and ssp); the host raises when it reads the token. Never an
//                  index out of bounds: a verify's draft ids are bounded here too (the host refuses any outside [0, V)
//                  first), one outside [0, V) makes every row's pick NO_TOKEN, so the step's answer is
//                  out = [1, NO_TOKEN] with state and seen as above.
//   uniform_probe  out[0] = uniform(seed, step), one thread: the RNG bit for bit, for the tests
//   logprobs       what the host needs for log-probabilities under the raw softmax (no penalty, no temperature),
//                  a few bytes per row instead of the row: see the kernel (cullama/runtime/logprobs.py finishes them)
//
// Launch: sample is ONE block of THREADS (1024) threads per token row, inside the decode CUDA graph after
// gemv_logits, so every parameter is read from device memory: temperature, top_p, repetition penalty from
// fparams, top_k, seed (two words) and step from state (layouts in common.cuh), each of the row's slot. Shapes:
// logits [rows, V] float32 (row r at r * logits_stride(V): V rounded up to 4, so every row is 16-byte aligned),
// seen [slots, seen_stride] uint8 (nonzero = seen; seen_stride >= V, a multiple of 4), embed [V, d] FP16, norm_w [d]
// FP16, x [rows, d] float32, xn [rows, d] FP16, ssp [rows, ceil(d / SS_SPAN)] float32, state [slots, 8] int32,
// fparams [slots, 4] f32, rows [rows, ROW_FIELDS] int32, ids [rows] int32, picks [rows] int32, out [1 + rows] int32,
// arrivals [1] uint32 (zero between launches), masks [slots, MASK_ROWS, mask_words] uint32 (mask_words =
// ceil(vocab / 32)).
//
// The allowed-token mask (constrained decoding: a grammar decides which ids may come next). Token row r of the step,
// of slot s at offset o (the rows table), reads mask row masks[s][o] when state[s][MASKED] is 1: id i is allowed
// where bit i & 31 of word i >> 5 is set (llguidance's bitmask, as the host computes it); a cleared bit makes the
// id's logit -inf before anything else (its key is -inf's: never drawn, no part of top-k's count or top-p's mass,
// the greedy argmax skips it), exactly as the spec's `allowed`. With state[MASKED] 0 no mask word is read, and the
// row's pick is bit for bit what it was without masks.
//
// Two modes, by `verify`. 1: the rows are one sequence's, at offsets 0..rows - 1 (one row: a decode step; k + 1:
// a speculative verify step, below), and the step ends as that many decode steps would (x: row 0). 0: a batched
// decode step, row r the next token of its own slot (offset 0), each row exactly a one-row decode step of that
// slot and independent of the others: picks[r] = its token, its slot's state and seen advanced, x row r its
// embedding (no drafts, no acceptance; ids, out and arrivals are not used).
//
// Speculative verify (grid = rows = k + 1 > 1): row r's logits follow ids[r] (ids[0] the last sampled token,
// ids[1..k] the drafts). Block r picks row r's token exactly as a decode step would there, with the drafts
// before it counted as seen (repetition penalty: block r penalises those logits of its own row in place and
// restores them before it finishes) and step + r as the RNG counter, except that on the sampled path the
// draft ids[r + 1] gets the first bucket of the inverse CDF: the draw picks it with probability p(draft) and
// otherwise samples p with the draft removed, renormalised: speculative sampling with a point mass for the
// draft distribution, so every row's pick is distributed as p itself. The last block to
// finish accepts: n - 1 = how many leading drafts equal their row's pick (greedy: the argmax), then the
// pick of row n - 1; out = [n, the n tokens]; state, seen and x end as n decode steps would leave them.
// The counters of the rows past n - 1 are drawn again by the next step: those draws decided nothing.
//
// Every float is compared through an order-preserving uint32 key (a < b <=> key(a) < key(b), -0 == +0),
// so thresholds are found by exact integer bit searches and all results are deterministic.
// Non-finite logits, as in the spec: NaN counts as -inf (its key is -inf's); a -inf token is never drawn;
// if the largest logit is +inf, the +inf tokens share the mass equally (p = 1 each, every other p = 0)
// and greedy takes the lowest-id one.
//   greedy   one coalesced pass (8 float4 loads in flight per thread) and one block reduction: the
//            max of (key << 32 | ~id) over uint64 is the argmax with the lowest id on ties.
//   sampled  thread t owns the contiguous ids [t C, t C + C), C = ceil(V / 1024) rounded up to 4; the
//            first REG_ITEMS (24) of its values stay in registers, the next SMEM_ITEMS (8) in shared
//            memory (all 32 in registers would pass the 64-register cap of 1024 threads and spill);
//            V <= 32768 is all on chip, beyond that the rest is re-read and recomputed at every pass
//            (from L1/L2). Passes over those values, each ending in one block reduction (one
//            __syncthreads, ping-pong scratch):
//              1  load, penalty, temperature; max
//             32  top-k (if 0 < k < V): bit search for the largest key t with count(key >= t) >= k
//              0  p = expf(l - max) over the kept keys, in place
//             31  top-p (if top_p < 1): Z = sum p, then a bit search over p's bit patterns (p <= 1.0 =
//                 0x3f800000: bits 29..0) for the largest t with sum(p >= t) >= top_p Z; such sums are
//                 nonincreasing in t, so the kept set is p >= t, ties included, as in the spec
//              1  block scan of the per-thread sums of kept p; each thread walks its own ids
//              1  the first id whose inclusive cumulative mass exceeds uniform(seed, step) * Z (+1 for the
//                 fallback, the last kept id with p > 0)
//            66 reductions with both cuts, 3 without; estimated (not measured yet) at tens of
//            microseconds with both cuts, against a few for greedy.
// Float sums are sequential within a thread, then a fixed tree: the same on every run. NumPy's order
// (a sequential float32 cumsum over all V ids) rounds differently, by up to ~3e-5 of Z at V = 32000, so
// a draw that close to a bucket edge may pick a neighbour of the twin's token (about 1 draw in 17
// without top-k / top-p on 32000 random logits; almost never with a cut).
#include "common.cuh"
#include "prepare.cuh"

#define THREADS 1024
#define WARPS (THREADS / WARP)
// Ids per thread held on chip on the sampled path (multiples of 4): in registers, then in shared memory.
#ifndef REG_ITEMS
#define REG_ITEMS 24
#endif
#ifndef SMEM_ITEMS
#define SMEM_ITEMS 8
#endif
#define ITEMS (REG_ITEMS + SMEM_ITEMS)
#define GREEDY_UNROLL 8  // float4 loads in flight per thread on the greedy path
#define FULL 0xffffffffu
#define ABSENT 0u  // the key of an id past V: below every real key
#define NEG_INF_KEY 0x007fffffu  // float_key(-inf), and of NaN: the least key of a real id, never drawn
#define NO_HIT 0x7fffffff
#define NO_TOKEN (-1)  // cullama.runtime.sampling.NO_TOKEN: no logit can be drawn
#define NOT_AN_ID (-2)  // sample's marked[e]: draft e + 1 is outside [0, V)

// Order-preserving key of a float; -0 becomes +0 first, since the spec compares floats; NaN is -inf.
__device__ __forceinline__ uint32_t float_key(float f) {
    if (f != f) return NEG_INF_KEY;
    uint32_t b = __float_as_uint(f);
    if (b == 0x80000000u) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// uniform(seed, step): the spec's splitmix64 draw, in common.cuh.

// HF's repetition penalty on one logit: divided by the penalty if positive, else multiplied (IEEE, as NumPy).
__device__ __forceinline__ float penalised(float v, float penalty) {
    return v > 0.f ? __fdiv_rn(v, penalty) : __fmul_rn(v, penalty);
}

// This block's row of logits (a verify step's row blockIdx.x) and its slot's state, set once by sample(). Read
// from shared memory where needed: a pointer held in registers through the sampled path's passes spills on
// sm_100 / sm_120 (so the draw reads its seed and counter from row_state where it needs them).
__shared__ const float* row_logits;
__shared__ int* row_state;

// The slot's seed (two words of its state).
__device__ __forceinline__ uint64_t state_seed(const int* st) {
    return (uint64_t)(uint32_t)st[STATE_SEED_LO] | (uint64_t)(uint32_t)st[STATE_SEED_HI] << 32;
}
#define MAX_DRAFTS 15  // drafts before a row at most: cullama.runtime.plan.MAX_DRAFT
#define MASK_ROWS (MAX_DRAFTS + 1)  // a slot's mask rows (plan.VERIFY_ROWS): row o for its token row at offset o

// This block's row of the masks (its slot's row at its offset) when the slot is constrained; set once by sample()
// and read from shared memory, as row_logits.
__shared__ const uint32_t* row_mask;

// Whether id i is allowed by the row's mask (bit i & 31 of word i >> 5).
__device__ __forceinline__ bool allowed(int i) { return (row_mask[i >> 5] >> (i & 31)) & 1u; }

struct Transform {  // logit -> key: HF repetition penalty on seen ids, then / temperature (IEEE, as NumPy)
    const unsigned char* seen;  // the kernel's argument, every slot's
    int seen_at;  // where the row's slot's seen flags begin in it (an offset, not a pointer: fewer registers)
    int V;
    bool penalise, scale;  // scale: divide by the temperature (not on the greedy path)
    bool masked;  // the row's slot is constrained: an id its mask row clears is -inf (row_mask)
    float penalty, temperature;

    // The key of id i < V.
    __device__ __forceinline__ uint32_t key1(int i) const {
        float v = row_logits[i];
        if (penalise && seen[seen_at + i]) v = penalised(v, penalty);
        if (scale) v = __fdiv_rn(v, temperature);
        return masked && !allowed(i) ? NEG_INF_KEY : float_key(v);
    }

    // Keys of ids i..i+3 (i % 4 == 0); ABSENT past V. The same values as key1.
    __device__ __forceinline__ void keys4(int i, uint32_t (&k)[4]) const {
        float l[4] = {0.f, 0.f, 0.f, 0.f};
        uint32_t s = 0;
        if (i + 3 < V) {
            const float4 v = *reinterpret_cast<const float4*>(row_logits + i);
            l[0] = v.x; l[1] = v.y; l[2] = v.z; l[3] = v.w;
            if (penalise) s = *reinterpret_cast<const uint32_t*>(seen + seen_at + i);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (i + e < V) {
                    l[e] = row_logits[i + e];
                    if (penalise) s |= (uint32_t)seen[seen_at + i + e] << (8 * e);
                }
            }
        }
        // ids i..i+3 are bits i & 31 .. (i & 31) + 3 of one word (i % 4 == 0): all of them allowed without a mask,
        // and no word read past V (the greedy path's unrolled loads go there)
        const uint32_t bits = masked && i < V ? row_mask[i >> 5] >> (i & 31) : 0xfu;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = l[e];
            if ((s >> (8 * e)) & 0xffu) v = penalised(v, penalty);
            if (scale) v = __fdiv_rn(v, temperature);
            k[e] = i + e >= V ? ABSENT : (bits >> e) & 1u ? float_key(v) : NEG_INF_KEY;
        }
    }
};

// -- block reductions (THREADS threads; every thread gets the result) ---------------------------------
// One __syncthreads each: callers alternate between two scratch buffers, so a buffer is rewritten only
// after every thread has passed the barrier of the reduction in between (and so finished reading it).
// Reduce within each warp, publish one value per warp, reduce those: the block's result in every thread.
template <typename T, typename WarpOp>
__device__ __forceinline__ T block_reduce(T v, T* buf, WarpOp warp_op) {
    v = warp_op(v);
    if (threadIdx.x % WARP == 0) buf[threadIdx.x / WARP] = v;
    __syncthreads();
    return warp_op(buf[threadIdx.x % WARP]);
}

__device__ __forceinline__ uint32_t block_sum_u32(uint32_t v, uint32_t* buf) {
    return block_reduce(v, buf, [](uint32_t x) { return __reduce_add_sync(FULL, x); });
}

__device__ __forceinline__ uint32_t block_max_u32(uint32_t v, uint32_t* buf) {
    return block_reduce(v, buf, [](uint32_t x) { return __reduce_max_sync(FULL, x); });
}

__device__ __forceinline__ int block_min_int(int v, int* buf) {
    return block_reduce(v, buf, [](int x) { return __reduce_min_sync(FULL, x); });
}

__device__ __forceinline__ int block_max_int(int v, int* buf) {
    return block_reduce(v, buf, [](int x) { return __reduce_max_sync(FULL, x); });
}

// A fixed butterfly: every lane, and every thread of the block, gets the bitwise same sum.
__device__ __forceinline__ float block_sum_f(float v, float* buf) {
    return block_reduce(v, buf, [](float x) { return warp_sum(x); });
}

__device__ __forceinline__ uint64_t block_max_u64(uint64_t v, uint64_t* buf) {
    return block_reduce(v, buf, [](uint64_t x) {
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const uint64_t w = __shfl_xor_sync(FULL, x, o);
            x = w > x ? w : x;
        }
        return x;
    });
}

// Exclusive scan of one float per thread, in thread order; `total` gets the sum.
__device__ __forceinline__ float block_exclusive_scan(float v, float* buf, float& total) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float incl = v;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const float y = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += y;
    }
    float excl = __shfl_up_sync(FULL, incl, 1);
    if (lane == 0) excl = 0.f;
    if (lane == WARP - 1) buf[warp] = incl;
    __syncthreads();
    float w = buf[lane];  // warp totals, scanned again (WARPS == WARP)
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const float y = __shfl_up_sync(FULL, w, o);
        if (lane >= o) w += y;
    }
    total = __shfl_sync(FULL, w, WARP - 1);
    const float before = __shfl_sync(FULL, w, (warp + WARP - 1) % WARP);
    return warp == 0 ? excl : before + excl;
}

// -- greedy: argmax of the penalised logits, lowest id on ties -----------------------------------
__device__ __forceinline__ int greedy_token(const Transform& tf, uint64_t* scratch) {
    uint64_t best = 0;
    for (int base = 4 * threadIdx.x; base < tf.V; base += 4 * THREADS * GREEDY_UNROLL) {
#pragma unroll
        for (int u = 0; u < GREEDY_UNROLL; ++u) {  // ptxas still issues the loads of every u first
            uint32_t k[4];
            tf.keys4(base + 4 * THREADS * u, k);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t id = base + 4 * THREADS * u + e;
                const uint64_t packed = (uint64_t)k[e] << 32 | (FULL - id);
                best = packed > best ? packed : best;
            }
        }
    }
    best = block_max_u64(best, scratch);
    return (uint32_t)(best >> 32) > NEG_INF_KEY ? (int)(FULL - (uint32_t)best) : NO_TOKEN;
}

// -- sampled -----------------------------------------------------------------------------------
// p = expf(l - max) for a kept key, else 0. l - max is NaN only for l = max = +inf: p = 1 there.
__device__ __forceinline__ uint32_t prob_bits(uint32_t key, uint32_t kth, float max_l) {
    const float e = key_float(key) - max_l;
    return key >= kth ? __float_as_uint(e == e ? expf(e) : 1.f) : 0u;
}

// Calls f(j, value) for the thread's ids begin + j, j < n, in order: from v[] (registers), then from
// cache[][threadIdx.x] (shared, one column per thread: conflict-free), then recomputed from global
// memory: keys (kth == 0) or p bits (kth > 0).
template <class F>
__device__ __forceinline__ void for_each(const uint32_t (&v)[REG_ITEMS], const uint32_t (*cache)[THREADS],
                                         const Transform& tf, int begin, int n, uint32_t kth, float max_l, F f) {
#pragma unroll
    for (int j = 0; j < REG_ITEMS; ++j) f(j, v[j]);
#pragma unroll
    for (int j = 0; j < SMEM_ITEMS; ++j) f(REG_ITEMS + j, cache[j][threadIdx.x]);
    for (int j = ITEMS; j < n; ++j) {  // one at a time: few registers on top of v[]
        const uint32_t k = tf.key1(begin + j);
        f(j, kth ? prob_bits(k, kth, max_l) : k);
    }
}

// front >= 0 (a draft): its bucket comes first in the inverse CDF (see the header); -1: plain id order.
// The draw is uniform(seed, step + offset), the slot's seed and step counter.
__device__ __forceinline__ int sampled_token(const Transform& tf, int top_k, float top_p, int offset,
                                             int front) {
    __shared__ uint32_t su[2][WARPS];
    __shared__ float sf[2][WARPS];
    __shared__ int si[2][WARPS];
    const int V = tf.V;
    const int chunk = ((V + THREADS - 1) / THREADS + 3) & ~3;
    const int begin = threadIdx.x * chunk;
    const int n = max(0, min(chunk, V - begin));

    // 1. keys of l = penalised logits / temperature; their max.
    __shared__ uint32_t cache[SMEM_ITEMS][THREADS];  // 32 KB
    uint32_t v[REG_ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS / 4; ++q) {
        uint32_t k[4] = {ABSENT, ABSENT, ABSENT, ABSENT};
        if (4 * q < n) tf.keys4(begin + 4 * q, k);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (4 * q + e < REG_ITEMS) v[4 * q + e] = k[e];
            else cache[4 * q + e - REG_ITEMS][threadIdx.x] = k[e];
        }
    }
    uint32_t m = 0;
    for_each(v, cache, tf, begin, n, 0u, 0.f, [&](int, uint32_t k) { m = max(m, k); });
    m = block_max_u32(m, su[0]);
    if (m <= NEG_INF_KEY) return NO_TOKEN;  // every logit NaN or -inf (the same m in every thread)
    const float max_l = key_float(m);

    // 2. top-k: the k-th largest key, bit by bit from the top.
    uint32_t kth = 1;  // every real key
    if (0 < top_k && top_k < V) {
        uint32_t t = 0;
        for (int b = 31; b >= 0; --b) {
            const uint32_t cand = t | (1u << b);
            uint32_t count = 0;
            for_each(v, cache, tf, begin, n, 0u, 0.f, [&](int, uint32_t k) { count += k >= cand; });
            if (block_sum_u32(count, su[b & 1]) >= (uint32_t)top_k) t = cand;
        }
        kth = t;
    }

    // 3. p = expf(l - max) over the kept keys (bits of a float >= 0: ordered as uint32).
#pragma unroll
    for (int j = 0; j < REG_ITEMS; ++j) v[j] = prob_bits(v[j], kth, max_l);
#pragma unroll
    for (int j = 0; j < SMEM_ITEMS; ++j) cache[j][threadIdx.x] = prob_bits(cache[j][threadIdx.x], kth, max_l);

    // 4. top-p: the largest t with sum(p >= t) >= top_p Z (sum(p >= 1 ulp) is Z itself, bit for bit, so
    //    some t >= the smallest p > 0 always qualifies).
    uint32_t tp = 0;
    if (top_p < 1.f) {
        float s = 0.f;
        for_each(v, cache, tf, begin, n, kth, max_l, [&](int, uint32_t p) { s += __uint_as_float(p); });
        const float budget = top_p * block_sum_f(s, sf[0]);
        for (int b = 29; b >= 0; --b) {
            const uint32_t cand = tp | (1u << b);
            float mass = 0.f;
            for_each(v, cache, tf, begin, n, kth, max_l,
                     [&](int, uint32_t p) { mass += p >= cand ? __uint_as_float(p) : 0.f; });
            if (block_sum_f(mass, sf[b & 1]) >= budget) tp = cand;  // b = 29: sf[1], Z had sf[0]
        }
    }

    // 5. inverse CDF over the kept mass: the front's bucket [0, p_front) first, then the others in id order.
    float total = 0.f, mine = 0.f;  // kept mass of this thread's ids but the front; the front's (its owner)
    for_each(v, cache, tf, begin, n, kth, max_l, [&](int j, uint32_t p) {
        const float q = p >= tp ? __uint_as_float(p) : 0.f;
        if (begin + j == front) mine = q;
        else total += q;
    });
    __syncthreads();  // the searches' last scratch buffers are free again
    float z_rest;
    float c = block_exclusive_scan(total, sf[1], z_rest);
    const float p_front = front < 0 ? 0.f : block_sum_f(mine, sf[0]);  // block-uniform branch
    const float u = uniform(state_seed(row_state), row_state[STATE_STEP] + offset);
    float target = __fmul_rn(u, z_rest + p_front);  // without a front: u * z_rest, exactly
    if (target < p_front) return front;
    target = __fsub_rn(target, p_front);
    int hit = NO_HIT, last = -1;
    for_each(v, cache, tf, begin, n, kth, max_l, [&](int j, uint32_t p) {
        const float q = p >= tp && begin + j != front ? __uint_as_float(p) : 0.f;
        c += q;
        if (q > 0.f) {  // a token without mass is never picked, even where the scans' rounding differ
            if (c > target && hit == NO_HIT) hit = begin + j;
            last = begin + j;
        }
    });
    hit = block_min_int(hit, si[0]);
    if (hit != NO_HIT) return hit;
    last = block_max_int(last, si[1]);  // the cumulative sums' rounding left the draw past them all
    return last >= 0 ? last : front;    // nothing kept but the front (front >= 0 then: the max is kept)
}

// grid (rows): block r samples token row r (verify 1: a decode step's one row or a verify step's k + 1; 0: one
// row per sequence of a batched step; see the header).
extern "C" __global__ void __launch_bounds__(THREADS)
sample(float* logits, unsigned char* __restrict__ seen, int* __restrict__ state,
       const float* __restrict__ fparams, const half_t* __restrict__ embed, const half_t* __restrict__ norm_w,
       float* __restrict__ x, half_t* __restrict__ xn, float* __restrict__ ssp,
       const int* __restrict__ step_rows, const int* __restrict__ ids, int* picks, int* __restrict__ out,
       unsigned int* arrivals, const unsigned int* __restrict__ masks, int V, int d, int seen_stride, int mask_words,
       int verify) {
    __shared__ uint64_t scratch[WARPS];
    __shared__ int accepted[2];  // the last block's verdict: n, and the token that ends the accepted run
    __shared__ bool is_last;
    pdl_wait();  // the logits come from the kernel before
    // rows: this row's sequence's in the step; offset: the row's among them (its drafts before it, its counter)
    const int row = blockIdx.x, rows = verify ? gridDim.x : 1, offset = verify ? row : 0;
    // The row's slot's state, parameters and seen flags: only addressing changes with the slot (seen by an offset
    // from the argument, not a pointer of its own: registers are short on the greedy path).
    const int slot = row_slot(step_rows, row);
    int* const st = state + slot * STATE_LEN;
    const float* const fp = fparams + slot * FPARAMS_LEN;
    const int seen_at = slot * seen_stride;
    const float temperature = fp[FP_TEMPERATURE], top_p = fp[FP_TOP_P];
    const float penalty = fp[FP_REP_PENALTY];
    const int top_k = st[STATE_TOP_K];
    const bool greedy = temperature == 0.f;
    // The drafts before this row count as seen: each one not seen yet (its first occurrence) is penalised in
    // this block's own row, in place, and put back once the token is picked (thread e: draft e + 1; the ids
    // and values wait in shared memory, not in registers the passes below need).
    __shared__ int marked[MAX_DRAFTS];  // the id thread e penalised, -1 if none, NOT_AN_ID: draft e + 1 is no id
    __shared__ float raw[MAX_DRAFTS];   // its logit before
    float* const own = logits + (size_t)row * logits_stride(V);  // 16-byte aligned: keys4 reads float4s
    if (threadIdx.x < MAX_DRAFTS) {  // thread e checks draft e + 1 of the step, and marks it if before this row
        const int e = threadIdx.x, id = e + 1 < rows ? ids[1 + e] : 0, draft = e < offset ? id : -1;
        bool repeated = false;
        for (int f = 0; f < e && draft >= 0; ++f) repeated |= ids[1 + f] == draft;  // ids[1..row] only
        if (id < 0 || id >= V) marked[e] = NOT_AN_ID;
        else marked[e] = draft >= 0 && penalty != 1.f && !seen[seen_at + draft] && !repeated ? draft : -1;
        if (marked[e] >= 0) {
            raw[e] = own[draft];
            own[draft] = penalised(raw[e], penalty);
        }
    }
    const bool masked = st[STATE_MASKED] != 0;
    if (threadIdx.x == 0) {
        row_logits = own;
        row_state = st;
        // the slot's mask row at this token row's offset (masks [slots, MASK_ROWS, mask_words]); none unless masked
        const int at = slot * MASK_ROWS + step_rows[row * ROW_FIELDS + ROW_OFFSET];
        row_mask = masked ? masks + (size_t)at * mask_words : nullptr;
    }
    __syncthreads();
    bool drafts_are_ids = true;  // the same in every thread and every block: the branches below are uniform
#pragma unroll
    for (int e = 0; e < MAX_DRAFTS; ++e) drafts_are_ids &= marked[e] != NOT_AN_ID;
    const Transform tf{seen, seen_at, V, penalty != 1.f, !greedy, masked, penalty, temperature};
    const int front = offset + 1 < rows ? ids[offset + 1] : -1;  // this row's draft, if any
    // Every thread gets the token from the block reductions; those barriers also order every read of
    // state and seen above before the writes below (in a verify, the other blocks' reads come before their
    // arrival, so before the last block writes).
    int token = !drafts_are_ids ? NO_TOKEN
                : greedy        ? greedy_token(tf, scratch)
                                : sampled_token(tf, top_k, top_p, offset, front);
    if (threadIdx.x < MAX_DRAFTS && marked[threadIdx.x] >= 0)  // every read of the row is behind the reductions
        const_cast<float*>(row_logits)[marked[threadIdx.x]] = raw[threadIdx.x];
    int n = 1;
    if (threadIdx.x == 0) picks[row] = token;
    if (rows > 1) {  // the last block to finish accepts
        if (threadIdx.x == 0) {
            __threadfence();
            is_last = atomicAdd(arrivals, 1u) == (unsigned int)(rows - 1);
        }
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        if (threadIdx.x == 0) {
            int j = 0;  // NO_TOKEN equals no draft that is an id: it ends the run (else every pick is NO_TOKEN)
            while (drafts_are_ids && j + 1 < rows && load_coherent(picks + j) == ids[j + 1]) ++j;  // row j's pick
            accepted[0] = j + 1;
            accepted[1] = load_coherent(picks + j);
            *arrivals = 0u;
        }
        __syncthreads();
        n = accepted[0];
        token = accepted[1];
    }
    unsigned char* const slot_seen = seen + (size_t)row_slot(step_rows, row) * seen_stride;
    int* const slot_state = row_state;
    if (threadIdx.x == 0) {
        if (verify) {
            out[0] = n;
            for (int i = 1; i < n; ++i) {
                out[i] = ids[i];
                slot_seen[ids[i]] = 1;
            }
            out[n] = token;
        }
        if (token != NO_TOKEN) slot_seen[token] = 1;
        slot_state[STATE_TOKEN] = token;
        slot_state[STATE_STEP] += n;
        slot_state[STATE_POS] += n;
    }
    const size_t at = verify ? 0 : row, parts = (d + SS_SPAN - 1) / SS_SPAN;  // the row's next input: x row `at`
    embed_prepared(token != NO_TOKEN ? embed + (size_t)token * d : nullptr, 0.f, norm_w, x + at * d, xn + at * d,
                   ssp + at * parts, d, THREADS);
}

// One thread: out[0] = uniform(seed, step).
extern "C" __global__ void uniform_probe(unsigned long long seed, int step, float* out) {
    out[0] = uniform(seed, step);
}

// -- log-probabilities ----------------------------------------------------------------------------------
// logprobs: grid (rows), THREADS threads, one block per row. Row r holds logits[r * stride + i], i < V (a
// decode step's one row, a verify step's rows, a prefill chunk's rows); its target is targets[target_at + r]
// (a decode step: state[STATE_TOKEN], written by sample; a verify step: picks; a prefill: the next prompt id).
// Run after sample, which leaves the logits as gemv_logits wrote them. Row r of out [rows, LP_WIDTH] gets:
//   LP_MAX        m = the largest logit (NaN counts as -inf, as in sample)
//   LP_SUM        s = sum over the row of expf(l - m), an l = m = +inf term counting 1 (the +inf ids share the
//                 mass, as in sample); meaningless when m = -inf (no id has a probability)
//   LP_TARGET     l[target], raw (NaN where the target is not an id of the row: NO_TOKEN)
//   LP_TARGET_ID  the target (int32 bits)
//   LP_TOP + j, LP_TOP_ID + j, j < top (<= LP_MAX_TOP): the j-th largest logit (NaN as -inf) and its id, the lowest
//                 id first on ties: pass j finds the block's largest (key << 32 | ~id) below pass j - 1's
// The host turns them into l - (m + log s) in float64. Passes over the row (from L1 / L2 after the first): two,
// and one more per alternative past the first, each ending in one block reduction; the sums run in a fixed order
// (deterministic). Cost not measured yet (benchmarks/logprobs_step.py, PREDICTIONS.md).
#define LP_MAX 0
#define LP_SUM 1
#define LP_TARGET 2
#define LP_TARGET_ID 3
#define LP_TOP 4
#define LP_MAX_TOP 20  // cullama.runtime.logprobs.MAX_TOP: OpenAI's top_logprobs limit
#define LP_TOP_ID (LP_TOP + LP_MAX_TOP)
#define LP_WIDTH (LP_TOP_ID + LP_MAX_TOP)

// The order of the top passes: larger logits first, then lower ids; 0 is below every real id's.
__device__ __forceinline__ uint64_t ranked(float l, int i) {
    return (uint64_t)float_key(l) << 32 | (FULL - (uint32_t)i);
}

extern "C" __global__ void __launch_bounds__(THREADS)
logprobs(const float* __restrict__ logits, const int* __restrict__ targets, float* __restrict__ out, int V,
         int stride, int target_at, int top) {
    __shared__ uint64_t best_of[2][WARPS];
    __shared__ float sum_of[WARPS];
    pdl_wait();  // the logits and the targets come from the kernels before
    const float* row = logits + (size_t)blockIdx.x * stride;
    float* o = out + (size_t)blockIdx.x * LP_WIDTH;
    // 1. the largest logit, with its id: m and the top-1
    uint64_t best = 0;
    for (int i = threadIdx.x; i < V; i += THREADS) best = max(best, ranked(row[i], i));
    best = block_max_u64(best, best_of[0]);
    const float m = key_float((uint32_t)(best >> 32));
    // 2. s: each thread's ids in order, then the fixed butterfly
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += THREADS) {
        const float e = key_float(float_key(row[i])) - m;  // NaN only where l = m = +inf (or m = -inf)
        s += e == e ? expf(e) : 1.f;
    }
    s = block_sum_f(s, sum_of);
    if (threadIdx.x == 0) {
        const int t = targets[target_at + blockIdx.x];
        o[LP_MAX] = m;
        o[LP_SUM] = s;
        o[LP_TARGET] = 0 <= t && t < V ? row[t] : __int_as_float(0x7fffffff);
        o[LP_TARGET_ID] = __int_as_float(t);
    }
    // 3. the top ids, one pass each below the last
    top = min(top, LP_MAX_TOP);
    for (int j = 0; j < top; ++j) {
        if (j > 0) {
            const uint64_t below = best;
            best = 0;
            for (int i = threadIdx.x; i < V; i += THREADS) {
                const uint64_t r = ranked(row[i], i);
                best = r < below && r > best ? r : best;
            }
            best = block_max_u64(best, best_of[j & 1]);  // alternating: see block_reduce (sum_of's barrier between)
        }
        if (threadIdx.x == 0) {  // past the last id (V < top): NaN and -1
            o[LP_TOP + j] = best ? key_float((uint32_t)(best >> 32)) : __int_as_float(0x7fffffff);
            o[LP_TOP_ID + j] = __int_as_float(best ? (int)(FULL - (uint32_t)best) : -1);
        }
    }
}
