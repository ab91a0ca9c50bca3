// The host twin of the top-logprobs kernel (top_logprob_feed.cu): the same rule
// (top_logprob_rule.h) in one pass a row, a sorted list of n packed words, and the row's (m, s)
// from row_stats, whose sum has the kernel's order; the rows spread over the pool.
#include <cstring>

#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/top_logprob_rule.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace mf::host {
namespace {

void insert_span(uint64_t *list, uint32_t n, const void *row, int dt, uint32_t lo, uint32_t hi) {
    for (uint32_t i = lo; i < hi; ++i) mf_top_insert(list, n, mf_top_word(row, dt, i));
}

// The list's last word as a float32 bound for a prefilter, or false when every id must be looked
// at: the list is not full, or its last is a NaN (key 0, below every number).
bool bound_of(const uint64_t *list, uint32_t n, const void *row, int dt, float *bound) {
    const uint64_t last = list[n - 1];
    if ((last >> 32) == 0) return false;
    *bound = mf_from_bits(mf_logit_bits(row, dt, mf_unpack_id(last)));
    return true;
}

#if defined(__x86_64__) || defined(__i386__)
// float32 rows, 8 ids at a time: a vector compare keeps only the blocks holding a value at least
// the list's last (its ties included: the word decides them), a superset of the ids whose word is
// greater, so the list ends as the portable pass leaves it. NaN compares false, and ranks last.
__attribute__((target("avx2"))) void insert_f32(uint64_t *list, uint32_t n, const float *p, uint32_t vocab) {
    uint32_t i = 0;
    float bound = 0.0f;
    for (; i + 8 <= vocab; i += 8) {
        if (bound_of(list, n, p, 0, &bound)) {
            const __m256 ge = _mm256_cmp_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(bound), _CMP_GE_OQ);
            if (!_mm256_movemask_ps(ge)) continue;
        }
        insert_span(list, n, p, 0, i, i + 8);
    }
    insert_span(list, n, p, 0, i, vocab);
}
#endif

void fill_list(uint64_t *list, uint32_t n, const void *row, mf_dtype dtype, uint32_t vocab, bool vector) {
#if defined(__x86_64__) || defined(__i386__)
    if (vector && dtype == MF_DTYPE_F32) return insert_f32(list, n, static_cast<const float *>(row), vocab);
#else
    (void)vector;
#endif
    insert_span(list, n, row, (int)dtype, 0, vocab);
}

}  // namespace

void run_top_logprobs(const mf_top_logprobs_args &a) {
    IeeeFpGuard ieee;  // the exp polynomial needs subnormals
    const bool vector = std::strcmp(argmax_isa(), "portable") != 0;
    const size_t row_bytes = (size_t)a.row_stride * mf_dtype_size((int)a.dtype);
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard pool_ieee;  // on each pool thread too
        for (uint32_t r = begin; r < end; ++r) {
            const void *row = static_cast<const char *>(a.logits) + r * row_bytes;
            uint64_t list[MF_MAX_TOP_LOGPROBS] = {};
            if (a.n) fill_list(list, a.n, row, a.dtype, a.vocab, vector);  // 0: the chosen ones alone
            const RowStats st = row_stats(row, a.dtype, a.vocab, vector);
            if (a.ids) a.chosen[r] = mf_top_chosen(row, (int)a.dtype, a.vocab, a.ids[r], st.m, st.s);
            for (uint32_t j = 0; j < a.n; ++j)
                a.out[(size_t)r * a.n + j] = mf_top_entry(list[j], row, (int)a.dtype, st.m, st.s);
        }
    });
}

}  // namespace mf::host
