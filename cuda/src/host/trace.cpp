// A bounded record of what the host backend's workers ran and when, for timelines (Chrome trace).
// Off by default: then an op pays one relaxed load.
#include <atomic>
#include <chrono>
#include <mutex>
#include <new>
#include <vector>

#include "metrale_feed/feed.h"
#include "queue.hpp"

namespace mf::host {
namespace {
std::atomic<bool> g_on{false};
// Never destroyed: a worker still draining a closed stream may record while the process exits,
// after static destructors have run (a destroyed vector there was a crash at exit).
struct State {
    std::mutex mutex;
    std::vector<mf_trace_record> records;
    size_t capacity = 0;
    uint64_t dropped = 0;
};
State &state() {
    static State *instance = new State;
    return *instance;
}
}  // namespace

void trace_before_fork() { state().mutex.lock(); }
void trace_after_fork() { state().mutex.unlock(); }

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

bool tracing() { return g_on.load(std::memory_order_relaxed); }

void trace(const char *name, const void *stream, int64_t queued_ns, int64_t start_ns, int64_t end_ns) {
    State &st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    auto &records = st.records;
    auto &dropped_count = st.dropped;
    const size_t capacity_now = st.capacity;
    if (records.size() >= capacity_now) {
        ++dropped_count;
        return;
    }
    try {
        records.push_back(mf_trace_record{name, (uint64_t)(uintptr_t)stream, queued_ns, start_ns, end_ns});
    } catch (const std::bad_alloc &) {
        ++dropped_count;  // a worker must not throw: out of memory, the record is dropped
    }
}

}  // namespace mf::host

extern "C" {
void mf_trace_enable(size_t capacity) {
    using namespace mf::host;
    State &st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    // At most 2**24 records (1 GiB); reserved as they come, so a bound costs nothing up front.
    if (capacity > ((size_t)1 << 24)) capacity = (size_t)1 << 24;
    std::vector<mf_trace_record>().swap(st.records);
    st.capacity = capacity;
    st.dropped = 0;
    g_on.store(capacity > 0, std::memory_order_relaxed);
}

size_t mf_trace_read(mf_trace_record *out, size_t max, uint64_t *dropped) {
    using namespace mf::host;
    State &st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    auto &records = st.records;
    if (!out) max = 0;  // nothing to read into: only the dropped count
    size_t n = records.size() < max ? records.size() : max;
    for (size_t i = 0; i < n; ++i) out[i] = records[i];
    records.erase(records.begin(), records.begin() + (ptrdiff_t)n);
    if (dropped) *dropped = st.dropped;
    return n;
}

int64_t mf_trace_now_ns(void) { return mf::host::now_ns(); }
}
