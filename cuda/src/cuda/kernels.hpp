// Launchers of the CUDA kernels (kernels/*.cu, beside this header), called by the cuda backend. Plain C++ so g++ can
// include it; every launcher returns the first launch error (cudaGetLastError) or cudaSuccess.
//
// The same sources build twice: by nvcc for the cuda backend (namespace cudak), and by the host
// compiler with MF_SIMT for the simt backend (namespace simtk), whose executor runs them on the CPU.
// Every launch is written MF_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...), which is
// kernel<<<grid, block, shared_bytes, stream>>>(args...) under nvcc.
#pragma once

#ifdef MF_SIMT
#include "simt/simt.cuh"
#define MF_KERNELS simtk
#else
#include <cuda_runtime.h>
#define MF_KERNELS cudak
#define MF_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
#endif
#include <stddef.h>
#include <stdint.h>

#include "metrale_feed/feed.h"

namespace mf {
namespace MF_KERNELS {

// Rows per argmax launch: their masks travel as a kernel parameter (2048 * 8 = 16 KiB).
constexpr uint32_t kArgmaxRowsPerLaunch = 2048;
// Sources per resolve launch, also passed by value (16 KiB).
constexpr uint32_t kResolvePerLaunch = 4096;
// Rows per penalty launch: host slots travel by value too (16 KiB).
constexpr uint32_t kPenaltyRowsPerLaunch = 4096;

// How one argmax call is laid out: `splits` blocks per row, each scanning `chunk` ids.
struct ArgmaxPlan {
    uint32_t splits;   // 1: one block per row, no scratch
    uint32_t chunk;    // ids per block (a multiple of 64), == vocab when splits == 1
    uint32_t threads;  // block size, a multiple of 32, at most 512
};

// Split rows (rows < 2 * SM count) need per-stream scratch: one packed partial per block and one
// arrival counter per row. Counters are zero between launches (the last block of a row resets it).
struct ArgmaxScratch {
    unsigned long long *partials;  // rows * splits
    unsigned int *counters;        // rows
};

// Scratch capacity that covers every plan argmax_plan makes on a device with `sm_count` SMs.
constexpr size_t argmax_scratch_partials(int sm_count) { return 6u * (size_t)sm_count; }
constexpr size_t argmax_scratch_counters(int sm_count) { return 2u * (size_t)sm_count; }

// Where a launch's ids go: the cells (stride 1), or a partial call's records (their id fields,
// 4 words apart, local ids that the stats kernel makes global); `total` sizes the bitmask rows.
struct IdSink {
    uint32_t *ids;
    uint32_t stride;
    uint32_t base;
    uint32_t total;
};
inline IdSink id_sink(const mf_argmax_args &a) {
    if (a.flags & MF_ARGS_PARTIAL)
        return IdSink{static_cast<uint32_t *>(a.partials) + 8, 4u, a.start, a.vocab_total};
    return IdSink{a.cells, 1u, 0u, a.vocab};
}

ArgmaxPlan argmax_plan(uint32_t rows, uint32_t vocab, mf_dtype dtype, int sm_count);

// args is already validated (rows >= 1, mask ids < vocab or NO_TOKEN, logits element-aligned);
// masks are copied into the launch parameters, so the host array may be reused on return.
cudaError_t launch_argmax(const mf_argmax_args &args, const ArgmaxPlan &plan,
                          const ArgmaxScratch &scratch, cudaStream_t stream);

// Device-resident sources (on_device) are read by the kernel; from_row >= prev_rows gives NO_TOKEN.
cudaError_t launch_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                           uint32_t prev_rows, uint32_t *out, bool on_device, cudaStream_t stream);

// A sampled id per row (args.params set; sample_feed.cu): one block per row, thresholds by radix
// select, no sort. Host params and masks travel by value, device ones are read when it runs.
cudaError_t launch_sample(const mf_argmax_args &args, cudaStream_t stream);

// After the argmax or the sampler: each row's (m, s) (logprob_rule.h), then its logprob, or (a
// partial call) its record and the block's header (logprob_feed.cu). One block per row.
cudaError_t launch_logprob_stats(const mf_argmax_args &args, cudaStream_t stream);

// Cells, logprobs and the fault word from gathered partial blocks; params (host) by value.
cudaError_t launch_combine(const mf_combine_args &args, cudaStream_t stream);

// Speculative verification (verify_feed.cu): one block per row, its positions in order; host
// drafts, masks and params travel by value, device ones are read when it runs.
cudaError_t launch_verify(const mf_verify_args &args, cudaStream_t stream);
cudaError_t launch_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                    uint32_t *out_advance, cudaStream_t stream);
cudaError_t launch_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                       uint32_t k, mf_sampling_params *out, cudaStream_t stream);

// The penalty ops (penalty_feed.cu): apply in place to the logits, or (update) count the ids.
cudaError_t launch_penalties(const mf_penalty_args &args, bool update, cudaStream_t stream);

// The top logprobs of each row (top_logprob_feed.cu): one block per row, read-only on the logits.
cudaError_t launch_top_logprobs(const mf_top_logprobs_args &args, cudaStream_t stream);
cudaError_t launch_top_combine(const mf_top_combine_args &args, cudaStream_t stream);
// One stage of a split row's filters (MF_ARGS_SELECT, select_feed.cu): one block a row. TOP and
// RACE leave the ids for launch_logprob_stats, which writes their records (stage_has_records).
cudaError_t launch_select_stage(const mf_argmax_args &args, cudaStream_t stream);
inline bool stage_has_records(const mf_argmax_args &a) {
    return !(a.flags & MF_ARGS_SELECT) || a.select_stage == MF_SELECT_TOP || a.select_stage == MF_SELECT_RACE;
}
cudaError_t launch_select_decide(const mf_select_decide_args &args, cudaStream_t stream);

// The device grammar (grammar_feed.cu): one block per logit row writes its bitmask row; one thread
// per row advances its state word.
cudaError_t launch_grammar_mask(const mf_grammar_mask_args &args, cudaStream_t stream);
cudaError_t launch_grammar_advance(const mf_grammar_advance_args &args, cudaStream_t stream);

cudaError_t launch_reference(const mf_reference_args &args, cudaStream_t stream);

// Whether this build has a kernel image (SASS or PTX) the current device can load.
cudaError_t kernels_loadable();

}  // namespace MF_KERNELS
}  // namespace mf
