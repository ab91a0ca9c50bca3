// The table each backend fills in. The public functions (api.cpp) validate arguments, resolve
// handles and keep the live-object ledger; a backend only performs already-checked operations.
#pragma once

#include <functional>

#include "metrale_feed/feed.h"

namespace mf {

enum CopyKind { kD2H = 0, kH2D = 1, kD2D = 2 };

// One public call kept by a host-backend capture, re-issued on the launch stream (api_graph.cpp).
using Replay = std::function<mf_status(mf_stream_t stream)>;

struct Ops {
    const char *name;
    mf_status (*init)();  // usable? (cuda: driver and device present)
    mf_status (*device_count)(int *count);
    mf_status (*device_name)(int device, char *buf, size_t buflen);
    mf_status (*driver_version)(int *version);

    mf_status (*event_create)(unsigned flags, void **raw);
    mf_status (*event_destroy)(void *raw);
    mf_status (*event_record)(void *raw, mf_stream_t stream);
    mf_status (*event_query)(void *raw, int *done);
    mf_status (*event_synchronize)(void *raw);
    mf_status (*event_elapsed_ms)(void *start, void *end, float *ms);
    // One slice of a wait: *done once the target is reached, else after about timeout_us. *mark
    // is 0 on the first slice; the backend keeps there what the wait waits for (host: the ticket
    // or queue position current at the first slice), so later slices wait for the same thing.
    mf_status (*event_wait)(void *raw, uint32_t timeout_us, uint64_t *mark, int *done);

    // Streams: `raw` is the backend's own value (cuda: cudaStream_t; host: a Stream*); 0 = default.
    mf_status (*stream_create)(unsigned flags, void **raw);
    mf_status (*stream_destroy)(void *raw);
    mf_status (*stream_query)(void *raw, int *idle);
    mf_status (*stream_synchronize)(void *raw);
    mf_status (*stream_wait_event)(void *raw, void *event_raw);
    mf_status (*stream_wait)(void *raw, uint32_t timeout_us, uint64_t *mark, int *done);

    mf_status (*host_alloc)(size_t nbytes, unsigned flags, void **out);  // zeroed
    mf_status (*host_free)(void *ptr);
    mf_status (*device_alloc)(size_t nbytes, void **out);
    mf_status (*device_free)(void *ptr);
    mf_status (*memset_async)(void *dev, int value, size_t nbytes, void *stream);
    mf_status (*copy_async)(void *dst, const void *src, size_t nbytes, CopyKind kind, void *stream);

    // Kernels only; argmax's copy and record are composed by api.cpp from the calls above.
    // One id per row: the argmax, or a sampled id when args->params is set (one descriptor, one
    // entry: the options are fields read by the shared rules, not separate launch paths).
    mf_status (*argmax)(const mf_argmax_args *args, void *stream);
    // sources_on_device: read when the kernel runs (a from_row >= prev_rows gives NO_TOKEN);
    // otherwise host words, checked by the caller and consumed before return.
    mf_status (*resolve)(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                         uint32_t *out, bool sources_on_device, void *stream);
    mf_status (*reference_forward)(const mf_reference_args *args, void *stream);
    mf_status (*launch_host_func)(mf_host_fn fn, void *data, void *stream);
    mf_status (*current_device)(int *device);  // the ordinal DLPack exports name
    // Cells, logprobs and the fault word from gathered partial blocks (logprob_rule.h); copies
    // and the record are composed by api_kernels.cpp.
    mf_status (*combine)(const mf_combine_args *args, void *stream);

    // Speculative verification (verify_rule.h): cells and logprobs; copies and the record are
    // composed by api_kernels.cpp. Host drafts, masks and params are consumed before return.
    mf_status (*verify)(const mf_verify_args *args, void *stream);
    // Each row's last emitted id and advance from verify cells, read when the kernel runs.
    mf_status (*resolve_verified)(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                  uint32_t *out_advance, void *stream);
    // The params of a verify's logit rows (verify_rule.h), device to device, read when it runs.
    mf_status (*verify_logit_params)(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                     uint32_t k, mf_sampling_params *out, void *stream);

