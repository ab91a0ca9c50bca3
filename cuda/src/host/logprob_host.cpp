// Logprob statistics of a row and the combine of partial records, on the CPU (logprob_rule.h).
// The sum of exponentials is accumulated in float64 in the fixed order of logprob_rule.h (256
// strided lanes, then a butterfly), never a sequential float32 sum: the same inputs give the same
// bits on every backend, and the error stays ~1e-7 relative at 152k ids.
#include <cmath>
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"
#include "vec_stats.hpp"

namespace mf::host {
namespace {

// The row's greatest logit (NaN never wins), then its sum of exponentials in the fixed order of
// logprob_rule.h (MF_STATS_LANES strided lanes, their butterfly and the warps in order), so the
// bits are the GPU kernel's and the simt backend's. `x(i)` is element i as a float32.
float row_max_portable(const void *row, int dt, uint32_t n) {
    float m = mf_neg_inf();
    for (uint32_t i = 0; i < n; ++i) {
        const float x = mf_from_bits(mf_logit_bits(row, dt, i));
        if (x > m) m = x;  // false for NaN
    }
    return m;
}

bool summable(float m) { return m > mf_neg_inf() && mf_finite_bits(mf_to_bits(m)); }

RowStats stats_portable(const void *row, int dt, uint32_t n) {
    const float m = row_max_portable(row, dt, n);
    if (!summable(m)) return RowStats{m, 0.0};
    double lanes[MF_STATS_LANES] = {};
    for (uint32_t i = 0; i < n; ++i)
        lanes[i % MF_STATS_LANES] += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dt, i)), m));
    return RowStats{m, mf_stats_fold(lanes)};
}

#if defined(__x86_64__) || defined(__i386__)
// The portable statistics on 8 lanes (vec_stats.hpp): the same bits.
RowStats stats_f32(const float *p, uint32_t n) {
    const float m = row_max8(p, n);
    if (!summable(m)) return RowStats{m, 0.0};
    return RowStats{m, stats_sum8(p, n, m)};
}
#endif

// Row r's record in block 0 (block w's is `slice_stride * w` records further).
const mf_partial_record *records_of(const mf_combine_args &a, uint32_t r) {
    return (const mf_partial_record *)a.partials + MF_PARTIAL_HEADER_RECORDS + r;
}

}  // namespace

RowStats row_stats(const void *row, mf_dtype dtype, uint32_t n, bool vector) {
#if defined(__x86_64__) || defined(__i386__)
    if (vector) {
        if (dtype == MF_DTYPE_F32) return stats_f32((const float *)row, n);
        // 16-bit rows widened once (exactly), so one vector path serves every dtype.
        thread_local std::vector<uint32_t> wide;
        wide.resize(n);
        for (uint32_t i = 0; i < n; ++i) wide[i] = mf_logit_bits(row, (int)dtype, i);
        return stats_f32((const float *)wide.data(), n);
    }
#else
    (void)vector;
#endif
    return stats_portable(row, (int)dtype, n);
}

void run_combine(const CombineJob &job) {
    const mf_combine_args &a = job.args;
    IeeeFpGuard ieee;
    const uint32_t fault = mf_combine_fault(mf_check_headers((const mf_partial_header *)a.partials, a.world,
                                                             a.slice_stride, mf_partial_op(a.op, a.logprobs != nullptr),
                                                             a.rows, a.call, a.vocab),
                                            a.refused);
    *a.fault = fault;
    if (a.flags & MF_COMBINE_VERIFY) {  // a verify over a split vocabulary (verify_rule.h)
        const uint32_t k = a.k, rows = a.rows / (k + 1);
        const mf_sampling_params *params = job.row_params();  // the logit rows' own; device: read now
        for (uint32_t r = 0; r < rows; ++r) {
            const size_t first = (size_t)r * (k + 1);
            uint32_t *cells = a.cells + (size_t)r * (k + 2);
            if (a.op == MF_PARTIAL_FILTERED)
                mf_verify_sampled_combined_row(records_of(a, (uint32_t)first), a.world, a.slice_stride, fault,
                                               params + first, a.select + first, a.drafts + (size_t)r * k, k, cells);
            else
                mf_verify_combined_row(records_of(a, (uint32_t)first), a.world, a.slice_stride, fault,
                                       a.drafts + (size_t)r * k, k, cells,
                                       a.logprobs ? a.logprobs + first : nullptr);
        }
        return;
    }
    const mf_sampling_params *params = job.row_params();  // device ones: read now, at run time
    for (uint32_t r = 0; r < a.rows; ++r) {
        const mf_partial_record *rec = records_of(a, r);
        uint32_t id = MF_NO_TOKEN, bits = 0;
        float m = mf_neg_inf();
        double s = 0.0;
        mf_sample_plan plan;
        const bool sampled = !fault && params && !(plan = mf_plan_sampling(&params[r])).greedy;
        if (sampled && a.op == MF_PARTIAL_SAMPLE && mf_plan_filtered(&plan)) {
            // A filter the slices could not apply (device params): this row's draw is refused.
            if (!*a.fault) *a.fault = MF_FAULT_FILTERS | (r << 8);
        } else if (!fault) {
            id = mf_combine_pick(rec, a.world, a.slice_stride, sampled ? &plan : nullptr);
            bits = mf_combine_bits(rec, a.world, a.slice_stride, id);
            if (a.logprobs) mf_combine_stats(rec, a.world, a.slice_stride, &m, &s);
        }
        a.cells[r] = id;
        if (a.logprobs) a.logprobs[r] = mf_logprob_finish(id, bits, m, s);
    }
}

}  // namespace mf::host
