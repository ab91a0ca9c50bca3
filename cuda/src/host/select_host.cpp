// The host twin of the decisions' kernel (select_feed.cu): the same rule (select_rule.h), a row at
// a time on the stream's worker, between the exchanges of a split row's filters.
#include "host/kernels.hpp"
#include "metrale_feed/select_rule.h"

namespace mf::host {

void run_select_decide(const mf_select_decide_args &a) {
    IeeeFpGuard ieee;  // the rule's float tests (a subnormal top_p is on) need IEEE mode
    const char *gathered = static_cast<const char *>(a.gathered);
    if (a.step == MF_DECIDE_TOP) {
        const uint32_t stride = (uint32_t)(a.block_bytes / MF_PARTIAL_RECORD_BYTES);
        const uint32_t fault = mf_check_headers(reinterpret_cast<const mf_partial_header *>(gathered), a.world,
                                                stride, mf_partial_op(MF_PARTIAL_TOP, 0), a.rows, a.call, a.vocab);
        *a.fault = fault;
        const auto *rec = reinterpret_cast<const mf_partial_record *>(gathered) + MF_PARTIAL_HEADER_RECORDS;
        for (uint32_t r = 0; r < a.rows; ++r) {
            const uint32_t row_fault = mf_decide_top_row(rec + r, a.world, stride, fault, &a.params[r], a.next,
                                                         a.rounds, &a.select[r], &a.plan[r]);
            if (row_fault && !*a.fault) *a.fault = row_fault | (r << 8);  // the first such row
        }
        return;
    }
    if (*a.fault) return;  // refused at the TOP decision: nothing changes any more
    const auto *bins = reinterpret_cast<const uint64_t *>(gathered + MF_PARTIAL_HEADER_BYTES);
    for (uint32_t r = 0; r < a.rows; ++r)
        mf_decide_round_row(bins + (size_t)r * MF_SELECT_BINS, a.block_bytes / 8u, a.world, a.rank, &a.params[r],
                            a.select_k_p, a.round, a.next, &a.select[r], &a.plan[r]);
}

}  // namespace mf::host
