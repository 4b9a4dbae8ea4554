// bandwidth.cu — a streaming read of a large buffer: what this GPU's HBM delivers to a kernel that
// does nothing but read, the yardstick for `cullama bench`'s "% of read bandwidth".
//
//   read_sum    out[0] += Σ data, the buffer read as float32 values
//
// Launch: 1-D grid-stride loop (a few blocks per SM, THREADS (256) threads), each thread with UNROLL
// 16-byte streaming loads in flight (L1 bypassed, as the GEMVs read their weights). The sum is there
// so that the loads cannot be optimised away: per-thread partials, a block reduction, one atomicAdd
// per block. Float adds only (no FP16 conversions), so the arithmetic never limits the read rate.
// Shapes: data [n_vec] 16-byte vectors (4 float32 each), 16-byte aligned, any n_vec; out [1] float32
// (the caller zeroes it).
#include "common.cuh"

#ifndef UNROLL
#define UNROLL 4  // 16-byte loads in flight per thread
#endif
#define THREADS 256

__device__ __forceinline__ float sum4(uint4 v) {
    return (__uint_as_float(v.x) + __uint_as_float(v.y)) + (__uint_as_float(v.z) + __uint_as_float(v.w));
}

extern "C" __global__ void __launch_bounds__(THREADS)
read_sum(const uint4* __restrict__ data, size_t n_vec, float* __restrict__ out) {
    __shared__ float scratch[WARP];
    const size_t stride = (size_t)gridDim.x * THREADS;
    size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x;
    float acc[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc[u] = 0.f;
    for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = load_stream(data + i + u * stride);  // all issued first
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc[u] += sum4(v[u]);
    }
    for (; i < n_vec; i += stride) acc[0] += sum4(load_stream(data + i));  // the last partial sweep
    float total = 0.f;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) total += acc[u];
    total = block_sum(total, scratch);
    if (threadIdx.x == 0) atomicAdd(out, total);
}
