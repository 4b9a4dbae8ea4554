// fill.cu — synthetic weights made where they live: out[i] = mean + std * sqrt(3) * (2 u - 1) in FP16,
// u = uniform(seed, i) (common.cuh), a uniform distribution with the given mean and standard
// deviation. Counter-based, so any element is reproducible alone and the NumPy twin gives the same
// bits: random weights are identical on the CPU and the GPU for the same seed.
// Launch: 1-D grid-stride, any grid, THREADS (256) threads. out: n FP16 values.
#include "common.cuh"

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
fill_uniform(half_t* __restrict__ out, size_t n, unsigned long long seed, float mean, float std) {
    const float half_width = __fmul_rn(std, 1.7320508f);  // sqrt(3): a uniform of half-width a has std a / sqrt(3)
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS) {
        const float u = uniform(seed, i);
        // _rn intrinsics: no fused multiply-add, so the twin's float32 arithmetic matches bit for bit
        out[i] = f2h(__fadd_rn(mean, __fmul_rn(half_width, __fsub_rn(__fmul_rn(2.f, u), 1.f))));
    }
}
