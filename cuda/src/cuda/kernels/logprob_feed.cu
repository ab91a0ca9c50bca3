// Chosen-token logprobs and the partial records of a split row (logprob_rule.h), after the argmax
// or the sampler has written each row's id. One block per row: the greatest logit, then the sum of
// exp(logit - max) in float64, each thread over a fixed stride of ids and the block in a fixed
// tree, so the same inputs give the same bits (no atomics). The combine is one thread per row.
#include <algorithm>

#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = MF_STATS_LANES;  // the lanes of the fixed order of a row's sum
constexpr uint32_t kCombineRowsPerLaunch = 256;  // 256 * 32 bytes of params by value

struct CombineParams {
    mf_sampling_params params[kCombineRowsPerLaunch];
};


// ids: the argmax/sampler's output, row r at ids[r * id_stride] (a local id in a partial call).
// stats false (a partial call without MF_ARGS_PARTIAL_LOGPROBS, launched with one warp): the
// record alone, its (m, s) left 0, so no pass over the row.
__global__ void __launch_bounds__(kThreads)
    mf_logprob_stats_kernel(const char *logits, int dtype, uint64_t row_bytes, uint32_t width,
                            const uint32_t *ids, uint32_t id_stride, float *logprobs,
                            mf_partial_record *records, mf_partial_header header, bool stats, bool top) {
    __shared__ float fslots[kThreads / 32];
    __shared__ double dslots[kThreads / 32];
    const uint32_t r = blockIdx.x;
    const void *row = logits + r * row_bytes;
    float m = stats ? mf_neg_inf() : 0.0f;
    double s = 0.0;
    if (stats) {  // uniform across the grid: every thread takes the folds or none does
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) m = MaxFloat()(m, mf_from_bits(mf_logit_bits(row, dtype, i)));
        m = block_fold(m, MaxFloat(), fslots);
    }
    if (stats && m > mf_neg_inf() && mf_finite_bits(mf_to_bits(m))) {
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
            s += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dtype, i)), m));
        s = block_fold(s, Sum(), dslots);
    }
    if (threadIdx.x != 0) return;
    const uint32_t id = ids[(uint64_t)r * id_stride];
    const uint32_t bits = id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, dtype, id);
    if (!records) {
        logprobs[r] = mf_logprob_finish(id, bits, m, s);
        return;
    }
    if (top) {  // the candidate; the stage wrote the free words (select_rule.h, verify_rule.h)
        records[r].id = id == MF_NO_TOKEN ? MF_NO_TOKEN : header.start + id;
        records[r].logit_bits = bits;
    } else {
        records[r] = mf_partial_record{id == MF_NO_TOKEN ? MF_NO_TOKEN : header.start + id, bits, m, (float)s};
    }
    if (r == 0) reinterpret_cast<mf_partial_header *>(records)[-1] = header;  // the two records before row 0
}

__global__ void mf_combine_kernel(const mf_partial_record *first, const mf_partial_header *headers,
                                  uint32_t world, uint32_t stride, uint32_t rows, uint32_t op,
                                  uint64_t call, uint32_t vocab, uint32_t *cells, float *logprobs,
                                  uint32_t *fault, const uint32_t *refused, uint32_t row0,
                                  const mf_sampling_params *device_params,
                                  const __grid_constant__ CombineParams in) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;  // within this launch
    if (row0 + r >= rows || r >= kCombineRowsPerLaunch) return;
    const uint32_t f = mf_combine_fault(
        mf_check_headers(headers, world, stride, mf_partial_op(op, logprobs != nullptr), rows, call, vocab), refused);
    // With device params the word was zeroed before the launches and a filtered row may set it
    // from any block: row 0 then writes only a header fault (which no row overrides).
    if (row0 + r == 0 && (f || !device_params)) *fault = f;
    uint32_t id = MF_NO_TOKEN, bits = 0;
    float m = mf_neg_inf();
    double s = 0.0;
    mf_sample_plan plan;
    // FILTERED records are race winners over the filters' global thresholds (MF_ARGS_SELECT): the
    // filters were applied; a SAMPLE call's slices could not apply them.
    const bool sampled =
        !f && (op == MF_PARTIAL_SAMPLE || op == MF_PARTIAL_FILTERED) &&
        !(plan = mf_plan_sampling(device_params ? &device_params[row0 + r] : &in.params[r])).greedy;
    if (sampled && op == MF_PARTIAL_SAMPLE && mf_plan_filtered(&plan)) {  // a filter the slices could not apply
        atomicCAS(fault, 0u, MF_FAULT_FILTERS | ((row0 + r) << 8));
    } else if (!f) {
        const mf_partial_record *rec = first + row0 + r;
        id = mf_combine_pick(rec, world, stride, sampled ? &plan : nullptr);
        bits = mf_combine_bits(rec, world, stride, id);
        if (logprobs) mf_combine_stats(rec, world, stride, &m, &s);
    }
    cells[row0 + r] = id;
    if (logprobs) logprobs[row0 + r] = mf_logprob_finish(id, bits, m, s);
}

