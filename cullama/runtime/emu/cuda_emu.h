// cuda_emu.h — what NVRTC gives a kernels_cu source, for the host C++ compiler: the CUDA keywords (defined
// away), vector types, threadIdx / blockIdx / blockDim / gridDim (the running fiber's, set by the runtime),
// __shared__ (one section, "cuda_shared", which the runtime poisons at every block start), the intrinsics
// the kernels call (warp shuffles and reductions, barriers, atomics, fences, math), and ptx.h, the C++ of
// each inline-PTX template. cullama/runtime/emu/build.py compiles every source as: this header, then the source
// preprocessed with its asm statements rewritten into ptx.h calls. No system header is included: common.cuh
// typedefs uint32_t and uint64_t itself, as it does for NVRTC.
#pragma once
#include "emu_abi.h"

typedef __SIZE_TYPE__ size_t;

// -- keywords ------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared variables: one copy, used by the block running now (blocks run one at a time).
#define __shared__ static __attribute__((section("cuda_shared")))

// The section exists in every kernel library, even one without shared memory, and starts 1024-aligned (a
// shared window starts at address 0 on the GPU; gemm_wgmma's swizzle atoms need 1024-byte alignment).
__shared__ __attribute__((used, aligned(1024))) unsigned char emu_shared_anchor[16];
extern "C" unsigned char __start_cuda_shared[] __attribute__((visibility("hidden")));
extern "C" unsigned char __stop_cuda_shared[] __attribute__((visibility("hidden")));

// -- vector types and builtins --------------------------------------------------------------------------
// CUDA's alignments: every typed access is checked against them (-fsanitize=alignment, build.py).
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(8))) float2 { float x, y; };
typedef emu_dim3 uint3;
typedef emu_dim3 dim3;

static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return float2{x, y}; }

#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

// -- barriers, warp exchange, atomics, fences -------------------------------------------------------------
#define __syncthreads() emu_syncthreads(__FILE__, __LINE__)
#define __threadfence() ((void)0)  // blocks run one after another: every store is visible to the next

template <class T>
static inline T emu_shfl_typed(int kind, unsigned mask, T v, int arg, int width, const char* file, int line) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a shuffle moves 4 or 8 bytes");
    unsigned long long bits = 0;
    __builtin_memcpy(&bits, &v, sizeof(T));
    bits = emu_shfl(kind, mask, bits, arg, width, file, line);
    __builtin_memcpy(&v, &bits, sizeof(T));
    return v;
}
#define __shfl_sync(mask, v, lane, ...) emu_shfl_typed(0, mask, v, lane, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) emu_shfl_typed(1, mask, v, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) emu_shfl_typed(2, mask, v, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, m, ...) emu_shfl_typed(3, mask, v, m, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)

static inline unsigned emu_reduce_typed(int op, unsigned mask, unsigned v, const char* f, int l) {
    return emu_reduce(op, 0, mask, v, f, l);
}
static inline int emu_reduce_typed(int op, unsigned mask, int v, const char* f, int l) {
    return (int)emu_reduce(op, 1, mask, (unsigned)v, f, l);
}
#define __reduce_add_sync(mask, v) emu_reduce_typed(0, mask, v, __FILE__, __LINE__)
#define __reduce_min_sync(mask, v) emu_reduce_typed(1, mask, v, __FILE__, __LINE__)
#define __reduce_max_sync(mask, v) emu_reduce_typed(2, mask, v, __FILE__, __LINE__)

// Host operations: one thread runs at a time, so a read-modify-write is atomic as written.
static inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
static inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }

// __ldg: a plain load, recorded as read-only for the whole launch, as ld.global.nc (the launcher checks that the
// launch never writes what it read so).
template <class T>
static inline T emu_ldg(const T* p) {
    emu_read_only_load(p, sizeof(T));
    return *p;
}
#define __ldg(p) emu_ldg(p)

// -- math: IEEE float operations, as NumPy's float32 (the build passes -ffp-contract=off: no fused multiply-add)
static inline float __int_as_float(int i) { float f; __builtin_memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { return emu_bits_float(u); }
static inline unsigned __float_as_uint(float f) { return emu_float_bits(f); }
static inline int __float_as_int(float f) { int i; __builtin_memcpy(&i, &f, 4); return i; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float expf(float x) { return __builtin_expf(x); }
static inline float sqrtf(float x) { return __builtin_sqrtf(x); }
static inline float rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }  // the twins' 1 / sqrt, not MUFU.RSQ
static inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
static inline float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // one rounding
static inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // fmaf, never contracted away
static inline float fminf(float a, float b) { return __builtin_fminf(a, b); }
static inline int __ffs(int x) { return __builtin_ffs(x); }  // 1 + the index of the lowest set bit, 0 for 0

#define EMU_MINMAX(T)                                             \
    static inline T min(T a, T b) { return a < b ? a : b; }      \
    static inline T max(T a, T b) { return a > b ? a : b; }
EMU_MINMAX(int)
EMU_MINMAX(unsigned int)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
#undef EMU_MINMAX

#include "ptx.h"

// -- the launch entry build.py appends per kernel: params[i] points at parameter i (cuLaunchKernel's layout) --
template <int... I>
struct emu_seq {};
template <int N, int... I>
struct emu_make_seq : emu_make_seq<N - 1, N - 1, I...> {};
template <int... I>
struct emu_make_seq<0, I...> {
    using type = emu_seq<I...>;
};
template <class... P, int... I>
inline void emu_invoke_seq(void (*kernel)(P...), void** params, emu_seq<I...>) {
    kernel(*static_cast<P*>(params[I])...);
}
template <class... P>
inline void emu_invoke(void (*kernel)(P...), void** params) {
    emu_invoke_seq(kernel, params, typename emu_make_seq<sizeof...(P)>::type{});
}

// The kernel's parameters for the launcher's checks: "p8 i4 f4 u8 ...", kind (pointer, signed, unsigned,
// float) and size of each.
template <class T>
struct emu_param {
    static constexpr char kind = (T)(-1) < (T)0 ? 'i' : 'u';
};
template <class T>
struct emu_param<T*> {
    static constexpr char kind = 'p';
};
template <>
struct emu_param<float> {
    static constexpr char kind = 'f';
};
template <>
struct emu_param<double> {
    static constexpr char kind = 'f';
};
struct emu_param_code {
    char kind, size, space;
};
template <class... P>
inline const char* emu_describe(void (*)(P...)) {
    static const emu_param_code codes[] = {emu_param_code{emu_param<P>::kind, (char)('0' + sizeof(P)), ' '}...,
                                           emu_param_code{0, 0, 0}};
    return &codes[0].kind;
}
