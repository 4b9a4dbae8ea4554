// fill.cu — synthetic weights made where they live, from the counter-based RNG uniform(seed, i) (common.cuh):
// reproducible element by element, and the NumPy twin gives the same bits, so random weights are identical on the
// CPU and the GPU for the same seed. Kernels (each 1-D grid-stride, any grid, THREADS (256) threads):
//   fill_uniform   out[i] = mean + std * sqrt(3) * (2 u - 1) in FP16, u = uniform(seed, i): a uniform distribution
//                  with the given mean and standard deviation. out: n FP16 values.
//   fill_words     out[i] = 32 random bits (the top 16 of uniform's 24 at counters 2i and 2i + 1): quantized codes,
//                  eight 4-bit or four 8-bit to a word (cullama/model/quant.py). out: n uint32 words.
//   fill_qparams   out[i] = (scale, zero): scale fill_uniform's value i, zero the constant `zero` (an integer, as
//                  quantized (scale, zero) pairs hold it). out: `pairs` pairs of FP16.
#include "common.cuh"

#define THREADS 256

// fill_uniform's value i. _rn intrinsics: no fused multiply-add, so the twin's float32 arithmetic matches bit for bit.
__device__ __forceinline__ float uniform_value(unsigned long long seed, size_t i, float mean, float std) {
    const float half_width = __fmul_rn(std, 1.7320508f);  // sqrt(3): a uniform of half-width a has std a / sqrt(3)
    return __fadd_rn(mean, __fmul_rn(half_width, __fsub_rn(__fmul_rn(2.f, uniform(seed, i)), 1.f)));
}

extern "C" __global__ void __launch_bounds__(THREADS)
fill_uniform(half_t* __restrict__ out, size_t n, unsigned long long seed, float mean, float std) {
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS) {
        out[i] = f2h(uniform_value(seed, i, mean, std));
    }
}

// 16 random bits: uniform() is k / 2^24 for a 24-bit k, which the product recovers exactly; its top 16 bits.
__device__ __forceinline__ unsigned int bits16(unsigned long long seed, size_t i) {
    return (unsigned int)__fmul_rn(uniform(seed, i), 16777216.f) >> 8;
}

extern "C" __global__ void __launch_bounds__(THREADS)
fill_words(unsigned int* __restrict__ out, size_t n, unsigned long long seed) {
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS) {
        out[i] = bits16(seed, 2 * i) | (bits16(seed, 2 * i + 1) << 16);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
fill_qparams(half_t* __restrict__ out, size_t pairs, unsigned long long seed, float mean, float std, float zero) {
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < pairs; i += (size_t)gridDim.x * THREADS) {
        out[2 * i] = f2h(uniform_value(seed, i, mean, std));
        out[2 * i + 1] = f2h(zero);
    }
}
