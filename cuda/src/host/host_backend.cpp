// The host backend's table: CUDA's asynchronous runtime semantics on CPU threads, with
// deterministic fault knobs so races and failures can be provoked on purpose.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <system_error>

#include "../registry.hpp"

#include "../api.hpp"
#include "graph.hpp"
#include "kernels.hpp"
#include "queue.hpp"

namespace mf::host {
namespace {

uint32_t lag_from_env() {
    const char *value = std::getenv("METRALE_FEED_HOST_LAG_US");
    return value ? (uint32_t)std::strtoul(value, nullptr, 10) : 0u;
}

std::atomic<uint32_t> g_lag_us{lag_from_env()};
std::atomic<uint64_t> g_fail_query{0}, g_fail_alloc{0}, g_fail_copy{0}, g_fail_sync{0},
    g_fail_event_create{0};

// A countdown knob: 0 is off; otherwise this call fires when the count reaches 1.
bool fires(std::atomic<uint64_t> &knob) {
    uint64_t left = knob.load(std::memory_order_relaxed);
    while (left != 0) {
        if (knob.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) return left == 1;
    }
    return false;
}

mf_status injected(const char *what) {
    return fail(MF_ERROR_INJECTED, "%s: fault injected by the host backend", what);
}

// A host function waiting for work queued behind itself on its own stream would wait forever.
mf_status waits_for_itself(const char *what) {
    return fail(MF_ERROR_INVALID_VALUE,
                "%s from a host function on the stream it waits for: that work is queued behind the "
                "host function itself, so the wait could never end (CUDA forbids CUDA calls in a "
                "host function; record an event and wait for it from another thread)", what);
}

Event *as_event(void *raw) { return static_cast<Event *>(raw); }

mf_status init() { return MF_SUCCESS; }
mf_status device_count(int *count) {
    *count = 0;
    return MF_SUCCESS;
}
mf_status device_name(int, char *buf, size_t buflen) {
    if (buflen) std::snprintf(buf, buflen, "host");
    return MF_SUCCESS;
}
mf_status driver_version(int *version) {
    *version = 0;
    return MF_SUCCESS;
}

mf_status event_create(unsigned flags, void **raw) {
    if (fires(g_fail_event_create)) return injected("event_create");
    *raw = new (std::nothrow) Event(flags);
    if (!*raw) return fail(MF_ERROR_OUT_OF_MEMORY, "event_create: out of memory");
    return MF_SUCCESS;
}

mf_status event_destroy(void *raw) {
    as_event(raw)->release();  // a record still queued holds its own reference
    return MF_SUCCESS;
}

// A staged record discarded before it was published (Staging): the event is as before.
void take_back_record(void *raw, uint64_t ticket) {
    Event *event = as_event(raw);
    event->unrecord(ticket);
    event->release();
}

mf_status event_record(void *raw, mf_stream_t stream) {
    Event *event = as_event(raw);
    Stream *on = stream_of((void *)(uintptr_t)stream);
    uint64_t ticket = event->record(on);
    event->retain();
    try {
        on->enqueue("event_record", [event, ticket] {
            event->reach(ticket, now_ns());
            event->release();
        }, Undo{take_back_record, event, ticket});
    } catch (...) {  // out of memory: nothing queued, so the record is taken back (api.hpp, guard)
        event->unrecord(ticket);
        event->release();
        throw;
    }
    return MF_SUCCESS;
}

mf_status event_query(void *raw, int *done) {
    Event *event = as_event(raw);
    if (!(event->flags & MF_EVENT_UNCOUNTED) && fires(g_fail_query)) return injected("event_query");
    *done = event->done();
    return MF_SUCCESS;
}

mf_status event_synchronize(void *raw) {
    if (fires(g_fail_sync)) return injected("event_synchronize");
    Event *event = as_event(raw);
    if (event->latest_pending_on(current_stream())) return waits_for_itself("event_synchronize");
    event->retain();  // a destroy from another thread during the wait must not free it under us
    event->wait(event->recorded.load(std::memory_order_acquire));
    event->release();
    return MF_SUCCESS;
}

mf_status event_wait(void *raw, uint32_t timeout_us, uint64_t *mark, int *done) {
    Event *event = as_event(raw);  // pinned by the caller's lookup: a destroy meanwhile waits for us
    if (*mark == 0) {
        if (fires(g_fail_sync)) return injected("event_synchronize");
        if (event->latest_pending_on(current_stream())) return waits_for_itself("event_synchronize");
        *mark = event->recorded.load(std::memory_order_acquire) + 1;  // + 1: never 0 once taken
    }
    uint64_t ticket = *mark - 1;
    *done = ticket == 0 || event->wait_for(ticket, timeout_us);
    return MF_SUCCESS;
}

mf_status event_elapsed_ms(void *start, void *end, float *ms) {
    Event *a = as_event(start), *b = as_event(end);
    if (!a->recorded.load() || !b->recorded.load())
        return fail(MF_ERROR_INVALID_VALUE, "elapsed time of an event that was never recorded");
    if (!a->done() || !b->done())
        return fail(MF_ERROR_INVALID_VALUE, "elapsed time of an event that has not completed yet");
    *ms = (float)((b->stamp_ns.load() - a->stamp_ns.load()) / 1e6);
    return MF_SUCCESS;
}

mf_status stream_create(unsigned flags, void **raw) {
    try {
        *raw = new Stream(!(flags & MF_STREAM_NON_BLOCKING));
    } catch (const std::system_error &error) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "Stream(): the OS refused a worker thread (%s)", error.what());
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "Stream(): out of memory");
    }
    return MF_SUCCESS;
}
mf_status stream_destroy(void *raw) {
    stream_of(raw)->close();
    return MF_SUCCESS;
}
mf_status stream_query(void *raw, int *idle) {
    *idle = stream_of(raw)->idle();
    return MF_SUCCESS;
}
mf_status stream_synchronize(void *raw) {
    if (fires(g_fail_sync)) return injected("stream_synchronize");
    Stream *stream = stream_of(raw);
    if (stream == current_stream()) return waits_for_itself("stream_synchronize");
    stream->retain();  // as event_synchronize: a close meanwhile frees it only after we are done
    stream->synchronize();
    stream->release();
    return MF_SUCCESS;
}
mf_status stream_wait(void *raw, uint32_t timeout_us, uint64_t *mark, int *done) {
    Stream *stream = stream_of(raw);
    if (*mark == 0) {
        if (fires(g_fail_sync)) return injected("stream_synchronize");
        if (stream == current_stream()) return waits_for_itself("stream_synchronize");
        *mark = stream->enqueued() + 1;  // the work queued when the wait began
    }
    *done = stream->wait_for(*mark - 1, timeout_us);
    return MF_SUCCESS;
}

