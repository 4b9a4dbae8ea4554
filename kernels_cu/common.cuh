// common.cuh — what every cullama kernel shares: FP16 bits <-> float, 16-byte loads, warp and
// block reductions. No CUDA headers are included (NVRTC alone compiles everything, no toolkit):
// FP16 values travel as raw 16-bit patterns (`half_t`) and are converted with PTX cvt.
#pragma once

typedef unsigned short half_t;  // IEEE binary16 bits
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

#define WARP 32
#define NEG_INF (__int_as_float(0xff800000))
#define QUIET_NAN (__int_as_float(0x7fffffff))  // poisons what must not be used (a row of a bad id)

__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_t f2h(float f) {  // round to nearest even, as NumPy's astype(float16)
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The two halves of a 32-bit word: low 16 bits are the element at the lower address.
__device__ __forceinline__ float lo_f(uint32_t w) { return h2f((half_t)(w & 0xffffu)); }
__device__ __forceinline__ float hi_f(uint32_t w) { return h2f((half_t)(w >> 16)); }

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    return (uint32_t)f2h(lo) | ((uint32_t)f2h(hi) << 16);
}

// 8 FP16 values (16 bytes) as floats.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
    f[0] = lo_f(v.x); f[1] = hi_f(v.x); f[2] = lo_f(v.y); f[3] = hi_f(v.y);
    f[4] = lo_f(v.z); f[5] = hi_f(v.z); f[6] = lo_f(v.w); f[7] = hi_f(v.w);
}

// The row stride of a verify step's logits [rows, V]: V rounded up to 4 floats, so that every row starts
// 16-byte aligned (sample reads float4s; at a stride of V, rows r >= 1 would be misaligned when V % 4 != 0,
// and a misaligned float4 load faults). cullama/runtime/ops/gemv.py logits_stride is the same rule.
__device__ __forceinline__ size_t logits_stride(int V) { return (size_t)((V + 3) & ~3); }

// Weights are read exactly once per decode step: stream them past L1 so that they do not evict
// the activation vector that every block re-reads.
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Written by another block of the same launch: bypass L1 (which is not coherent across SMs).
__device__ __forceinline__ float load_coherent(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int load_coherent(const int* p) {  // the same 32-bit load: the bits, not a value
    return __float_as_int(load_coherent(reinterpret_cast<const float*>(p)));
}

// Programmatic dependent launch (sm_90+). A kernel launched with the attribute may start while the
// kernel before it in the stream is still running; it must call pdl_wait() before it touches anything
// an earlier kernel writes (activations, the KV cache, the state) and may only read weights before
// that. pdl_launch_dependents() lets the next kernel's blocks be scheduled once every block of this
// grid has issued it or exited. Both are no-ops when the kernel was launched without the attribute
// (prefill, eager launches, CPU-less compiles for older archs).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` needs 32 floats of shared memory; the trailing barrier makes it reusable at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// The counter-based RNG of cullama.runtime.sampling.uniform: splitmix64's finaliser of seed * golden + counter
// + 1 (all mod 2^64), its top 24 bits as a float in [0, 1), exact. No state: replayable in a graph.
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t counter) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter + 1ull;
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(uint32_t)(z >> 40) * (1.f / 16777216.f);
}

// The decode state, in device memory so that one captured CUDA graph serves every position.
// int32 state[STATE_LEN]:
#define STATE_POS 0      // position of the token being processed (= tokens already in the KV cache)
#define STATE_TOKEN 1    // that token (the last one sampled)
#define STATE_STEP 2     // tokens sampled so far in this generation (the sampling RNG's counter)
#define STATE_TOP_K 3    // 0 = off
#define STATE_SEED_LO 4  // the sampling seed, low and high 32 bits
#define STATE_SEED_HI 5
#define STATE_MASKED 6   // 1: constrained decoding, the slot's picks are limited by its mask rows (sampling.cu)
#define STATE_LEN 8
// float32 fparams[FPARAMS_LEN]:
#define FP_TEMPERATURE 0  // 0 = greedy
#define FP_TOP_P 1        // 1 = off
#define FP_REP_PENALTY 2  // 1 = off
#define FPARAMS_LEN 4
// Every buffer above is per sequence slot: state [slots, STATE_LEN], fparams [slots, FPARAMS_LEN], seen [slots,
// seen_stride] (one slot: a plain decode step's), masks [slots, MASK_ROWS, mask_words] (sampling.cu), and the KV
// cache [layers, slots, kv_heads, max_seq, hd].

// A step's token rows, int32 rows[R][ROW_FIELDS]: the slot of the sequence a row belongs to, and the row's offset
// from that slot's position. A decode step is one row (slot, 0); a verify step k + 1 rows of one slot (offsets
// 0..k); a batched decode step B rows of B slots (offset 0 each). Kernels that read a position or a slot take
// the table and change only their addressing with it: a row's arithmetic is the one-row launch's.
#define ROW_SLOT 0
#define ROW_OFFSET 1
#define ROW_FIELDS 2

__device__ __forceinline__ int row_slot(const int* __restrict__ rows, int r) { return rows[r * ROW_FIELDS + ROW_SLOT]; }

// Row r's position: its slot's position plus its offset.
__device__ __forceinline__ int row_pos(const int* __restrict__ rows, const int* __restrict__ state, int r) {
    return state[row_slot(rows, r) * STATE_LEN + STATE_POS] + rows[r * ROW_FIELDS + ROW_OFFSET];
}

// n / d for a divisor d fixed for a launch, without a division in a loop: magic = div_magic(d) = ceil(2^31 / d) =
// (2^31 + e) / d (0 <= e < d), once; then 2 n magic / 2^32 = n / d + n e / (d 2^31), whose second term stays under
// 1 / d, so its floor is n / d's while n d < 2^31 (n >= 0, d >= 1). One mul.hi where a division is ~15 instructions.
__device__ __forceinline__ uint32_t div_magic(int d) { return (0x80000000u + (uint32_t)d - 1u) / (uint32_t)d; }

__device__ __forceinline__ int div_by_magic(int n, uint32_t magic) {
    return (int)(((uint64_t)(2u * (uint32_t)n) * magic) >> 32);  // mul.hi.u32
}
