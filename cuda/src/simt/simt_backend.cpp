// The simt backend: the host backend's runtime (streams, events, memory, copies, graphs, host
// functions) with the real CUDA kernels run by the simt executor on the stream's worker. The
// kernel entries do what the cuda backend's do (the same launch planning, the same per-stream
// scratch, the same launchers), queued in stream order as the host backend queues its twins.
//
// Compiled with MF_SIMT: cuda/kernels.hpp then declares the launchers of the .cu sources as
// compiled by the host compiler (namespace simtk).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "../backend.hpp"
#include "../host/kernels.hpp"
#include "../host/queue.hpp"
#include "cuda/kernels.hpp"
#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/logprob_rule.h"
#include "simt/executor.hpp"

namespace mf::simt {
namespace {

// A kernel fault is a device fault: CUDA makes it sticky and unrecoverable for the context, so
// the simt backend stops the process with the executor's message (kernel, launch site, line).
void check(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return;
    const std::string why = take_fault();
    std::fprintf(stderr, "metrale_feed: the simt backend stopped the process in %s: %s\n", what,
                 why.empty() ? "launch failed" : why.c_str());
    std::fflush(stderr);
    std::abort();
}

// The split argmax's per-stream scratch (cuda_backend.cpp's scratch_for): each stream has one
// worker thread, so a thread_local is a per-stream scratch; counters start at zero and the last
// block of each row resets its own, as on the GPU.
struct Scratch {
    int sms = 0;
    std::vector<unsigned long long> partials;
    std::vector<unsigned int> counters;
    simtk::ArgmaxScratch view(int want) {
        if (sms != want) {
            partials.assign(simtk::argmax_scratch_partials(want), 0ull);
            counters.assign(simtk::argmax_scratch_counters(want), 0u);
            sms = want;
        }
        return simtk::ArgmaxScratch{partials.data(), counters.data()};
    }
};
thread_local Scratch tl_scratch;

const Ops *g_host = nullptr;  // the host backend's table, for the entries simt shares with it

// What the cuda backend's argmax() does, run on the worker: the plan, then the kernels.
void run_kernels(const host::ArgmaxJob &job) {
    mf_argmax_args a = job.args;
    // Host masks and params were copied by the job; the launchers pass them by value, as the
    // cuda backend passes the caller's.
    a.masks = job.mask_words();
    a.params = job.row_params();
    if (a.flags & MF_ARGS_SELECT) {
        check(simtk::launch_select_stage(a, nullptr), "mf_select_stage_kernel");
    } else if (a.params) {
        check(simtk::launch_sample(a, nullptr), "mf_sample_kernel");
    } else {
        const int sms = config().sm_count;
        const simtk::ArgmaxPlan plan = simtk::argmax_plan(a.rows, a.vocab, a.dtype, sms);
        simtk::ArgmaxScratch scratch{nullptr, nullptr};
        if (plan.splits > 1) scratch = tl_scratch.view(sms);
        check(simtk::launch_argmax(a, plan, scratch, nullptr), "mf_argmax_kernel");
    }
    if ((a.logprobs || (a.flags & MF_ARGS_PARTIAL)) && simtk::stage_has_records(a))
        check(simtk::launch_logprob_stats(a, nullptr), "mf_logprob_stats_kernel");
}

mf_status argmax(const mf_argmax_args *a, void *stream) {
    if (a->rows == 0) return MF_SUCCESS;
    if (!a->params) {
        const uintptr_t esize = mf_dtype_size(a->dtype);
        if (reinterpret_cast<uintptr_t>(a->logits) % esize != 0)
            return fail(MF_ERROR_INVALID_VALUE,
                        "argmax_to_feed: logits pointer %p is not aligned to its %u-byte elements", a->logits,
                        (unsigned)esize);
        const int sms = config().sm_count;
        const simtk::ArgmaxPlan plan = simtk::argmax_plan(a->rows, a->vocab, a->dtype, sms);
        if (plan.splits > 1 && ((uint64_t)a->rows * plan.splits > simtk::argmax_scratch_partials(sms) ||
                                a->rows > simtk::argmax_scratch_counters(sms)))
            return fail(MF_ERROR_INVALID_VALUE, "argmax_to_feed: split plan exceeds its scratch");
    }
    try {
        host::ArgmaxJob job(*a);
        host::stream_of(stream)->enqueue("argmax", [job = std::move(job)] { run_kernels(job); });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "argmax_to_feed: out of memory");
    }
    return MF_SUCCESS;
}

mf_status resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows, uint32_t *out,
                  bool sources_on_device, void *stream) {
    try {
        std::vector<uint32_t> words;  // host sources are consumed now; device ones read when it runs
        if (!sources_on_device) words.assign(sources, sources + n);
        host::stream_of(stream)->enqueue("resolve_feed", [words = std::move(words), sources, n, cells, prev_rows,
                                                          out, sources_on_device] {
            check(simtk::launch_resolve(sources_on_device ? sources : words.data(), n, cells, prev_rows, out,
                                        sources_on_device, nullptr),
                  "mf_resolve_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "resolve_feed: out of memory");
    }
    return MF_SUCCESS;
}

mf_status reference_forward(const mf_reference_args *args, void *stream) {
    const mf_reference_args copy = *args;
    if (copy.rows == 0) return MF_SUCCESS;
    try {
        host::stream_of(stream)->enqueue("reference_forward", [copy] {
            check(simtk::launch_reference(copy, nullptr), "mf_reference_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "reference_forward: out of memory");
    }
    return MF_SUCCESS;
}

mf_status combine(const mf_combine_args *args, void *stream) {
    try {
        host::CombineJob job(*args);
        host::stream_of(stream)->enqueue("combine_partials", [job = std::move(job)] {
            mf_combine_args a = job.args;
            if (!(a.flags & MF_COMBINE_PARAMS_DEVICE)) a.params = job.row_params();
            check(simtk::launch_combine(a, nullptr), "mf_combine_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "combine_partials: out of memory");
    }
    return MF_SUCCESS;
}

mf_status verify(const mf_verify_args *args, void *stream) {
    try {
        host::VerifyJob job(*args);  // host drafts, masks and params copied: the caller may reuse them
        host::stream_of(stream)->enqueue("verify", [job = std::move(job)] {
            mf_verify_args a = job.args;
            a.drafts = job.draft_ids();
            a.masks = job.mask_words();
            a.params = job.row_params();
            check(simtk::launch_verify(a, nullptr), "mf_verify_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "verify_to_feed: out of host memory for its inputs");
    }
    return MF_SUCCESS;
}

mf_status resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                           uint32_t *out_advance, void *stream) {
    try {
        host::stream_of(stream)->enqueue("resolve_verified", [=] {
            check(simtk::launch_resolve_verified(cells, rows, k, out_ids, out_advance, nullptr),
                  "mf_resolve_verified_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "resolve_verified: out of memory");
    }
    return MF_SUCCESS;
}

mf_status verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                              mf_sampling_params *out, void *stream) {
    try {
        host::stream_of(stream)->enqueue("verify_logit_params", [=] {
            check(simtk::launch_verify_logit_params(params, advance, rows, k, out, nullptr), "mf_verify_logit_params_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "verify_logit_params: out of memory");
    }
    return MF_SUCCESS;
}

mf_status penalties(const mf_penalty_args *args, bool update, void *stream) {
    try {
        host::PenaltyJob job(*args, update);  // host slots copied: the caller may reuse them
        host::stream_of(stream)->enqueue(update ? "penalties_update" : "penalties_apply", [job = std::move(job)] {
            mf_penalty_args a = job.args;
            a.slots = job.slot_words();
            check(simtk::launch_penalties(a, job.update, nullptr),
                  job.update ? "mf_penalty_update_kernel" : "mf_penalty_apply_kernel");
        });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "penalties: out of memory");
    }
    return MF_SUCCESS;
}

// A kernel whose descriptor holds everything it reads (device memory only): the descriptor is
// copied into the queued work, launched when the stream's worker reaches it.
template <class Args>
mf_status queue_kernel(const Args &args, void *stream, const char *op, const char *kernel,
                       cudaError_t (*launch)(const Args &, cudaStream_t)) {
    try {
        host::stream_of(stream)->enqueue(op, [a = args, kernel, launch] { check(launch(a, nullptr), kernel); });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "%s: out of memory", op);
    }
    return MF_SUCCESS;
}

mf_status top_logprobs(const mf_top_logprobs_args *args, void *stream) {
    return queue_kernel(*args, stream, "top_logprobs", "mf_top_logprobs_kernel", simtk::launch_top_logprobs);
}

mf_status top_combine(const mf_top_combine_args *args, void *stream) {
    return queue_kernel(*args, stream, "top_logprobs_combine", "mf_top_combine_kernel", simtk::launch_top_combine);
}

mf_status select_decide(const mf_select_decide_args *args, void *stream) {
    return queue_kernel(*args, stream, "select_decide", "mf_select_decide_kernel", simtk::launch_select_decide);
}

mf_status grammar_mask(const mf_grammar_mask_args *args, void *stream) {
    return queue_kernel(*args, stream, "grammar_mask", "mf_grammar_mask_kernel", simtk::launch_grammar_mask);
}

mf_status grammar_advance(const mf_grammar_advance_args *args, void *stream) {
    return queue_kernel(*args, stream, "grammar_advance", "mf_grammar_advance_kernel", simtk::launch_grammar_advance);
}

mf_status device_name(int, char *buf, size_t buflen) {
    if (buflen) std::snprintf(buf, buflen, "simt (CUDA kernels on the CPU, %d SMs planned)", config().sm_count);
    return MF_SUCCESS;
}

Ops make_ops() {
    g_host = &host_ops;
    Ops o = host_ops;
    o.name = "simt";
    o.device_name = device_name;
    o.argmax = argmax;
    o.resolve = resolve;
    o.reference_forward = reference_forward;
    o.combine = combine;
    o.verify = verify;
    o.resolve_verified = resolve_verified;
    o.verify_logit_params = verify_logit_params;
    o.penalties = penalties;
    o.argmax_penalised = nullptr;  // the kernels' order: apply, pick, update
    o.verify_penalised = nullptr;  // the kernels' order: apply, verify, update
    o.top_logprobs = top_logprobs;
    o.top_combine = top_combine;
    o.select_decide = select_decide;
    o.grammar_mask = grammar_mask;
    o.grammar_advance = grammar_advance;
    return o;
}

}  // namespace
}  // namespace mf::simt

namespace mf {
// Built on first use, after static initialisation, from the host backend's table.
const Ops &simt_ops() {
    static const Ops ops = simt::make_ops();
    return ops;
}
}  // namespace mf

extern "C" {
mf_status mf_simt_configure(const mf_simt_config *c) {
    if (!c) return mf::fail(MF_ERROR_INVALID_VALUE, "mf_simt_configure: config is NULL");
    if (c->sm_count < 1 || c->sm_count > 1024)
        return mf::fail(MF_ERROR_INVALID_VALUE, "simt sm_count must be 1 to 1024, not %d", c->sm_count);
    if (c->order < 0 || c->order > 2)
        return mf::fail(MF_ERROR_INVALID_VALUE, "simt block order must be 0 (in order), 1 (reversed) or 2 "
                        "(random), not %d", c->order);
    if (c->threads < 1 || c->threads > 64)
        return mf::fail(MF_ERROR_INVALID_VALUE, "simt threads must be 1 to 64, not %d", c->threads);
    mf::simt::configure(mf::simt::Config{c->sm_count, c->order, c->seed, c->threads});
    return MF_SUCCESS;
}

void mf_simt_config_get(mf_simt_config *out) {
    const mf::simt::Config c = mf::simt::config();
    *out = mf_simt_config{c.sm_count, c.order, c.seed, c.threads};
}

void mf_simt_counters(uint64_t out[6]) {
    const mf::simt::Counters c = mf::simt::counters();
    const uint64_t v[6] = {c.launches, c.blocks, c.threads, c.switches, c.barriers, c.shuffles};
    std::memcpy(out, v, sizeof v);
}

size_t mf_simt_kernel_launches(char *buf, size_t capacity) {
    const std::string text = mf::simt::kernel_launches();
    if (capacity) std::snprintf(buf, capacity, "%s", text.c_str());
    return text.size();
}

int mf_simt_selftest(const char *which, char *message, size_t capacity) {
    std::string text;
    const int caught = mf::simt::selftest(which ? which : "", &text);
    if (capacity) std::snprintf(message, capacity, "%s", text.c_str());
    return caught;
}
}
