// The host twins of the CUDA kernels. They run on a stream's worker, spread over the pool.
#pragma once

#include <vector>

#include "metrale_feed/feed.h"

namespace mf::host {

struct ArgmaxJob {
    explicit ArgmaxJob(const mf_argmax_args &a)
        : args(a), masks(a.masks, a.masks + 2 * (size_t)a.rows) {
        args.masks = nullptr;  // the caller's array may be reused once the launch returns
    }
    mf_argmax_args args;
    std::vector<uint32_t> masks;
};

void run_argmax(const ArgmaxJob &job);
void run_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t *out);
void run_reference_forward(const mf_reference_args &args);

// One row under the rule, for tests of the dispatch: the portable path and the best one.
uint32_t argmax_row_portable(const void *row, mf_dtype dtype, uint32_t vocab, uint32_t m0, uint32_t m1);
uint32_t argmax_row(const void *row, mf_dtype dtype, uint32_t vocab, uint32_t m0, uint32_t m1);
const char *argmax_isa();
bool use_portable_argmax(bool portable);  // for tests of both paths; false: no vector path here

}  // namespace mf::host