    // Penalties (penalty_rule.h): apply to the logits in place, or (update) count the step's ids.
    // Host slots are consumed before return.
    mf_status (*penalties)(const mf_penalty_args *args, bool update, void *stream);
    // A pick with its step's penalties as one piece of work: args->penalties checked into `apply`
    // (the update is the same descriptor counting args->cells). nullptr: api_kernels.cpp queues
    // the two penalty ops around the pick instead. The host backend applies each row's penalties
    // just before its pick, so one thread's apply (latency-bound) overlaps another's pick
    // (bandwidth-bound) instead of all of them waiting on the same resource at once.
    mf_status (*argmax_penalised)(const mf_argmax_args *args, const mf_penalty_args *apply, void *stream);
    // A verify with its step's penalties as one piece of work: args->penalties checked into `apply`
    // (k and the verify's drafts; the update is the same descriptor counting args->cells). nullptr:
    // api_kernels.cpp queues the two penalty ops around the verify instead. The host backend
    // applies each logit row's penalties just before the verify reads the row, in the same pass.
    mf_status (*verify_penalised)(const mf_verify_args *args, const mf_penalty_args *apply, void *stream);

    // The top logprobs of each row (top_logprob_rule.h), read-only on the logits.
    mf_status (*top_logprobs)(const mf_top_logprobs_args *args, void *stream);
    // The top logprobs of a split vocabulary from gathered top blocks (top_logprob_rule.h): out,
    // chosen and the fault word; the copy and the record are composed by api_kernels.cpp.
    mf_status (*top_combine)(const mf_top_combine_args *args, void *stream);
    // The decisions between a split row's filter stages (select_rule.h), in stream order.
    mf_status (*select_decide)(const mf_select_decide_args *args, void *stream);
    // The device grammar (grammar_rule.h): the bitmask rows of each row's states, and each row's
    // state advanced by the ids a pick wrote; device data only, read when it runs.
    mf_status (*grammar_mask)(const mf_grammar_mask_args *args, void *stream);
    mf_status (*grammar_advance)(const mf_grammar_advance_args *args, void *stream);

    // Graphs (api_graph.cpp checks the arguments). `graph` is the backend's own object (cuda: a
    // cudaGraphExec_t); capture_end with graph NULL discards the capture.
    mf_status (*capture_begin)(void *stream);
    mf_status (*capture_status)(void *stream, int *capturing);
    mf_status (*capture_end)(void *stream, void **graph);
    mf_status (*graph_launch)(void *graph, void *stream, mf_stream_t handle);
    mf_status (*graph_destroy)(void *graph);
    // Host only (nullptr on cuda, whose runtime records the calls itself): when `stream` is
    // capturing, keeps `replay` for the graph instead of running the call, and returns true.
    bool (*capture_keep)(void *stream, Replay &&replay);

    // Host only (nullptr on cuda; see api.hpp, Staged): a call of several queued pieces opens a
    // staging on its stream before the first piece (throws when out of memory, nothing staged);
    // the pieces are then staged, not queued. stage_close publishes them all in one step when
    // `status` is MF_SUCCESS (MF_ERROR_OUT_OF_MEMORY, and none, when that fails), or else takes
    // back every one (an event record's ticket too) and returns `status`.
    void *(*stage_open)(void *stream);
    mf_status (*stage_close)(void *staging, mf_status status);
};

extern const Ops host_ops;
const Ops &simt_ops();  // the host table with the simt executor's kernels (simt_backend.cpp)
#ifdef MF_HAVE_CUDA
extern const Ops cuda_ops;
#endif

// Thread-local error state (error.cpp). Each returns `status` so a failure is one line.
mf_status fail(mf_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
mf_status fail_cuda(int code, const char *what);  // MF_ERROR_CUDA with the runtime's name and text

}  // namespace mf