void take_back_wait(void *raw, uint64_t) { as_event(raw)->release(); }

mf_status stream_wait_event(void *raw, void *event_raw) {
    Event *event = as_event(event_raw);
    uint64_t ticket = event->recorded.load(std::memory_order_acquire);
    Stream *stream = stream_of(raw);
    event->retain();
    try {
        stream->enqueue("stream_wait_event", [event, ticket] {
            event->wait(ticket);
            event->release();
        }, Undo{take_back_wait, event, 0});
    } catch (...) {  // out of memory: nothing queued
        event->release();
        throw;
    }
    return MF_SUCCESS;
}

// A call of several queued pieces (api.hpp, Staged): staged on this thread, published at once.
void *stage_open(void *stream) { return new Staging(stream_of(stream)); }

mf_status stage_close(void *raw, mf_status status) {
    std::unique_ptr<Staging> staging(static_cast<Staging *>(raw));  // a discard, unless committed
    if (status != MF_SUCCESS) return status;
    try {
        staging->commit();
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "out of memory while queueing the call: nothing of it was queued");
    }
    return MF_SUCCESS;
}

mf_status aligned_zeroed(size_t nbytes, size_t alignment, void **out, const char *what) {
    if (fires(g_fail_alloc)) return injected(what);
    if (nbytes > SIZE_MAX - alignment) return fail(MF_ERROR_OUT_OF_MEMORY, "%s of %zu bytes is too large", what, nbytes);
    size_t rounded = (nbytes + alignment - 1) / alignment * alignment;
    *out = std::aligned_alloc(alignment, rounded);
    if (!*out) return fail(MF_ERROR_OUT_OF_MEMORY, "%s of %zu bytes failed", what, nbytes);
    std::memset(*out, 0, rounded);
    return MF_SUCCESS;
}

