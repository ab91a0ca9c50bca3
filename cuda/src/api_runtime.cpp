// Public entry points: backend selection, build facts, events and streams.
#include <atomic>
#include <mutex>
#include <unordered_set>

#include "api.hpp"

namespace mf {
namespace {
const Ops *g_ops = &host_ops;
mf_backend g_kind = MF_BACKEND_HOST;

std::mutex g_stream_mutex;
std::unordered_set<uint64_t> g_streams;  // streams this layer created, by handle
}  // namespace

const Ops &ops() { return *g_ops; }
mf_backend active_kind() { return g_kind; }

uint64_t live_stream_count() {
    std::lock_guard<std::mutex> lock(g_stream_mutex);
    return g_streams.size();
}

mf_status resolve_stream(mf_stream_t stream, void **raw) {
    *raw = (void *)(uintptr_t)stream;
    if (stream == 0 || g_kind == MF_BACKEND_CUDA) return MF_SUCCESS;
    std::lock_guard<std::mutex> lock(g_stream_mutex);
    if (g_streams.count(stream)) return MF_SUCCESS;
    return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed stream 0x%llx",
                (unsigned long long)stream);
}

mf_status resolve_event(mf_event_t event, Slot **slot) {
    *slot = event_table().find(event);
    if (*slot) return MF_SUCCESS;
    return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed event 0x%llx",
                (unsigned long long)event);
}

}  // namespace mf

using namespace mf;

