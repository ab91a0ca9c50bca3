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
std::mutex g_mutex;
std::vector<mf_trace_record> g_records;
size_t g_capacity = 0;
uint64_t g_dropped = 0;
}  // namespace

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

bool tracing() { return g_on.load(std::memory_order_relaxed); }

void trace(const char *name, const void *stream, int64_t queued_ns, int64_t start_ns, int64_t end_ns) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_records.size() >= g_capacity) {
        ++g_dropped;
        return;
    }
    try {
        g_records.push_back(mf_trace_record{name, (uint64_t)(uintptr_t)stream, queued_ns, start_ns, end_ns});
    } catch (const std::bad_alloc &) {
        ++g_dropped;  // a worker must not throw: out of memory, the record is dropped
    }
}

}  // namespace mf::host

extern "C" {
void mf_trace_enable(size_t capacity) {
    using namespace mf::host;
    std::lock_guard<std::mutex> lock(g_mutex);
    // At most 2**24 records (1 GiB); reserved as they come, so a bound costs nothing up front.
    if (capacity > ((size_t)1 << 24)) capacity = (size_t)1 << 24;
    std::vector<mf_trace_record>().swap(g_records);
    g_capacity = capacity;
    g_dropped = 0;
    g_on.store(capacity > 0, std::memory_order_relaxed);
}

size_t mf_trace_read(mf_trace_record *out, size_t max, uint64_t *dropped) {
    using namespace mf::host;
    std::lock_guard<std::mutex> lock(g_mutex);
    size_t n = g_records.size() < max ? g_records.size() : max;
    for (size_t i = 0; i < n; ++i) out[i] = g_records[i];
    g_records.erase(g_records.begin(), g_records.begin() + (ptrdiff_t)n);
    if (dropped) *dropped = g_dropped;
    return n;
}

int64_t mf_trace_now_ns(void) { return mf::host::now_ns(); }
}
