// Shared by the public entry points (api_*.cpp): the active backend, stream resolution, NVTX.
#pragma once

#include "backend.hpp"
#include "registry.hpp"

namespace mf {

const Ops &ops();
mf_backend active_kind();

// A stream handle to the backend's raw value. host: must be a live, generation-checked stream of
// ours (or 0); cuda: any value is taken as a cudaStream_t, since CUDA cannot check a foreign one.
// Both resolvers pin what they return until the caller's PinScope ends (MF_RANGE opens one), so
// a destroy from another thread meanwhile cannot free it.
mf_status resolve_stream(mf_stream_t stream, void **raw);
// A live event's slot, or MF_ERROR_INVALID_HANDLE with the message set.
mf_status resolve_event(mf_event_t event, Slot **slot);
uint64_t live_stream_count();

// Device memory the active backend may touch: an allocation of ours with `nbytes` left, or, on
// cuda only, a foreign pointer taken as is.
mf_status check_device_range(const void *ptr, size_t nbytes, const char *what);
// Host memory a copy writes or reads: pinned memory of ours is range-checked, other host memory
// is the caller's; a device allocation of ours is refused.
mf_status check_host_range(const void *ptr, size_t nbytes, const char *what);

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
