// Public entry points: backend selection, build facts, events and streams.
#include <atomic>
#include <mutex>
#include <new>
#include <unordered_map>

#include "api.hpp"

namespace mf {
namespace {
const Ops *g_ops = &host_ops;
mf_backend g_kind = MF_BACKEND_HOST;

// Whether mf_event_query may answer from a done mark (registry.hpp, Slot). Not on cuda: a
// captured graph's replay, another library's capture or a cudaEvent_t handed out by
// mf_event_raw records an event without this layer seeing it, and cudaEventQuery costs far more
// than a pin anyway. Not while the host backend's query fault is armed: each query must reach
// the backend to count.
std::atomic<bool> g_query_faults_armed{false};
std::atomic<bool> g_query_marks{true};
void update_query_marks() {
    g_query_marks.store(g_kind != MF_BACKEND_CUDA && !g_query_faults_armed.load(), std::memory_order_relaxed);
}

// cuda streams this layer created: their cudaStream_t value (the handle other libraries take,
// so it stays the handle) to their slot in stream_table(), which pins them for a call as it pins
// host streams. Never destroyed: see registry.cpp.
std::mutex &cuda_stream_mutex() {
    static std::mutex *mutex = new std::mutex;
    return *mutex;
}
std::unordered_map<uint64_t, uint64_t> &cuda_streams() {
    static auto *map = new std::unordered_map<uint64_t, uint64_t>;
    return *map;
}

// CUDA cannot cross fork(): in a child of a process that used the cuda backend every call fails
// with this, instead of hanging or crashing inside the driver.
mf_status forked() {
    return fail(MF_ERROR_UNAVAILABLE,
                "the cuda backend cannot be used in a fork()ed child (CUDA does not survive fork); "
                "use the spawn or forkserver start method");
}
constexpr auto kForked = [](auto...) { return forked(); };
// Designated initialisers leave a field that is not named null, so a new Ops entry missing here
// would crash a forked child instead of failing. The host and cuda tables name theirs too, but
// this one is easy to forget: adding a field to Ops must come here and change this count.
static_assert(sizeof(Ops) == 49 * sizeof(void *),
              "Ops changed: give forked_cuda_ops the new entry (kForked), then update this count");
const Ops forked_cuda_ops = {
    .name = "cuda (forked)",
    .init = kForked,
    .device_count = kForked,
    .device_name = kForked,
    .driver_version = kForked,
    .event_create = kForked,
    .event_destroy = kForked,
    .event_record = kForked,
    .event_query = kForked,
    .event_synchronize = kForked,
    .event_elapsed_ms = kForked,
    .event_wait = kForked,
    .stream_create = kForked,
    .stream_destroy = kForked,
    .stream_query = kForked,
    .stream_synchronize = kForked,
    .stream_wait_event = kForked,
    .stream_wait = kForked,
    .host_alloc = kForked,
    .host_free = kForked,
    .device_alloc = kForked,
    .device_free = kForked,
    .memset_async = kForked,
    .copy_async = kForked,
    .argmax = kForked,
    .resolve = kForked,
    .reference_forward = kForked,
    .launch_host_func = kForked,
    .current_device = kForked,
    .combine = kForked,
    .verify = kForked,
    .resolve_verified = kForked,
    .verify_logit_params = kForked,
    .penalties = kForked,
    .argmax_penalised = nullptr,  // the pick's pieces one by one: the first fails
    .verify_penalised = nullptr,  // the verify's pieces one by one: the first fails
    .top_logprobs = kForked,
    .top_combine = kForked,
    .select_decide = kForked,
    .grammar_mask = kForked,
    .grammar_advance = kForked,
    .capture_begin = kForked,
    .capture_status = kForked,
    .capture_end = kForked,
    .graph_launch = kForked,
    .graph_destroy = kForked,
    .capture_keep = nullptr,
    .stage_open = nullptr,  // no staging: the first piece fails, so nothing is queued
    .stage_close = nullptr,
};
}  // namespace

const Ops &ops() { return *g_ops; }
mf_backend active_kind() { return g_kind; }

void set_query_faults_armed(bool armed) {
    g_query_faults_armed.store(armed);
    update_query_marks();
}

void backend_after_fork_child() {
    if (g_kind == MF_BACKEND_CUDA) g_ops = &forked_cuda_ops;
}

uint64_t live_stream_count() { return stream_table().live_count(); }

uint64_t insert_handle(SlotTable &table, void *raw, uint32_t flags, bool owned, const char *what) noexcept {
    uint64_t handle = 0;
    try {
        handle = table.insert(raw, flags, owned);
    } catch (const std::bad_alloc &) {  // a new chunk of slots: the table could not grow
    }
    if (handle == 0) fail(MF_ERROR_OUT_OF_MEMORY, "too many live %ss, or out of memory for their table", what);
    return handle;
}

mf_status resolve_stream(mf_stream_t stream, void **raw) {
    *raw = (void *)(uintptr_t)stream;
    if (stream == 0) return MF_SUCCESS;
    uint64_t handle = stream;
    if (g_kind == MF_BACKEND_CUDA) {
        std::unique_lock<std::mutex> lock(cuda_stream_mutex());
        auto it = cuda_streams().find(stream);
        if (it == cuda_streams().end()) return MF_SUCCESS;  // foreign: CUDA's to check
        handle = it->second;
    }
    Slot *slot;
    mf_status status = stream_table().acquire(handle, &slot, "stream");
    if (status == MF_SUCCESS) *raw = slot->raw;
    return status;
}

mf_status resolve_event(mf_event_t event, Slot **slot) {
    return event_table().acquire(event, slot, "event");
}

}  // namespace mf