extern "C" {

mf_status mf_select_backend(mf_backend which) {
    const Ops *next = nullptr;
    if (which == MF_BACKEND_HOST) {
        next = &host_ops;
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
    if (event_table().live_count() || live_stream_count() || alloc_live_count())
        return fail(MF_ERROR_INVALID_VALUE, "cannot switch backend while events, streams or memory are live");
    mf_status status = next->init();
    if (status != MF_SUCCESS) return status;
    g_ops = next;
    g_kind = which;
    return MF_SUCCESS;
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

mf_status mf_device_count(int *count) { return ops().device_count(count); }
mf_status mf_current_device(int *device) { return ops().current_device(device); }
mf_status mf_device_name(int device, char *buf, size_t buflen) {
    return ops().device_name(device, buf, buflen);
}
mf_status mf_driver_version(int *version) { return ops().driver_version(version); }

void mf_live_counts(uint64_t *events, uint64_t *streams, uint64_t *pinned_bytes,
                    uint64_t *device_bytes) {
    if (events) *events = event_table().live_count();
    if (streams) *streams = live_stream_count();
    if (pinned_bytes) *pinned_bytes = alloc_live_bytes(MF_MEM_PINNED);
    if (device_bytes) *device_bytes = alloc_live_bytes(MF_MEM_DEVICE);
}

/* ---- events ---- */

mf_status mf_event_create(unsigned flags, mf_event_t *out) {
    MF_RANGE("event_create");
    if (flags & ~(unsigned)(MF_EVENT_TIMING | MF_EVENT_BLOCKING | MF_EVENT_UNCOUNTED))
        return fail(MF_ERROR_INVALID_VALUE, "unknown event flags 0x%x", flags);
    void *raw = nullptr;
    mf_status status = ops().event_create(flags, &raw);
    if (status != MF_SUCCESS) return status;
    *out = event_table().insert(raw, flags, true);
    if (*out == 0) {
        ops().event_destroy(raw);
        return fail(MF_ERROR_OUT_OF_MEMORY, "too many live events");
    }
    return MF_SUCCESS;
}

mf_status mf_event_wrap(uint64_t foreign, mf_event_t *out) {
    if (g_kind != MF_BACKEND_CUDA)
        return fail(MF_ERROR_INVALID_VALUE, "a foreign event can only be wrapped on the cuda backend");
    if (foreign == 0) return fail(MF_ERROR_INVALID_VALUE, "a foreign event handle cannot be 0");
    *out = event_table().insert((void *)(uintptr_t)foreign, 0, false);
    return *out ? MF_SUCCESS : fail(MF_ERROR_OUT_OF_MEMORY, "too many live events");
}

mf_status mf_event_record(mf_event_t event, mf_stream_t stream) {
    MF_RANGE("event_record");
    Slot *slot;
    void *raw_stream;
    mf_status status = resolve_event(event, &slot);
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw_stream);
    if (status != MF_SUCCESS) return status;
    return ops().event_record(slot->raw, (mf_stream_t)(uintptr_t)raw_stream);
}

mf_status mf_event_query(mf_event_t event, int *done) {
    MF_RANGE("event_query");
    Slot *slot;
    mf_status status = resolve_event(event, &slot);
    if (status != MF_SUCCESS) return status;
    return ops().event_query(slot->raw, done);
}

mf_status mf_event_synchronize(mf_event_t event) {
    MF_RANGE("event_synchronize");
    Slot *slot;
    mf_status status = resolve_event(event, &slot);
    if (status != MF_SUCCESS) return status;
    return ops().event_synchronize(slot->raw);
}

mf_status mf_event_elapsed_ms(mf_event_t start, mf_event_t end, float *ms) {
    Slot *a, *b;
    mf_status status = resolve_event(start, &a);
    if (status == MF_SUCCESS) status = resolve_event(end, &b);
    if (status != MF_SUCCESS) return status;
    if (!(a->flags & MF_EVENT_TIMING) || !(b->flags & MF_EVENT_TIMING))
        return fail(MF_ERROR_INVALID_VALUE, "elapsed time needs two events created with timing");
    return ops().event_elapsed_ms(a->raw, b->raw, ms);
}

mf_status mf_event_destroy(mf_event_t event) {
    MF_RANGE("event_destroy");
    Slot slot;
    if (!event_table().erase(event, &slot))
        return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed event 0x%llx",
                    (unsigned long long)event);
    return slot.owned ? ops().event_destroy(slot.raw) : MF_SUCCESS;
}

mf_status mf_event_raw(mf_event_t event, uint64_t *raw) {
    Slot *slot;
    mf_status status = resolve_event(event, &slot);
    if (status != MF_SUCCESS) return status;
    if (g_kind != MF_BACKEND_CUDA)
        return fail(MF_ERROR_INVALID_VALUE, "the host backend has no cudaEvent_t");
    *raw = (uint64_t)(uintptr_t)slot->raw;
    return MF_SUCCESS;
}

/* ---- streams ---- */

mf_status mf_stream_create(unsigned flags, mf_stream_t *out) {
    MF_RANGE("stream_create");
    if (flags & ~(unsigned)MF_STREAM_NON_BLOCKING)
        return fail(MF_ERROR_INVALID_VALUE, "unknown stream flags 0x%x", flags);
    void *raw = nullptr;
    mf_status status = ops().stream_create(flags, &raw);
    if (status != MF_SUCCESS) return status;
    std::lock_guard<std::mutex> lock(g_stream_mutex);
    *out = (mf_stream_t)(uintptr_t)raw;
    g_streams.insert(*out);
    return MF_SUCCESS;
}

mf_status mf_stream_check(mf_stream_t stream) {
    void *raw;
    return resolve_stream(stream, &raw);
}

mf_status mf_stream_query(mf_stream_t stream, int *idle) {
    void *raw;
    mf_status status = resolve_stream(stream, &raw);
    return status != MF_SUCCESS ? status : ops().stream_query(raw, idle);
}

mf_status mf_stream_synchronize(mf_stream_t stream) {
    MF_RANGE("stream_synchronize");
    void *raw;
    mf_status status = resolve_stream(stream, &raw);
    return status != MF_SUCCESS ? status : ops().stream_synchronize(raw);
}

mf_status mf_stream_wait_event(mf_stream_t stream, mf_event_t event) {
    Slot *slot;
    void *raw;
    mf_status status = resolve_event(event, &slot);
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    return status != MF_SUCCESS ? status : ops().stream_wait_event(raw, slot->raw);
}

mf_status mf_launch_host_func(mf_stream_t stream, mf_host_fn fn, void *data) {
    MF_RANGE("launch_host_func");
    if (!fn) return fail(MF_ERROR_INVALID_VALUE, "launch_host_func: fn is a null function");
    void *raw;
    mf_status status = resolve_stream(stream, &raw);
    return status != MF_SUCCESS ? status : ops().launch_host_func(fn, data, raw);
}

mf_status mf_stream_destroy(mf_stream_t stream) {
    MF_RANGE("stream_destroy");
    if (stream == 0) return fail(MF_ERROR_INVALID_VALUE, "the default stream cannot be destroyed");
    {
        std::lock_guard<std::mutex> lock(g_stream_mutex);
        if (!g_streams.erase(stream))
            return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed stream 0x%llx",
                        (unsigned long long)stream);
    }
    return ops().stream_destroy((void *)(uintptr_t)stream);
}

}  // extern "C"
