// Public entry points of graphs (feed.h, "graphs"; docs/graphs.md): arguments are checked here,
// then each backend captures in its own way (cuda: the runtime's stream capture; host: the public
// calls made on the capturing stream are kept and re-issued at each launch).
#include "api.hpp"

namespace mf {
namespace {
mf_status reclaim_graph(void *raw, bool) { return ops().graph_destroy(raw); }

SlotTable &graph_table() {
    static SlotTable *table = new SlotTable(reclaim_graph);  // never destroyed, as registry.cpp's
    return *table;
}

mf_status capturing(void *raw, int *out) {
    *out = 0;
    return ops().capture_status(raw, out);
}
}  // namespace

uint64_t live_graph_count() { return graph_table().live_count(); }

mf_status refuse_in_capture(void *raw, const char *what, bool host_inputs) {
    int on;
    mf_status status = capturing(raw, &on);
    if (status != MF_SUCCESS || !on) return status;
    if (host_inputs)
        return fail(MF_ERROR_CAPTURE,
                    "%s is not allowed on a stream that is capturing a graph: a replay could not "
                    "see new host-side values (use device-resident inputs; docs/graphs.md)",
                    what);
    return fail(MF_ERROR_CAPTURE,
                "%s is not allowed on a stream that is capturing a graph (end the capture first; "
                "docs/graphs.md)",
                what);
}

mf_status capture_host_check(void *raw, const void *ptr, const char *what) {
    if (alloc_lookup(ptr, nullptr) == MF_MEM_PINNED) return MF_SUCCESS;
    int on;
    mf_status status = capturing(raw, &on);
    if (status != MF_SUCCESS || !on) return status;
    return fail(MF_ERROR_CAPTURE,
                "%s: pageable host memory during a graph capture (a graph copies at each launch, "
                "which only page-locked memory of this package allows; docs/graphs.md)",
                what);
}

bool kept_for_graph(void *raw, Replay &&replay) {
    return ops().capture_keep && ops().capture_keep(raw, std::move(replay));
}

}  // namespace mf

using namespace mf;

extern "C" {

mf_status mf_graph_begin(mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("graph_begin");
        if (stream == 0)
            return fail(MF_ERROR_INVALID_VALUE,
                        "the default stream cannot be captured (CUDA's legacy stream is not "
                        "capturable): capture a stream of your own");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        int on;
        if (status == MF_SUCCESS) status = capturing(raw, &on);
        if (status != MF_SUCCESS) return status;
        if (on) return fail(MF_ERROR_CAPTURE, "stream 0x%llx is already capturing a graph", (unsigned long long)stream);
        return ops().capture_begin(raw);
    });
}

mf_status mf_graph_end(mf_stream_t stream, mf_graph_t *out) {
    return guard([&]() -> mf_status {
        MF_RANGE("graph_end");
        if (out) *out = 0;
        if (stream == 0) return fail(MF_ERROR_CAPTURE, "the default stream is never capturing");
        void *raw;
        mf_status status = resolve_stream(stream, &raw);
        int on;
        if (status == MF_SUCCESS) status = capturing(raw, &on);
        if (status != MF_SUCCESS) return status;
        if (!on) return fail(MF_ERROR_CAPTURE, "stream 0x%llx is not capturing a graph", (unsigned long long)stream);
        void *graph = nullptr;
        status = ops().capture_end(raw, out ? &graph : nullptr);
        if (status != MF_SUCCESS || !out) return status;
        *out = insert_handle(graph_table(), graph, 0, true, "graph");
        if (*out == 0) {
            ops().graph_destroy(graph);
            return MF_ERROR_OUT_OF_MEMORY;
        }
        return MF_SUCCESS;
    });
}

mf_status mf_graph_launch(mf_graph_t graph, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("graph_launch");
        Slot *slot;
        void *raw;
        mf_status status = graph_table().acquire(graph, &slot, "graph");
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        int on;
        if (status == MF_SUCCESS) status = capturing(raw, &on);
        if (status != MF_SUCCESS) return status;
        if (on) return fail(MF_ERROR_CAPTURE, "a graph cannot be launched on a stream that is capturing one");
        return ops().graph_launch(slot->raw, raw, stream);
    });
}

mf_status mf_graph_destroy(mf_graph_t graph) {
    return guard([&]() -> mf_status {
        MF_RANGE("graph_destroy");
        return graph_table().erase(graph, "graph");  // a launch using it meanwhile finishes first
    });
}

mf_status mf_stream_capturing(mf_stream_t stream, int *out) {
    return guard([&]() -> mf_status {
        PinScope pins;
        if (!out) return need(out, "out");
        void *raw;
        *out = 0;
        mf_status status = resolve_stream(stream, &raw);
        return status != MF_SUCCESS ? status : capturing(raw, out);
    });
}

uint64_t mf_live_graphs(void) { return live_graph_count(); }  // an atomic load: nothing throws

}  // extern "C"