// A greedy verify over a split vocabulary (MF_COMBINE_VERIFY): one thread per verified row, each
// walking its k + 1 positions' records in order (verify_rule.h), as the host backend does.
__global__ void mf_combine_verify_kernel(const mf_partial_record *first, const mf_partial_header *headers,
                                         uint32_t world, uint32_t stride, uint32_t rows, uint32_t op, uint64_t call,
                                         uint32_t vocab, const uint32_t *drafts, uint32_t k, uint32_t *cells,
                                         float *logprobs, uint32_t *fault, const uint32_t *refused,
                                         const mf_sampling_params *params, const mf_select_row *select) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows / (k + 1)) return;
    const uint32_t f = mf_combine_fault(
        mf_check_headers(headers, world, stride, mf_partial_op(op, logprobs != nullptr), rows, call, vocab), refused);
    if (r == 0) *fault = f;
    const uint64_t lr = (uint64_t)r * (k + 1);
    if (op == MF_PARTIAL_FILTERED)  // sampled rows: the RACE records of a verify's stages
        mf_verify_sampled_combined_row(first + lr, world, stride, f, params + lr, select + lr,
                                       drafts + (uint64_t)r * k, k, cells + (uint64_t)r * (k + 2));
    else
        mf_verify_combined_row(first + lr, world, stride, f, drafts + (uint64_t)r * k, k, cells + (uint64_t)r * (k + 2),
                               logprobs ? logprobs + lr : nullptr);
}

}  // namespace

cudaError_t launch_logprob_stats(const mf_argmax_args &a, cudaStream_t stream) {
    const uint64_t esize = a.dtype == MF_DTYPE_F32 ? 4u : 2u;
    const bool partial = a.flags & MF_ARGS_PARTIAL;
    const IdSink sink = id_sink(a);
    // A select's TOP records, and a sampled verify's RACE records: the candidate, no stats; the
    // stage wrote their free words (select_rule.h, verify_rule.h).
    const bool top = (a.flags & MF_ARGS_SELECT) &&
                     (a.select_stage == MF_SELECT_TOP || (a.select_stage == MF_SELECT_RACE && a.select_drafts));
    const bool stats = (!partial || (a.flags & MF_ARGS_PARTIAL_LOGPROBS)) && !top;
    mf_partial_header h{};
    mf_partial_record *records = nullptr;
    if (partial) {
        h = mf_partial_call_header(&a, a.params != nullptr);
        records = static_cast<mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS;
    }
    MF_LAUNCH(a.rows, stats ? kThreads : 32, 0, stream, mf_logprob_stats_kernel)(
        static_cast<const char *>(a.logits), (int)a.dtype, a.row_stride * esize, a.vocab, sink.ids,
        sink.stride, a.logprobs, records, h, stats, top);
    return cudaGetLastError();
}

cudaError_t launch_combine(const mf_combine_args &a, cudaStream_t stream) {
    const auto *headers = static_cast<const mf_partial_header *>(a.partials);
    const auto *first = static_cast<const mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS;
    // Device params are read by the kernel when it runs (a graph's replay sees their new values).
    if (a.flags & MF_COMBINE_VERIFY) {
        const uint32_t n = a.rows / (a.k + 1);
        // A sampled verify's params are device ones (api_kernels.cpp), read when the kernel runs.
        MF_LAUNCH((n + 127) / 128, 128, 0, stream, mf_combine_verify_kernel)(first, headers, a.world, a.slice_stride,
                                                                     a.rows, a.op, a.call, a.vocab, a.drafts, a.k,
                                                                     a.cells, a.logprobs, a.fault, a.refused,
                                                                     a.params, a.select);
        return cudaGetLastError();
    }
    const mf_sampling_params *dparams = (a.flags & MF_COMBINE_PARAMS_DEVICE) ? a.params : nullptr;
    if (dparams) {
        cudaError_t e = cudaMemsetAsync(a.fault, 0, 4, stream);
        if (e != cudaSuccess) return e;
    }
    for (uint32_t row0 = 0; row0 < a.rows; row0 += kCombineRowsPerLaunch) {
        const uint32_t n = std::min(a.rows - row0, kCombineRowsPerLaunch);
        CombineParams in;
        if (a.params && !dparams) std::copy(a.params + row0, a.params + row0 + n, in.params);
        MF_LAUNCH((n + 127) / 128, 128, 0, stream, mf_combine_kernel)(first, headers, a.world, a.slice_stride,
                                                              a.rows, a.op, a.call, a.vocab, a.cells,
                                                              a.logprobs, a.fault, a.refused, row0, dparams, in);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace MF_KERNELS
}  // namespace mf
