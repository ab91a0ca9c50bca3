// The decisions between a split row's filter stages (select_rule.h): a thread a row. Each
// decision is a few hundred integer operations a row (a ROUND sums `world` histograms of 256
// weights), so one small launch after each exchange, on the stream, with no host in between.
#include "cuda/kernels.hpp"
#include "metrale_feed/select_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

__global__ void mf_select_decide_kernel(const char *gathered, uint64_t block_bytes, uint32_t world, uint32_t rank,
                                        uint32_t rows, uint32_t vocab, uint64_t call, uint32_t step,
                                        const mf_sampling_params *params, mf_select_row *select,
                                        mf_select_plan *plan, uint32_t *fault, uint32_t sel, uint32_t round,
                                        uint32_t next) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    if (step == MF_DECIDE_TOP) {
        const uint32_t f = mf_check_headers(reinterpret_cast<const mf_partial_header *>(gathered), world,
                                            (uint32_t)(block_bytes / MF_PARTIAL_RECORD_BYTES),
                                            mf_partial_op(MF_PARTIAL_TOP, 0), rows, call, vocab);
        if (r == 0) *fault = f;
        const auto *rec = reinterpret_cast<const mf_partial_record *>(gathered) + MF_PARTIAL_HEADER_RECORDS + r;
        mf_decide_top_row(rec, world, (uint32_t)(block_bytes / MF_PARTIAL_RECORD_BYTES), f, &params[r], next,
                          &select[r], &plan[r]);
        return;
    }
    if (*fault) return;  // refused at the TOP decision: nothing changes any more
    const auto *bins = reinterpret_cast<const uint64_t *>(gathered + MF_PARTIAL_HEADER_BYTES) + (uint64_t)r * MF_SELECT_BINS;
    mf_decide_round_row(bins, block_bytes / 8u, world, rank, &params[r], sel, round, next, &select[r], &plan[r]);
}

}  // namespace

cudaError_t launch_select_decide(const mf_select_decide_args &a, cudaStream_t stream) {
    (void)stream;  // unused by the simt launch
    MF_LAUNCH((a.rows + 127) / 128, 128, 0, stream, mf_select_decide_kernel)(
        static_cast<const char *>(a.gathered), a.block_bytes, a.world, a.rank, a.rows, a.vocab, a.call, a.step,
        a.params, a.select, a.plan, a.fault, a.select_k_p, a.round, a.next);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
