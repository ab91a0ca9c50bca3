// Host-backend graphs. A capture keeps each public call made on the capturing stream (its
// arguments were checked when it was made: device-resident inputs only, see api_graph.cpp) instead
// of queueing it. A launch re-issues the calls on the launch stream, so each is queued as it
// would be eagerly and reads its device-resident inputs when it runs; an event record takes a
// new ticket at each launch, as a CUDA event record node does.
#include "graph.hpp"

#include <pthread.h>

#include <atomic>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "../registry.hpp"
#include "queue.hpp"

namespace mf::host {
namespace {

// A kept call, with the ranges the binding lent it (a CPU tensor standing in for device memory):
// a replay lends them again, since the Graph keeps the tensors alive (docs/lifetimes.md).
struct Call {
    Replay replay;
    std::vector<std::pair<const void *, size_t>> borrowed;

    mf_status operator()(mf_stream_t stream) const {
        PinScope pins;
        for (const auto &[ptr, nbytes] : borrowed) mf_device_borrow(ptr, nbytes);
        mf_status status = replay(stream);
        if (!borrowed.empty()) mf_device_borrow_clear();
        return status;
    }
};

struct Graph {
    std::vector<Call> calls;
    bool lost = false;  // a call could not be kept (out of memory): the capture cannot end well
};

// Captures in progress, by stream. `g_captures` lets every queued call skip the lock while no
// stream captures (the usual case).
std::mutex &capture_mutex() {
    static std::mutex *mutex = new std::mutex;  // never destroyed: workers may outlive statics
    return *mutex;
}
std::unordered_map<void *, Graph *> &captures() {
    static auto *map = new std::unordered_map<void *, Graph *>;
    return *map;
}
std::atomic<size_t> g_captures{0};

// Set while a launch makes its checking pass: each call is checked and kept here, not queued.
thread_local bool t_checking = false;

// fork(): the lock is taken around it, so a child never inherits it held by a thread that does
// not exist there; the child drops the parent's captures (their streams are the parent's, see
// docs/host-backend.md, "fork"). Its own hooks: this file's lock is taken with no other held.
void before_fork() { capture_mutex().lock(); }
void after_fork_parent() { capture_mutex().unlock(); }
void after_fork_child() {
    captures().clear();  // the graphs are left as they are: a few bytes, and the parent's
    g_captures.store(0, std::memory_order_relaxed);
    capture_mutex().unlock();
}
const int g_atfork = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

}  // namespace

mf_status capture_begin(void *stream) {
    Graph *graph = new (std::nothrow) Graph;
    if (!graph) return fail(MF_ERROR_OUT_OF_MEMORY, "graph_begin: out of memory");
    std::lock_guard<std::mutex> lock(capture_mutex());
    // The caller checked the stream was not capturing; two threads racing to begin on one stream
    // are told apart here.
    if (!captures().emplace(stream, graph).second) {
        delete graph;
        return fail(MF_ERROR_CAPTURE, "the stream is already capturing a graph");
    }
    g_captures.fetch_add(1, std::memory_order_release);
    return MF_SUCCESS;
}

mf_status capture_status(void *stream, int *capturing) {
    if (g_captures.load(std::memory_order_acquire) == 0) {
        *capturing = 0;
        return MF_SUCCESS;
    }
    std::lock_guard<std::mutex> lock(capture_mutex());
    *capturing = captures().count(stream) != 0;
    return MF_SUCCESS;
}

mf_status capture_end(void *stream, void **out) {
    Graph *graph;
    {
        std::lock_guard<std::mutex> lock(capture_mutex());
        auto it = captures().find(stream);
        if (it == captures().end()) return fail(MF_ERROR_CAPTURE, "the stream is not capturing a graph");
        graph = it->second;
        captures().erase(it);
        g_captures.fetch_sub(1, std::memory_order_release);
    }
    if (out && graph->lost) {
        delete graph;
        return fail(MF_ERROR_OUT_OF_MEMORY, "graph_end: a captured call could not be kept (out of memory)");
    }
    if (out)
        *out = graph;
    else
        delete graph;
    return MF_SUCCESS;
}

bool capture_keep(void *stream, Replay &&replay) {
    if (t_checking) return true;  // a launch's checking pass: checked, nothing queued
    if (g_captures.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard<std::mutex> lock(capture_mutex());
    auto it = captures().find(stream);
    if (it == captures().end()) return false;
    try {
        Call call{std::move(replay), {}};
        unsigned n;
        const Touched *seen = touched(&n);
        for (unsigned i = 0; i < n; ++i)
            if (seen[i].ref.base == 0) call.borrowed.emplace_back(seen[i].ptr, seen[i].nbytes);
        it->second->calls.push_back(std::move(call));
    } catch (const std::bad_alloc &) {
        it->second->lost = true;  // nothing lost silently: mf_graph_end fails
    }
    return true;
}

mf_status graph_launch(void *raw, void *raw_stream, mf_stream_t handle) {
    const Graph *graph = static_cast<const Graph *>(raw);
    // Two passes, so a launch is all or nothing: first each call is checked again (its memory
    // may have been freed, its event destroyed since the capture) and nothing is queued; then
    // the calls are issued. Each call pins its own handles, released as it returns.
    t_checking = true;
    for (const Call &call : graph->calls) {
        mf_status status = call(handle);
        if (status != MF_SUCCESS) {
            t_checking = false;
            return status;
        }
    }
    t_checking = false;
    // The calls are staged on the launch stream (each call's own staging joins this one) and
    // published together: a call refused now (a race with a free or destroy meanwhile, a fault,
    // out of memory) leaves none of the launch queued.
    Staging staging(stream_of(raw_stream));
    for (const Call &call : graph->calls) {
        mf_status status = call(handle);
        if (status != MF_SUCCESS) return status;  // ~Staging takes back the calls before it
    }
    staging.commit();  // a throw (out of memory): none published, guard() makes it a status
    return MF_SUCCESS;
}

mf_status graph_destroy(void *raw) {
    delete static_cast<Graph *>(raw);  // launches already queued hold no reference to it
    return MF_SUCCESS;
}

}  // namespace mf::host