mf_status host_alloc(size_t nbytes, unsigned, void **out) {
    return aligned_zeroed(nbytes, 4096, out, "alloc_host_pinned");
}
mf_status device_alloc(size_t nbytes, void **out) {
    return aligned_zeroed(nbytes, 256, out, "device_alloc");
}
// A free never waits (docs/lifetimes.md, rule 5): it notes where each live stream's queue
// ends now, and the memory goes once every stream has passed that point, freed by the worker
// that passes last (or at once when all are idle). cudaFree waits for the whole device instead;
// waiting here would deadlock a free made by a host function (its own stream cannot pass it)
// and stall a free behind unrelated work. Work queued after the free cannot name the memory:
// the ledger refused it from the moment of the free.
struct Release {
    std::atomic<unsigned> left{1};  // the markers still queued, plus the freeing call's own
    void *ptr;
    explicit Release(void *p) : ptr(p) {}
    void passed() {
        if (left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
        alloc_released(ptr);
        std::free(ptr);
        delete this;
    }
};

mf_status free_when_passed(void *ptr) {
    Release *release = new (std::nothrow) Release(ptr);
    if (!release) {  // out of memory: the old way, waiting for every stream
        synchronize_all();
        alloc_released(ptr);
        std::free(ptr);
        return MF_SUCCESS;
    }
    std::vector<Stream *> streams;
    try {
        streams = retain_live_streams();
    } catch (const std::bad_alloc &) {
        synchronize_all();
    }
    for (Stream *stream : streams) {
        release->left.fetch_add(1, std::memory_order_relaxed);
        bool queued = false;
        try {
            queued = stream->enqueue_if_busy("deferred_free", [release] { release->passed(); });
        } catch (const std::bad_alloc &) {
            stream->synchronize();  // out of memory only: may wait (never for an idle stream)
        }
        if (!queued) release->left.fetch_sub(1, std::memory_order_relaxed);
        stream->release();
    }
    release->passed();
    return MF_SUCCESS;
}

mf_status memset_async(void *dev, int value, size_t nbytes, void *stream) {
    stream_of(stream)->enqueue("memset", [dev, value, nbytes] { std::memset(dev, value, nbytes); });
    return MF_SUCCESS;
}

mf_status copy_async(void *dst, const void *src, size_t nbytes, CopyKind kind, void *stream) {
    if (fires(g_fail_copy)) return injected("copy_async");
    static const char *const names[] = {"copy_d2h", "copy_h2d", "copy_d2d"};
    if (kind == kH2D && alloc_lookup(src, nullptr) != MF_MEM_PINNED) {
        // CUDA has consumed pageable source memory when cudaMemcpyAsync returns (it stages it),
        // so a caller may reuse it at once: stage it here too.
        std::shared_ptr<unsigned char[]> staged(new (std::nothrow) unsigned char[nbytes]);
        if (!staged) return fail(MF_ERROR_OUT_OF_MEMORY, "copy_h2d_async: staging %zu bytes failed", nbytes);
        std::memcpy(staged.get(), src, nbytes);
        stream_of(stream)->enqueue(names[kind], [dst, staged, nbytes] { std::memcpy(dst, staged.get(), nbytes); });
        return MF_SUCCESS;
    }
    stream_of(stream)->enqueue(names[kind], [dst, src, nbytes] { std::memcpy(dst, src, nbytes); });
    return MF_SUCCESS;
}

mf_status argmax(const mf_argmax_args *args, void *stream) {
    ArgmaxJob job(*args);  // host masks and params are copied here: the caller may reuse them
    stream_of(stream)->enqueue("argmax", [job = std::move(job)] { run_argmax(job); });
    return MF_SUCCESS;
}

mf_status resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                  uint32_t *out, bool sources_on_device, void *stream) {
    std::vector<uint32_t> words;  // host sources are consumed now; device ones read when it runs
    if (!sources_on_device) words.assign(sources, sources + n);
    stream_of(stream)->enqueue("resolve_feed", [words = std::move(words), sources, n, cells, prev_rows, out] {
        run_resolve(words.empty() ? sources : words.data(), n, cells, prev_rows, out);
    });
    return MF_SUCCESS;
}

