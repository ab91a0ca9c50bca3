// The kernels' block-wide reduction, written once: each warp folds its lanes in a butterfly
// (round o = 16, 8, 4, 2, 1: every lane combines with the lane o away), then every thread folds
// the warps' results in warp order. The order is fixed, so a fold of doubles gives the bits of its
// host twin (logprob_rule.h's mf_stats_fold), and every thread gets the result.
#pragma once

#include "cuda/kernels.hpp"
#include "metrale_feed/argmax_rule.h"

namespace mf {
namespace MF_KERNELS {

// `slots`: shared memory for one value per warp of the block. A barrier comes first, so a block
// may fold again at once (the previous fold may still be reading the slots).
template <class T, class Op>
__device__ __forceinline__ T block_fold(T v, Op op, T *slots) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    v = slots[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) v = op(v, slots[w]);
    return v;
}

// The greatest packed (key, id) word: the argmax order (argmax_rule.h); 0 is "no candidate".
struct MaxPacked {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
        return mf_pack_max(a, b);
    }
};
// The greater float; a NaN never wins (it is never greater), so a row's NaNs count as -inf.
struct MaxFloat {
    __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};
struct Sum {
    template <class T>
    __device__ T operator()(T a, T b) const { return a + b; }
};

}  // namespace MF_KERNELS
}  // namespace mf