using namespace mf;

extern "C" {

mf_status mf_select_backend(mf_backend which) {
    return guard([&]() -> mf_status {
        const Ops *next = nullptr;
        if (which == MF_BACKEND_HOST) {
            next = &host_ops;
        } else if (which == MF_BACKEND_SIMT) {
            next = &simt_ops();
        } else if (which == MF_BACKEND_CUDA) {
#ifdef MF_HAVE_CUDA
            next = &cuda_ops;
#else
            return fail(MF_ERROR_UNAVAILABLE, "this build of metrale_feed has no CUDA backend");
#endif
        } else {
            return fail(MF_ERROR_INVALID_VALUE, "unknown backend %d", (int)which);
        }
        if (next == g_ops) return MF_SUCCESS;
        if (event_table().live_count() || live_stream_count() || alloc_live_count() || live_graph_count())
            return fail(MF_ERROR_INVALID_VALUE,
                        "cannot switch backend while events, streams, graphs or memory are live");
        mf_status status = next->init();
        if (status != MF_SUCCESS) return status;
        g_ops = next;
        g_kind = which;
        update_query_marks();
        return MF_SUCCESS;
    });
}

mf_backend mf_active_backend(void) { return g_kind; }

int mf_build_has_cuda(void) {
#ifdef MF_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int mf_build_cuda_version(void) {
#ifdef MF_CUDA_VERSION
    return MF_CUDA_VERSION;
#else
    return 0;
#endif
}

const char *mf_build_cuda_archs(void) {
#ifdef MF_CUDA_ARCHS
    return MF_CUDA_ARCHS;
#else
    return "";
#endif
}

mf_status mf_device_count(int *count) {
    return guard([&] { return count ? ops().device_count(count) : need(count, "count"); });
}
mf_status mf_current_device(int *device) {
    return guard([&] { return device ? ops().current_device(device) : need(device, "device"); });
}
mf_status mf_device_name(int device, char *buf, size_t buflen) {
    return guard([&] { return buf || !buflen ? ops().device_name(device, buf, buflen) : need(buf, "buf"); });
}
mf_status mf_driver_version(int *version) {
    return guard([&] { return version ? ops().driver_version(version) : need(version, "version"); });
}

void mf_live_counts(uint64_t *events, uint64_t *streams, uint64_t *pinned_bytes,
                    uint64_t *device_bytes) {
    guard_void([&] {
        if (events) *events = event_table().live_count();
        if (streams) *streams = live_stream_count();
        if (pinned_bytes) *pinned_bytes = alloc_live_bytes(MF_MEM_PINNED);
        if (device_bytes) *device_bytes = alloc_live_bytes(MF_MEM_DEVICE);
    });
}

/* ---- events ---- */

mf_status mf_event_create(unsigned flags, mf_event_t *out) {
    return guard([&]() -> mf_status {
        MF_RANGE("event_create");
        if (flags & ~(unsigned)(MF_EVENT_TIMING | MF_EVENT_BLOCKING | MF_EVENT_UNCOUNTED))
            return fail(MF_ERROR_INVALID_VALUE, "unknown event flags 0x%x", flags);
        if (!out) return need(out, "out");
        void *raw = nullptr;
        mf_status status = ops().event_create(flags, &raw);
        if (status != MF_SUCCESS) return status;
        *out = insert_handle(event_table(), raw, flags, true, "event");
        if (*out == 0) {
            ops().event_destroy(raw);
            return MF_ERROR_OUT_OF_MEMORY;
        }
        return MF_SUCCESS;
    });
}

mf_status mf_event_wrap(uint64_t foreign, mf_event_t *out) {
    return guard([&]() -> mf_status {
        if (g_kind != MF_BACKEND_CUDA)
            return fail(MF_ERROR_INVALID_VALUE, "a foreign event can only be wrapped on the cuda backend");
        if (foreign == 0) return fail(MF_ERROR_INVALID_VALUE, "a foreign event handle cannot be 0");
        if (!out) return need(out, "out");
        *out = insert_handle(event_table(), (void *)(uintptr_t)foreign, 0, false, "event");
        return *out ? MF_SUCCESS : MF_ERROR_OUT_OF_MEMORY;
    });
}

mf_status mf_event_record(mf_event_t event, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("event_record");
        Slot *slot;
        void *raw_stream;
        mf_status status = resolve_event(event, &slot);
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw_stream);
        if (status != MF_SUCCESS) return status;
        // In a capture, a record is an operation of the graph: it records the event at each launch.
        if (kept_for_graph(raw_stream, [event](mf_stream_t s) { return mf_event_record(event, s); }))
            return MF_SUCCESS;
        return ops().event_record(slot->raw, (mf_stream_t)(uintptr_t)raw_stream);
    });
}