mf_status reference_forward(const mf_reference_args *args, void *stream) {
    mf_reference_args copy = *args;
    stream_of(stream)->enqueue("reference_forward", [copy] { run_reference_forward(copy); });
    return MF_SUCCESS;
}

mf_status current_device(int *device) {
    *device = 0;
    return MF_SUCCESS;
}

mf_status launch_host_func(mf_host_fn fn, void *data, void *stream) {
    stream_of(stream)->enqueue("host_func", [fn, data] { fn(data); });
    return MF_SUCCESS;
}

mf_status combine(const mf_combine_args *args, void *stream) {
    CombineJob job(*args);  // host params copied: the caller may reuse them
    stream_of(stream)->enqueue("combine_partials", [job = std::move(job)] { run_combine(job); });
    return MF_SUCCESS;
}

mf_status verify(const mf_verify_args *args, void *stream) {
    try {  // no C++ exception crosses the C ABI: copying the host inputs may run out of memory
        VerifyJob job(*args);  // host drafts, masks and params are copied here: the caller may reuse them
        stream_of(stream)->enqueue("verify", [job = std::move(job)] { run_verify(job); });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "verify_to_feed: out of host memory for its inputs");
    }
    return MF_SUCCESS;
}

mf_status resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                           uint32_t *out_advance, void *stream) {
    stream_of(stream)->enqueue("resolve_verified", [=] { run_resolve_verified(cells, rows, k, out_ids, out_advance); });
    return MF_SUCCESS;
}

mf_status verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                              mf_sampling_params *out, void *stream) {
    stream_of(stream)->enqueue("verify_logit_params", [=] { run_verify_logit_params(params, advance, rows, k, out); });
    return MF_SUCCESS;
}

mf_status penalties(const mf_penalty_args *args, bool update, void *stream) {
    PenaltyJob job(*args, update);
    stream_of(stream)->enqueue(update ? "penalties_update" : "penalties_apply",
                               [job = std::move(job)] { run_penalties(job); });
    return MF_SUCCESS;
}

mf_status argmax_penalised(const mf_argmax_args *args, const mf_penalty_args *apply, void *stream) {
    ArgmaxJob job(*args, apply);  // host masks, params and slots are copied here
    stream_of(stream)->enqueue("argmax", [job = std::move(job)] { run_argmax(job); });
    return MF_SUCCESS;
}

mf_status verify_penalised(const mf_verify_args *args, const mf_penalty_args *apply, void *stream) {
    try {  // no C++ exception crosses the C ABI: copying the host inputs may run out of memory
        VerifyJob job(*args, apply);  // host masks, params and slots are copied here
        stream_of(stream)->enqueue("verify", [job = std::move(job)] { run_verify(job); });
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "verify_to_feed: out of host memory for its inputs");
    }
    return MF_SUCCESS;
}

mf_status top_logprobs(const mf_top_logprobs_args *args, void *stream) {
    stream_of(stream)->enqueue("top_logprobs", [a = *args] { run_top_logprobs(a); });
    return MF_SUCCESS;
}

mf_status select_decide(const mf_select_decide_args *args, void *stream) {
    stream_of(stream)->enqueue("select_decide", [a = *args] { run_select_decide(a); });
    return MF_SUCCESS;
}

mf_status top_combine(const mf_top_combine_args *args, void *stream) {
    stream_of(stream)->enqueue("top_logprobs_combine", [a = *args] { run_top_combine(a); });
    return MF_SUCCESS;
}

