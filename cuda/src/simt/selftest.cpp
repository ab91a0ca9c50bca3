// Kernels that break a rule of CUDA on purpose, so the tests can show that the simt executor
// catches each break (a GPU may hang, or pass silently, on any of them). Compiled with MF_SIMT.
#include <cstring>
#include <string>

#include "simt/simt.cuh"

namespace mf::simt {
namespace {

// Half the block waits at one barrier, half at another.
__global__ void split_barrier(unsigned *out) {
    if (threadIdx.x < 16) __syncthreads();
    __syncthreads();
    out[threadIdx.x] = 1u;
}

// A barrier inside a branch that some threads of the block skip while the others wait in a
// shuffle that needs them: the classic deadlock.
__global__ void barrier_in_branch(unsigned *out) {
    unsigned v = threadIdx.x;
    if (threadIdx.x == 3) __syncthreads();
    v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    out[threadIdx.x] = v;
}

// A lane of the mask has exited before the shuffle.
__global__ void mask_names_exited(unsigned *out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, threadIdx.x, 1);
}

// Lanes 0-15 shuffle among themselves but read across to lanes 16-31, which the mask leaves out.
__global__ void reads_outside_mask(unsigned *out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0x0000FFFFu, threadIdx.x, 16);
}

// The two halves of a warp meet in shuffles at different lines.
__global__ void different_shuffles(unsigned *out) {
    unsigned v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    else v = __shfl_xor_sync(0xFFFFFFFFu, v, 2);
    out[threadIdx.x] = v;
}

// The same work done right: a warp sum and a block barrier (no fault, the sum checked).
__global__ void correct(unsigned *out) {
    __shared__ unsigned slots[2];
    unsigned v = threadIdx.x;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if ((threadIdx.x & 31u) == 0) slots[threadIdx.x >> 5] = v;
    __syncthreads();
    out[threadIdx.x] = slots[0] + slots[1];
}

struct Case {
    const char *name;
    void (*kernel)(unsigned *);
};
const Case kCases[] = {
    {"split_barrier", split_barrier},         {"barrier_in_branch", barrier_in_branch},
    {"mask_names_exited", mask_names_exited}, {"reads_outside_mask", reads_outside_mask},
    {"different_shuffles", different_shuffles}, {"correct", correct},
};

}  // namespace

int selftest(const char *which, std::string *message) {
    if (!*which) {
        for (const Case &c : kCases) *message += std::string(message->empty() ? "" : " ") + c.name;
        return 0;
    }
    for (const Case &c : kCases) {
        if (std::strcmp(c.name, which) != 0) continue;
        unsigned out[64] = {};
        const auto kernel = c.kernel;
        launcher(c.name, __FILE__, __LINE__, dim3(1), dim3(64), 0, kernel)(out);  // the name in its faults
        *message = take_fault();
        if (!message->empty()) return 1;
        if (kernel == correct)
            for (unsigned i = 0; i < 64; ++i)
                if (out[i] != 2016u) {
                    *message = "simt: the correct kernel computed a wrong sum";
                    return 1;
                }
        return 0;
    }
    *message = std::string("no self-test kernel named ") + which;
    return -1;
}

}  // namespace mf::simt
