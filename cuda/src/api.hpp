// Shared by the public entry points (api_*.cpp): the active backend, stream resolution, NVTX.
#pragma once

#include "backend.hpp"
#include "registry.hpp"

namespace mf {

// No C++ exception may cross the C ABI (a C caller, or Python's, cannot catch one; it would end
// the process in std::terminate). Every extern "C" entry point runs its body through guard(), so
// the one mapping below decides what a throw becomes: out of memory (std::bad_alloc, a container's
// length_error, the OS refusing a thread) is MF_ERROR_OUT_OF_MEMORY, anything else
// MF_ERROR_INTERNAL, each with the last-error message set. try costs nothing until a throw.
// Entry points must leave nothing half-done when a throw unwinds them: queue nothing, leak
// nothing (the backends allocate before they publish, or roll back).
mf_status exception_status() noexcept;  // error.cpp; only inside a catch handler
template <class Body>
mf_status guard(Body &&body) noexcept {
    try {
        return body();
    } catch (...) {
        return exception_status();
    }
}
// For entry points without a status (counts, lookups, setters): `fallback` on a throw, the
// last-error message says why.
template <class R, class Body>
R guard_value(R fallback, Body &&body) noexcept {
    try {
        return body();
    } catch (...) {
        exception_status();
        return fallback;
    }
}
template <class Body>
void guard_void(Body &&body) noexcept {
    try {
        body();
    } catch (...) {
        exception_status();
    }
}
// MF_ERROR_INVALID_VALUE unless `ptr` is set: for the pointers an entry point writes or reads.
mf_status need(const void *ptr, const char *what);

const Ops &ops();
mf_backend active_kind();
// The host backend's query fault knob is armed (mf_host_configure): every query then reaches the
// backend, none answers from a done mark (registry.hpp, Slot).
void set_query_faults_armed(bool armed);

// A stream handle to the backend's raw value. host: must be a live, generation-checked stream of
// ours (or 0); cuda: any value is taken as a cudaStream_t, since CUDA cannot check a foreign one.
// Both resolvers pin what they return until the caller's PinScope ends (MF_RANGE opens one), so
// a destroy from another thread meanwhile cannot free it.
mf_status resolve_stream(mf_stream_t stream, void **raw);
// A live event's slot, or MF_ERROR_INVALID_HANDLE with the message set.
mf_status resolve_event(mf_event_t event, Slot **slot);
uint64_t live_stream_count();
// A new handle for `raw` in `table`, or 0 with MF_ERROR_OUT_OF_MEMORY's message set (the table is
// full, or could not grow): the caller then destroys `raw`, so a failed create leaks nothing.
uint64_t insert_handle(SlotTable &table, void *raw, uint32_t flags, bool owned, const char *what) noexcept;

// Device memory the active backend may touch: an allocation of ours with `nbytes` left, or, on
// cuda only, a foreign pointer taken as is.
mf_status check_device_range(const void *ptr, size_t nbytes, const char *what);
// Host memory a copy writes or reads: pinned memory of ours is range-checked, other host memory
// is the caller's; a device allocation of ours is refused.
mf_status check_host_range(const void *ptr, size_t nbytes, const char *what);

// One byte range a call reads or writes, for refuse_overlaps.
struct Span {
    const void *ptr;
    size_t nbytes;
    const char *what;
    bool written;
};
// MF_ERROR_INVALID_VALUE, naming both, when a span the call writes overlaps another of its spans:
// two outputs would race, and an output over an input would be read back as something else (ids
// as float bits). Null and empty spans take no part. Called after the range checks, before
// anything is queued.
mf_status refuse_overlaps(const Span *spans, size_t n);
template <size_t N>
mf_status refuse_overlaps(const Span (&spans)[N]) {
    return refuse_overlaps(spans, N);
}

// A call made of several queued pieces (a kernel, the copies of its results, an event record)
// queues all of them or none: on the host backend they are staged and published in one step by
// close(MF_SUCCESS); close with a failure, or a throw that unwinds past it, takes back what was
// staged (docs/host-backend.md, "A refused call queued nothing"). On cuda (no staging) nothing of
// ours can fail between the pieces. Opened after every check and just before the first piece.
class Staged {
public:
    // several: the call has more than one piece (a lone piece is queued whole or not at all,
    // so it needs no staging, and the hot single-kernel calls pay nothing).
    Staged(void *raw, bool several) : staging_(several && ops().stage_open ? ops().stage_open(raw) : nullptr) {}
    ~Staged() {
        if (staging_) ops().stage_close(staging_, MF_ERROR_INTERNAL);  // a throw unwound: take back
    }
    Staged(const Staged &) = delete;
    Staged &operator=(const Staged &) = delete;
    // The call's status after its last piece; the status to return.
    mf_status close(mf_status status) {
        void *staging = staging_;
        staging_ = nullptr;
        return staging ? ops().stage_close(staging, status) : status;
    }

private:
    void *staging_;
};

// Graph captures (api_graph.cpp). Each asks the backend whether `raw` (a resolved stream) is
// capturing, which costs a lock-free check on the host and one runtime query on cuda, so callers
// ask only for operations that have host-side inputs.
// MF_ERROR_CAPTURE (message names `what`) when `raw` is capturing: a replay could not see new
// values of a host-side input (host_inputs), nor may a capturing stream be waited on.
mf_status refuse_in_capture(void *raw, const char *what, bool host_inputs);
// During a capture, host memory a copy reads or writes must be pinned memory of this layer (a
// graph's copy runs at each launch; pageable memory cannot be copied asynchronously).
mf_status capture_host_check(void *raw, const void *ptr, const char *what);
// Host backend: when `raw` is capturing, keeps the call (`replay`, re-issued on the launch stream)
// for the graph and returns true: the caller then queues nothing.
bool kept_for_graph(void *raw, Replay &&replay);
uint64_t live_graph_count();

// NVTX: a range per C-layer call in the "metrale_feed" domain, a null check without a profiler.
// The attributes are built once per call site, so a range costs two flag checks and, without a
// profiler, two calls that find NVTX's function pointers null.
class NvtxRange {
public:
    explicit NvtxRange(const void *attributes);
    ~NvtxRange();
    static const void *attributes(const char *text);  // registers the name, once per call site

private:
    bool pushed_;
};

}  // namespace mf

#define MF_RANGE_ONLY(text)                                                \
    static const void *const mf_range_attr_ = ::mf::NvtxRange::attributes(text); \
    ::mf::NvtxRange mf_range_(mf_range_attr_)
#define MF_RANGE(text)                                                     \
    ::mf::PinScope mf_pins_;                                                 \
    MF_RANGE_ONLY(text)