mf_status mf_event_query(mf_event_t event, int *done) {
    return guard([&]() -> mf_status {
        MF_RANGE_ONLY("event_query");  // the hottest call: no PinScope, and no pin once it is done
        if (!done) return need(done, "done");
        if (g_query_marks.load(std::memory_order_relaxed) && event_table().marked_done(event)) {
            *done = 1;
            return MF_SUCCESS;
        }
        Slot *slot;
        mf_status status = event_table().pin(event, &slot, "event");
        if (status != MF_SUCCESS) return status;
        // Read before the backend's answer: a record counted after this read makes the mark stale.
        uint32_t changes = slot->changes.load(std::memory_order_acquire);
        status = ops().event_query(slot->raw, done);
        if (status == MF_SUCCESS && *done && g_query_marks.load(std::memory_order_relaxed))
            SlotTable::mark_done(slot, changes);
        event_table().unpin(slot);
        return status;
    });
}

mf_status mf_event_synchronize(mf_event_t event) {
    return guard([&]() -> mf_status {
        MF_RANGE("event_synchronize");
        Slot *slot;
        mf_status status = resolve_event(event, &slot);
        if (status != MF_SUCCESS) return status;
        return ops().event_synchronize(slot->raw);
    });
}

mf_status mf_event_synchronize_for(mf_event_t event, uint32_t timeout_us, uint64_t *mark,
                                   int *done) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!mark || !done) return need(nullptr, "mark or done");
        Slot *slot;
        mf_status status = resolve_event(event, &slot);
        if (status != MF_SUCCESS) return status;
        return ops().event_wait(slot->raw, timeout_us, mark, done);
    });
}

mf_status mf_event_elapsed_ms(mf_event_t start, mf_event_t end, float *ms) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!ms) return need(ms, "ms");
        Slot *a, *b;
        mf_status status = resolve_event(start, &a);
        if (status == MF_SUCCESS) status = resolve_event(end, &b);
        if (status != MF_SUCCESS) return status;
        if (!(a->flags & MF_EVENT_TIMING) || !(b->flags & MF_EVENT_TIMING))
            return fail(MF_ERROR_INVALID_VALUE, "elapsed time needs two events created with timing");
        return ops().event_elapsed_ms(a->raw, b->raw, ms);
    });
}

mf_status mf_event_destroy(mf_event_t event) {
    return guard([&]() -> mf_status {
        MF_RANGE("event_destroy");
        return event_table().erase(event, "event");  // a call using it meanwhile finishes first
    });
}

mf_status mf_event_raw(mf_event_t event, uint64_t *raw) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!raw) return need(raw, "raw");
        Slot *slot;
        mf_status status = resolve_event(event, &slot);
        if (status != MF_SUCCESS) return status;
        if (g_kind != MF_BACKEND_CUDA)
            return fail(MF_ERROR_INVALID_VALUE, "the host backend has no cudaEvent_t");
        *raw = (uint64_t)(uintptr_t)slot->raw;
        return MF_SUCCESS;
    });
}

/* ---- streams ---- */

