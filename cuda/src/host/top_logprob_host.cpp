// The host twin of the top-logprobs kernel (top_logprob_feed.cu): the same rule
// (top_logprob_rule.h) in one pass a row, a sorted list of n packed words, and the row's (m, s)
// from row_stats, whose sum has the kernel's order; the rows spread over the pool.

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
    const bool vector = vector_paths();
    const size_t row_bytes = (size_t)a.row_stride * mf_dtype_size((int)a.dtype);
    const int dt = (int)a.dtype;
    auto *records = a.flags & MF_TOP_PARTIAL
                        ? static_cast<mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS
                        : nullptr;
    if (records)  // the header first: what the combine checks
        *static_cast<mf_partial_header *>(a.partials) =
            mf_partial_header{MF_PARTIAL_TAG ^ mf_top_partial_op(a.n, a.ids != nullptr), a.rows, a.call,
                              a.vocab_total, a.start, a.start + a.vocab, 0u};
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard pool_ieee;  // on each pool thread too
        for (uint32_t r = begin; r < end; ++r) {
            // An empty slice (vocab 0, partial only) has no row to read: no ids, (m, s) = (-inf, 0).
            const void *row = a.vocab ? static_cast<const char *>(a.logits) + r * row_bytes : nullptr;
            uint64_t list[MF_MAX_TOP_LOGPROBS] = {};
            if (a.n && a.vocab) fill_list(list, a.n, row, a.dtype, a.vocab, vector);  // 0: the chosen ones alone
            const RowStats st = a.vocab ? row_stats(row, a.dtype, a.vocab, vector) : RowStats{mf_neg_inf(), 0.0};
            if (records) {  // a slice of a split vocabulary: its block, for the combine
                records[r] = mf_top_slice_record(row, dt, a.start, a.vocab, a.ids ? a.ids[r] : MF_NO_TOKEN, st.m, st.s);
                mf_partial_cand *cands = mf_top_list(records, a.rows, a.n, r);
                for (uint32_t j = 0; j < a.n; ++j) cands[j] = mf_top_cand(list[j], row, dt, a.start);
                continue;
            }
            if (a.ids) a.chosen[r] = mf_top_chosen(row, dt, a.vocab, a.ids[r], st.m, st.s);
            for (uint32_t j = 0; j < a.n; ++j) a.out[(size_t)r * a.n + j] = mf_top_entry(list[j], row, dt, st.m, st.s);
        }
    });
}

void run_top_combine(const mf_top_combine_args &a) {
    IeeeFpGuard ieee;
    const uint32_t fault = mf_check_headers(static_cast<const mf_partial_header *>(a.partials), a.world,
                                            a.slice_stride, mf_top_partial_op(a.n, a.chosen != nullptr), a.rows,
                                            a.call, a.vocab);
    *a.fault = fault;
    const auto *records = static_cast<const mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS;
    for (uint32_t r = 0; r < a.rows; ++r)
        if (mf_top_combined_row(records, a.world, a.slice_stride, a.rows, a.n, r, fault, a.out + (size_t)r * a.n,
                                a.chosen ? a.chosen + r : nullptr) &&
            !*a.fault)
            *a.fault = MF_FAULT_IDS | (r << 8);  // the first such row
}

}  // namespace mf::host
