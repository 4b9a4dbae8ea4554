// emu_abi.h — the interface between a kernel compiled for the CPU (cuda_emu.h, ptx.h) and the emulator's
// runtime (runtime.cpp): the launch record, the per-thread builtins the scheduler sets before it resumes a
// fiber, and the runtime calls that block, exchange or touch emulated shared memory. Builtin types only: the
// kernel side includes no system header (kernels_cu/common.cuh typedefs uint32_t / uint64_t itself).
#pragma once

#define EMU_API extern "C" __attribute__((visibility("default")))

struct emu_dim3 {
    unsigned x, y, z;
};

// What Python (cullama/runtime/emu/launch.py, ctypes) hands the runtime for one launch.
struct emu_launch {
    const char* kernel;          // the kernel's name, for messages
    emu_dim3 grid, block;
    unsigned dynamic_shared;     // bytes of `extern __shared__` memory (CuPy's shared_mem)
    int schedule;                // EMU_FORWARD, EMU_REVERSE, EMU_SHUFFLED
    unsigned long long seed;     // of the shuffled schedule
    char* error;                 // out: a one-line message when emu_run returns nonzero
    int error_size;
    // Global memory: the copies launch.py made of the array arguments (spans of bytes), and per byte of each an
    // out flag, set to 1 where an ld.global.nc or __ldg read it (launch.py checks those against the writes).
    int spans;
    unsigned char* const* span_start;
    const unsigned long long* span_bytes;
    unsigned char* const* span_read_only;
};

enum { EMU_FORWARD = 0, EMU_REVERSE = 1, EMU_SHUFFLED = 2 };

// The running thread's builtins (threadIdx, blockIdx, blockDim, gridDim): set before each resume.
EMU_API emu_dim3 emu_thread_idx, emu_block_idx, emu_block_dim, emu_grid_dim;

// Runs every block of a launch; `body(params)` is one CUDA thread. shared_start / shared_stop bound the kernel
// library's static __shared__ variables (its "cuda_shared" section). 0 on success, else launch->error is set.
EMU_API int emu_run(const emu_launch* launch, void (*body)(void**), void** params, unsigned char* shared_start,
                    unsigned char* shared_stop);

// -- called by the kernel side; `file`, `line` name the call site in kernels_cu for messages -------------
EMU_API void emu_syncthreads(const char* file, int line);
// Warp shuffles: kind 0 idx, 1 up, 2 down, 3 xor; `arg` is the source lane, delta or lane mask.
EMU_API unsigned long long emu_shfl(int kind, unsigned mask, unsigned long long bits, int arg, int width,
                                    const char* file, int line);
// __reduce_*_sync: op 0 add, 1 min, 2 max; is_signed selects int or unsigned comparison.
EMU_API unsigned emu_reduce(int op, int is_signed, unsigned mask, unsigned value, const char* file, int line);
EMU_API void* emu_dynamic_shared(void);
EMU_API unsigned emu_shared_address(const void* p, const char* file, int line);
EMU_API void emu_cp_async(unsigned dst, const void* src, unsigned src_size, const char* file, int line);
EMU_API void emu_cp_async_commit(void);
EMU_API void emu_cp_async_wait(int pending, const char* file, int line);
EMU_API void emu_ldmatrix_x4(unsigned* r, unsigned addr, int trans, const char* file, int line);
EMU_API void emu_mma_m16n8k16(float* d, const unsigned* a, unsigned b0, unsigned b1, const char* file, int line);
EMU_API void emu_fence_proxy_async(void);
// An ld.global.nc / __ldg of `bytes` at p: data read-only for the whole launch (recorded, see emu_launch).
EMU_API void emu_read_only_load(const void* p, unsigned long long bytes);
// wgmma: op 0 fence, 1 commit_group, 2 wait_group (arg = pending groups allowed).
EMU_API void emu_wgmma_sync(int op, int arg, const char* file, int line);
EMU_API void emu_wgmma_mma(int n, float** acc, unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                           const char* file, int line);
// Fails the launch with a message naming the kernel, block and thread; never returns.
EMU_API __attribute__((noreturn, format(printf, 3, 4))) void emu_fail(const char* file, int line, const char* fmt,
                                                                      ...);

// -- FP16 <-> FP32 as the GPU's cvt: NumPy's astype for every number (round to nearest even), but a NaN becomes
// the canonical NaN, 0x7FFF in FP16 and 0x7FFFFFFF in FP32, whatever its sign and payload (NumPy keeps the top
// payload bits and the sign). That is the rule of CUDA's own host versions of cvt.rn.f16.f32 and cvt.f32.f16
// (cuda_fp16.hpp: __float2half_rn, __half2float; CUDART_NAN_FP16 is 0x7FFF), and of the packed
// cvt.rn.f16x2.f32, which converts each half alike. So an output that holds a NaN is the GPU's bit for bit.
#define EMU_CANONICAL_NAN_F16 0x7fffu
#define EMU_CANONICAL_NAN_F32 0x7fffffffu
static inline float emu_bits_float(unsigned b) {
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}

static inline unsigned emu_float_bits(float f) {
    unsigned b;
    __builtin_memcpy(&b, &f, 4);
    return b;
}

static inline unsigned short emu_f2h(float f) {
    const unsigned x = emu_float_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return EMU_CANONICAL_NAN_F16;
    if (a >= 0x47800000u) return (unsigned short)(sign | 0x7c00u);  // inf, or >= 65536: inf
    if (a >= 0x38800000u) {                                          // a normal half (>= 2^-14)
        const unsigned r = a - 0x38000000u, rem = r & 0x1fffu;      // exponent rebiased from 127 to 15
        unsigned h = r >> 13;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;     // may carry into inf: 65520 and up
        return (unsigned short)(sign | h);
    }
    if (a <= 0x33000000u) return (unsigned short)sign;  // <= 2^-25: rounds to zero (a tie goes to even 0)
    const unsigned mant = (a & 0x7fffffu) | 0x800000u, shift = 126u - (a >> 23);  // a subnormal half
    const unsigned rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    unsigned h = mant >> shift;
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return (unsigned short)(sign | h);
}

static inline float emu_h2f(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return emu_bits_float(m ? EMU_CANONICAL_NAN_F32 : sign | 0x7f800000u);  // NaN, inf
    if (e == 0) {
        if (m == 0) return emu_bits_float(sign);
        return (sign ? -1.0f : 1.0f) * (float)m * (1.0f / 16777216.0f);  // subnormal: m * 2^-24, exact
    }
    return emu_bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
