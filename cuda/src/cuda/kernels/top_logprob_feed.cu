// The top logprobs of each row (top_logprob_rule.h): one block per row. The row's (m, s) first,
// exactly as the chosen-token logprob kernel folds them (logprob_feed.cu), then n rounds, each
// the block-wide greatest packed word below the previous round's: n passes over a row that stays
// in cache, integer comparisons only, so the ids are the host's whatever the thread count.
#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/top_logprob_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = MF_STATS_LANES;  // the lanes of the fixed order of a row's sum

// With `records` (MF_TOP_PARTIAL) the row's outputs go to the slice's block instead of out and
// chosen: its record (m, s and the asked-for id's logit) and its list (global ids, start + column).
__global__ void __launch_bounds__(kThreads)
    mf_top_logprobs_kernel(const char *logits, int dtype, uint64_t row_bytes, uint32_t width, uint32_t n,
                           mf_top_logprob *out, const uint32_t *ids, float *chosen, mf_partial_record *records,
                           const mf_partial_header header) {
    __shared__ float fslots[kThreads / 32];
    __shared__ double dslots[kThreads / 32];
    __shared__ unsigned long long pslots[kThreads / 32];
    const uint32_t r = blockIdx.x;
    const void *row = logits + r * row_bytes;  // never read when width is 0 (an empty slice)
    float m = mf_neg_inf();
    for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) m = MaxFloat()(m, mf_from_bits(mf_logit_bits(row, dtype, i)));
    m = block_fold(m, MaxFloat(), fslots);
    double s = 0.0;
    if (m > mf_neg_inf() && mf_finite_bits(mf_to_bits(m))) {  // uniform across the block
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
            s += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dtype, i)), m));
        s = block_fold(s, Sum(), dslots);
    }
    mf_partial_cand *list = records ? mf_top_list(records, header.rows, n, r) : nullptr;
    if (threadIdx.x == 0) {
        if (records) {
            records[r] = mf_top_slice_record(row, dtype, header.start, width, ids ? ids[r] : MF_NO_TOKEN, m, s);
            if (r == 0) reinterpret_cast<mf_partial_header *>(records)[-1] = header;  // the two records before row 0
        } else if (ids) {
            chosen[r] = mf_top_chosen(row, dtype, width, ids[r], m, s);
        }
    }
    unsigned long long bound = ~0ull;  // above every word
    for (uint32_t j = 0; j < n; ++j) {
        unsigned long long best = 0ull;
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
            const unsigned long long w = mf_top_word(row, dtype, i);
            if (w < bound) best = mf_pack_max(best, w);
        }
        best = block_fold(best, MaxPacked(), pslots);
        if (threadIdx.x == 0) {
            if (list) list[j] = mf_top_cand(best, row, dtype, header.start);
            else out[(uint64_t)r * n + j] = mf_top_entry(best, row, dtype, m, s);
        }
        bound = best;  // 0 once the ids run out: every later round answers none
    }
}

// The combine of gathered top blocks: one thread per row, merging the slices' lists (a few
// hundred words) as the host backend does (mf_top_combined_row).
__global__ void mf_top_combine_kernel(const mf_partial_record *records, const mf_partial_header *headers,
                                      uint32_t world, uint32_t stride, uint32_t rows, uint32_t n, uint64_t call,
                                      uint32_t vocab, mf_top_logprob *out, float *chosen, uint32_t *fault) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const uint32_t f =
        mf_check_headers(headers, world, stride, mf_top_partial_op(n, chosen != nullptr), rows, call, vocab);
    // The word was zeroed before the launch: row 0 writes a header fault (uniform: then no row
    // compares ids), any row its ids' disagreement (the first to get there).
    if (r == 0 && f) *fault = f;
    if (mf_top_combined_row(records, world, stride, rows, n, r, f, out + (uint64_t)r * n, chosen ? chosen + r : nullptr))
        atomicCAS(fault, 0u, MF_FAULT_IDS | (r << 8));
}

}  // namespace

cudaError_t launch_top_logprobs(const mf_top_logprobs_args &a, cudaStream_t stream) {
    (void)stream;  // unused by the simt launch
    mf_partial_header h{};
    mf_partial_record *records = nullptr;
    if (a.flags & MF_TOP_PARTIAL) {
        h = mf_partial_header{MF_PARTIAL_TAG ^ mf_top_partial_op(a.n, a.ids != nullptr), a.rows, a.call,
                              a.vocab_total, a.start, a.start + a.vocab, 0u};
        records = static_cast<mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS;
    }
    // rows <= MF_MAX_ROWS (checked at the C ABI): one block each, one launch.
    MF_LAUNCH(a.rows, kThreads, 0, stream, mf_top_logprobs_kernel)(
        static_cast<const char *>(a.logits), (int)a.dtype, a.row_stride * mf_dtype_size((int)a.dtype), a.vocab, a.n,
        a.out, a.ids, a.chosen, records, h);
    return cudaGetLastError();
}

cudaError_t launch_top_combine(const mf_top_combine_args &a, cudaStream_t stream) {
    (void)stream;
    const auto *headers = static_cast<const mf_partial_header *>(a.partials);
    const auto *records = static_cast<const mf_partial_record *>(a.partials) + MF_PARTIAL_HEADER_RECORDS;
    cudaError_t e = cudaMemsetAsync(a.fault, 0, 4, stream);
    if (e != cudaSuccess) return e;
    MF_LAUNCH((a.rows + 127) / 128, 128, 0, stream, mf_top_combine_kernel)(
        records, headers, a.world, a.slice_stride, a.rows, a.n, a.call, a.vocab, a.out, a.chosen, a.fault);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