mf_status grammar_mask(const mf_grammar_mask_args *args, void *stream) {
    stream_of(stream)->enqueue("grammar_mask", [a = *args] { run_grammar_mask(a); });
    return MF_SUCCESS;
}

mf_status grammar_advance(const mf_grammar_advance_args *args, void *stream) {
    stream_of(stream)->enqueue("grammar_advance", [a = *args] { run_grammar_advance(a); });
    return MF_SUCCESS;
}

}  // namespace

uint32_t lag_us() { return g_lag_us.load(std::memory_order_relaxed); }

}  // namespace mf::host

namespace mf {
using namespace host;
const Ops host_ops = {
    .name = "host",
    .init = init,
    .device_count = device_count,
    .device_name = device_name,
    .driver_version = driver_version,
    .event_create = event_create,
    .event_destroy = event_destroy,
    .event_record = event_record,
    .event_query = event_query,
    .event_synchronize = event_synchronize,
    .event_elapsed_ms = event_elapsed_ms,
    .event_wait = event_wait,
    .stream_create = stream_create,
    .stream_destroy = stream_destroy,
    .stream_query = stream_query,
    .stream_synchronize = stream_synchronize,
    .stream_wait_event = stream_wait_event,
    .stream_wait = stream_wait,
    .host_alloc = host_alloc,
    .host_free = free_when_passed,
    .device_alloc = device_alloc,
    .device_free = free_when_passed,
    .memset_async = memset_async,
    .copy_async = copy_async,
    .argmax = argmax,
    .resolve = resolve,
    .reference_forward = reference_forward,
    .launch_host_func = launch_host_func,
    .current_device = current_device,
    .combine = combine,
    .verify = verify,
    .resolve_verified = resolve_verified,
    .verify_logit_params = verify_logit_params,
    .penalties = penalties,
    .argmax_penalised = argmax_penalised,
    .verify_penalised = verify_penalised,
    .top_logprobs = top_logprobs,
    .top_combine = top_combine,
    .select_decide = select_decide,
    .grammar_mask = grammar_mask,
    .grammar_advance = grammar_advance,
    .capture_begin = capture_begin,
    .capture_status = capture_status,
    .capture_end = capture_end,
    .graph_launch = graph_launch,
    .graph_destroy = graph_destroy,
    .capture_keep = capture_keep,
    .stage_open = stage_open,
    .stage_close = stage_close,
};
}  // namespace mf

extern "C" {
void mf_host_configure(const mf_host_faults *faults) {
    using namespace mf::host;
    static const mf_host_faults off{};
    if (!faults) faults = &off;  // NULL: every knob off
    g_lag_us.store(faults->lag_us);
    g_fail_query.store(faults->fail_event_query_at);
    // Armed until the next configure, even once it has fired: queries of completed events then
    // reach this backend instead of answering from their done marks (mf_event_query).
    mf::set_query_faults_armed(faults->fail_event_query_at != 0);
    g_fail_alloc.store(faults->fail_alloc_at);
    g_fail_copy.store(faults->fail_copy_at);
    g_fail_sync.store(faults->fail_synchronize_at);
    g_fail_event_create.store(faults->fail_event_create_at);
}

void mf_host_set_kernel_threads(unsigned threads) { mf::host::set_kernel_threads(threads); }
unsigned mf_host_kernel_threads(void) {  // the first use makes the pool, which may throw
    return mf::guard_value(1u, [] { return mf::host::kernel_threads(); });
}
const char *mf_host_argmax_isa(int force_portable) {
    if (force_portable >= 0) mf::host::use_portable_argmax(force_portable != 0);
    return mf::host::argmax_isa();
}

void mf_host_faults_get(mf_host_faults *out) {
    using namespace mf::host;
    if (!out) return;
    out->lag_us = g_lag_us.load();
    out->fail_event_query_at = g_fail_query.load();
    out->fail_alloc_at = g_fail_alloc.load();
    out->fail_copy_at = g_fail_copy.load();
    out->fail_synchronize_at = g_fail_sync.load();
    out->fail_event_create_at = g_fail_event_create.load();
}
}