mf_status mf_stream_create(unsigned flags, mf_stream_t *out) {
    return guard([&]() -> mf_status {
        MF_RANGE("stream_create");
        if (flags & ~(unsigned)MF_STREAM_NON_BLOCKING)
            return fail(MF_ERROR_INVALID_VALUE, "unknown stream flags 0x%x", flags);
        if (!out) return need(out, "out");
        void *raw = nullptr;
        mf_status status = ops().stream_create(flags, &raw);
        if (status != MF_SUCCESS) return status;
        uint64_t handle = insert_handle(stream_table(), raw, flags, true, "stream");
        if (handle == 0) {
            ops().stream_destroy(raw);
            return MF_ERROR_OUT_OF_MEMORY;
        }
        if (g_kind == MF_BACKEND_CUDA) {
            // A cudaStream_t is what other libraries take (__cuda_stream__), so it stays the handle.
            std::lock_guard<std::mutex> lock(cuda_stream_mutex());
            try {
                cuda_streams()[(mf_stream_t)(uintptr_t)raw] = handle;
            } catch (...) {
                stream_table().erase(handle, "stream");  // reclaimed there: a failed create leaks nothing
                throw;
            }
            handle = (mf_stream_t)(uintptr_t)raw;
        }
        *out = handle;
        return MF_SUCCESS;
    });
}

mf_status mf_stream_check(mf_stream_t stream) {
    return guard([&]() -> mf_status {
        PinScope pins;
        void *raw;
        return resolve_stream(stream, &raw);
    });
}

mf_status mf_stream_query(mf_stream_t stream, int *idle) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!idle) return need(idle, "idle");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS) status = refuse_in_capture(raw, "stream_query", false);
        return status != MF_SUCCESS ? status : ops().stream_query(raw, idle);
    });
}

mf_status mf_stream_synchronize(mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("stream_synchronize");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS) status = refuse_in_capture(raw, "stream_synchronize", false);
        return status != MF_SUCCESS ? status : ops().stream_synchronize(raw);
    });
}

mf_status mf_stream_synchronize_for(mf_stream_t stream, uint32_t timeout_us, uint64_t *mark,
                                    int *done) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!mark || !done) return need(nullptr, "mark or done");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS && *mark == 0) status = refuse_in_capture(raw, "stream_synchronize", false);
        return status != MF_SUCCESS ? status : ops().stream_wait(raw, timeout_us, mark, done);
    });
}

mf_status mf_stream_wait_event(mf_stream_t stream, mf_event_t event) {
    return guard([&]() -> mf_status {
        PinScope pins;
        Slot *slot;
        void *raw;
        mf_status status = resolve_event(event, &slot);
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        // Kept simple: a graph has no cross-stream waits (docs/graphs.md).
        if (status == MF_SUCCESS) status = refuse_in_capture(raw, "stream_wait_event", false);
        return status != MF_SUCCESS ? status : ops().stream_wait_event(raw, slot->raw);
    });
}

mf_status mf_launch_host_func(mf_stream_t stream, mf_host_fn fn, void *data) {
    return guard([&]() -> mf_status {
        MF_RANGE("launch_host_func");
        if (!fn) return fail(MF_ERROR_INVALID_VALUE, "launch_host_func: fn is a null function");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        if (status != MF_SUCCESS) return status;
        // In a capture, a host function is an operation of the graph that runs at each launch with
        // the same data, as CUDA's host node (which the cuda backend's cudaLaunchHostFunc becomes):
        // the caller keeps `data` alive as long as the graph and its queued launches.
        if (kept_for_graph(raw, [fn, data](mf_stream_t s) { return mf_launch_host_func(s, fn, data); }))
            return MF_SUCCESS;
        return ops().launch_host_func(fn, data, raw);
    });
}

mf_status mf_stream_destroy(mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("stream_destroy");
        if (stream == 0) return fail(MF_ERROR_INVALID_VALUE, "the default stream cannot be destroyed");
        uint64_t handle = stream;
        if (g_kind == MF_BACKEND_CUDA) {
            // Only a stream of ours is asked about its capture: a stale cudaStream_t must not reach
            // the runtime.
            std::lock_guard<std::mutex> lock(cuda_stream_mutex());
            if (!cuda_streams().count(stream))
                return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed stream 0x%llx",
                            (unsigned long long)stream);
        }
        {
            void *raw;  // a capturing stream is ended (mf_graph_end) before it goes
            mf_status status = resolve_stream(stream, &raw);
            if (status == MF_SUCCESS) status = refuse_in_capture(raw, "stream_destroy", false);
            if (status != MF_SUCCESS) return status;
        }
        if (g_kind == MF_BACKEND_CUDA) {
            std::lock_guard<std::mutex> lock(cuda_stream_mutex());
            auto it = cuda_streams().find(stream);
            if (it == cuda_streams().end())
                return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed stream 0x%llx",
                            (unsigned long long)stream);
            handle = it->second;
            cuda_streams().erase(it);
        }
        return stream_table().erase(handle, "stream");  // a call using it meanwhile finishes first
    });
}

}  // extern "C"
