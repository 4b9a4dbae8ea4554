// gather.cu — activations in a weight's stored input order (GPTQ act-order): out[t, k] = in[t, perm[k]].
//
//   gather_f16   FP16 rows: the input of such a linear, a decode or verify step's (the prepared RMSNorm input xn, or
//                attention's output; gemv_mma.cu) or a prefill chunk's (gemm_quant.cu)
//
// A GPTQ checkpoint with desc_act orders a linear's input channels by group (g_idx); the loader sorts the stored
// columns once so that each group's columns are contiguous (cullama/model/quant.py's layout), keeping perm [K] int32:
// stored column k is input channel perm[k]. The plan gathers the linear's input through it first.
// Launch: grid (T) = one block per token row (no argument says T: the twins read it off the grid), THREADS (256)
// threads striding over k. No variants.
// Shapes: in, out [T, K] with rows at a stride of K; perm [K] a permutation of 0 .. K - 1 (the loader's; an index
// out of range would read another row or outside in).
// Overlap: perm is a weight, so each thread reads its first index before pdl_wait(); in is an activation, after.
#include "common.cuh"

#define THREADS 256  // GATHER_THREADS

__device__ __forceinline__ void gather_row(const half_t* __restrict__ in, const int* __restrict__ perm,
                                           half_t* __restrict__ out, int K, int first) {
    const size_t row = (size_t)blockIdx.x * K;
    int src = first;
    for (int k = threadIdx.x; k < K; k += THREADS) {
        const int next = k + THREADS < K ? perm[k + THREADS] : 0;  // the next index in flight with this copy
        out[row + k] = in[row + src];
        src = next;
    }
}

__device__ __forceinline__ int first_index(const int* __restrict__ perm, int K) {
    return (int)threadIdx.x < K ? perm[threadIdx.x] : 0;
}

// in, out [T, K] FP16.
extern "C" __global__ void __launch_bounds__(THREADS)
gather_f16(const half_t* __restrict__ in, const int* __restrict__ perm, half_t* __restrict__ out, int K) {
    pdl_launch_dependents();  // the next kernel may start streaming its weights
    const int first = first_index(perm, K);
    pdl_wait();  // in comes from the kernel before
    gather_row(in, perm, out, K, first);
}
