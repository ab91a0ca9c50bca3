// The host twin of the top-logprobs kernel (top_logprob_feed.cu): the same rule
// (top_logprob_rule.h) in one pass a row, a sorted list of n packed words, and the row's (m, s)
// from row_stats, whose sum has the kernel's order; the rows spread over the pool.
#include <cstring>

#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/top_logprob_rule.h"

namespace mf::host {

void run_top_logprobs(const mf_top_logprobs_args &a) {
    IeeeFpGuard ieee;  // the exp polynomial needs subnormals
    const bool vector = std::strcmp(argmax_isa(), "portable") != 0;
    const size_t row_bytes = (size_t)a.row_stride * mf_dtype_size((int)a.dtype);
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard pool_ieee;  // on each pool thread too
        for (uint32_t r = begin; r < end; ++r) {
            const void *row = static_cast<const char *>(a.logits) + r * row_bytes;
            uint64_t list[MF_MAX_TOP_LOGPROBS] = {};
            for (uint32_t i = 0; i < a.vocab; ++i) mf_top_insert(list, a.n, mf_top_word(row, (int)a.dtype, i));
            const RowStats st = row_stats(row, a.dtype, a.vocab, vector);
            for (uint32_t j = 0; j < a.n; ++j)
                a.out[(size_t)r * a.n + j] = mf_top_entry(list[j], row, (int)a.dtype, st.m, st.s);
        }
    });
}

}  // namespace mf::host
