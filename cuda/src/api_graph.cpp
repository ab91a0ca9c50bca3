// Public entry points of graphs (feed.h, "graphs"; docs/graphs.md): arguments are checked here,
// then each backend captures in its own way (cuda: the runtime's stream capture; host: the public
// calls made on the capturing stream are kept and re-issued at each launch).
#include "api.hpp"

#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace mf {
namespace {
// The allocations a capture, then its graph, names: each pinned in the ledger while this lives, so
// a free meanwhile is deferred until the graph goes and the address cannot be reused under it
// (docs/lifetimes.md, rules 1-3). Both backends: cuda's runtime keeps the raw pointers.
struct Named {
    std::vector<AllocRef> refs;
    Named() = default;
    Named(const Named &) = delete;
    Named &operator=(const Named &) = delete;
    ~Named() {
        for (const AllocRef &ref : refs) alloc_graph_unpin(ref);
    }
    void add(const AllocRef &ref) {
        for (const AllocRef &r : refs)
            if (r.base == ref.base && r.generation == ref.generation) return;
        refs.push_back(ref);  // may throw bad_alloc: the caller catches
        alloc_graph_pin(ref);
    }
};

struct GraphObject {
    void *backend;  // the backend's graph
    Named *named;
};

mf_status reclaim_graph(void *raw, bool) {
    GraphObject *graph = static_cast<GraphObject *>(raw);
    mf_status status = ops().graph_destroy(graph->backend);
    delete graph->named;  // after the destroy: memory is freed only once no graph can use it
    delete graph;
    return status;
}

// Captures begun by mf_graph_begin, by raw stream. Never destroyed (workers may outlive statics).
std::mutex &named_mutex() {
    static std::mutex *mutex = new std::mutex;
    return *mutex;
}
std::unordered_map<void *, Named *> &named_captures() {
    static auto *map = new std::unordered_map<void *, Named *>;
    return *map;
}
std::atomic<size_t> g_named{0};

Named *take_named(void *raw) {
    std::lock_guard<std::mutex> lock(named_mutex());
    auto it = named_captures().find(raw);
    if (it == named_captures().end()) return nullptr;
    Named *named = it->second;
    named_captures().erase(it);
    g_named.fetch_sub(1, std::memory_order_release);
    return named;
}

// A call on `raw` was recorded by its capture: the allocations its checks found join the graph's.
void note_named(void *raw) {
    std::lock_guard<std::mutex> lock(named_mutex());
    auto it = named_captures().find(raw);
    if (it == named_captures().end()) return;
    unsigned n;
    const Touched *seen = touched(&n);
    try {
        for (unsigned i = 0; i < n; ++i)
            if (seen[i].ref.base != 0) it->second->add(seen[i].ref);
    } catch (const std::bad_alloc &) {
        // Not kept: a free of it is not deferred for this graph (its launches still check it).
    }
}

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
    if (g_named.load(std::memory_order_acquire)) note_named(raw);
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
        Named *named = new (std::nothrow) Named;
        if (!named) return fail(MF_ERROR_OUT_OF_MEMORY, "graph_begin: out of memory");
        status = ops().capture_begin(raw);
        if (status != MF_SUCCESS) {
            delete named;
            return status;
        }
        std::lock_guard<std::mutex> lock(named_mutex());
        try {
            named_captures()[raw] = named;
        } catch (const std::bad_alloc &) {
            delete named;
            ops().capture_end(raw, nullptr);
            return fail(MF_ERROR_OUT_OF_MEMORY, "graph_begin: out of memory");
        }
        g_named.fetch_add(1, std::memory_order_release);
        return MF_SUCCESS;
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
        Named *named = take_named(raw);  // null for a capture begun elsewhere (cuda: torch's)
        status = ops().capture_end(raw, out ? &graph : nullptr);
        if (status != MF_SUCCESS || !out) {
            delete named;  // discarded: the frees it deferred happen now
            return status;
        }
        GraphObject *object = new (std::nothrow) GraphObject{graph, named ? named : new (std::nothrow) Named};
        if (object && !object->named) {
            delete object;
            object = nullptr;
        }
        *out = object ? graph_table().insert(object, 0, true) : 0;
        if (*out == 0) {
            ops().graph_destroy(graph);
            if (object) {
                delete object->named;
                delete object;
            } else {
                delete named;
            }
            return fail(MF_ERROR_OUT_OF_MEMORY, "too many live graphs");
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
        const GraphObject *object = static_cast<const GraphObject *>(slot->raw);
        // A generation check: memory the graph names was freed since the capture (its memory is kept
        // until the graph goes, but a launch never runs on memory its owner has given up).
        const std::vector<AllocRef> &refs = object->named->refs;
        if (const AllocRef *stale = alloc_first_stale(refs.data(), refs.size()))
            return fail(MF_ERROR_INVALID_HANDLE,
                        "graph 0x%llx names memory at 0x%llx that was freed after the capture: the "
                        "graph cannot be launched any more (close the graph; docs/lifetimes.md)",
                        (unsigned long long)graph, (unsigned long long)stale->base);
        return ops().graph_launch(object->backend, raw, stream);
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
