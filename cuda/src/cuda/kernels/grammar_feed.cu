// The device grammar (grammar_rule.h): the bitmask rows of each row's states, and each row's state
// advanced by the ids a pick wrote. Mask: one block per logit row; every thread walks the row's
// drafts itself (a few binary searches, cheaper than a barrier) and then owns whole words, each
// found from the fallback and the state's edges inside it, so no two threads write one word and
// the kernel needs no atomics or shared memory. Advance: one thread per row. The host twins
// (grammar_host.cpp) call the same rule, so their words are these bits.
#include <algorithm>

#include "cuda/kernels.hpp"
#include "metrale_feed/grammar_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr uint32_t kMaskThreads = 256;
constexpr uint32_t kAdvanceThreads = 128;

__global__ void __launch_bounds__(kMaskThreads) mf_grammar_mask_kernel(const mf_grammar g, uint32_t k,
                                                                        const uint32_t *state_words,
                                                                        const uint32_t *drafts, const uint32_t *in,
                                                                        uint32_t *out) {
    const uint32_t lr = blockIdx.x, r = lr / (k + 1u), j = lr % (k + 1u);
    const uint32_t words = mf_bitmask_words(g.vocab);
    const uint32_t s = mf_grammar_walk(&g, state_words[r], drafts ? drafts + (uint64_t)r * k : nullptr, j);
    const uint64_t row = (uint64_t)lr * words;
    for (uint32_t w = threadIdx.x; w < words; w += blockDim.x)
        out[row + w] = mf_grammar_word(&g, s, w) & (in ? in[row + w] : 0xFFFFFFFFu);
}

__global__ void __launch_bounds__(kAdvanceThreads) mf_grammar_advance_kernel(const mf_grammar g, uint32_t rows,
                                                                             uint32_t k, const uint32_t *cells,
                                                                             uint32_t *state_words) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    uint32_t n;
    const uint32_t *ids = mf_grammar_row_ids(cells, k, r, &n);
    state_words[r] = mf_grammar_advance_row(&g, state_words[r], ids, n);
}

}  // namespace

cudaError_t launch_grammar_mask(const mf_grammar_mask_args &a, cudaStream_t stream) {
    const mf_grammar g{a.states, a.edges, a.num_states, a.num_edges, a.vocab};
    // A block no wider than the row's words (in whole warps): a small vocabulary runs no idle warps.
    const uint32_t words = mf_bitmask_words(a.vocab);
    const uint32_t threads = std::min(kMaskThreads, (words + 31u) / 32u * 32u);
    MF_LAUNCH(a.rows * (a.k + 1u), threads, 0, stream, mf_grammar_mask_kernel)(g, a.k, a.state_words, a.drafts,
                                                                              a.bitmask_in, a.bitmask_out);
    return cudaGetLastError();
}

cudaError_t launch_grammar_advance(const mf_grammar_advance_args &a, cudaStream_t stream) {
    const mf_grammar g{a.states, a.edges, a.num_states, a.num_edges, a.vocab};
    MF_LAUNCH((a.rows + kAdvanceThreads - 1) / kAdvanceThreads, kAdvanceThreads, 0, stream,
              mf_grammar_advance_kernel)(g, a.rows, a.k, a.cells, a.state_words);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
