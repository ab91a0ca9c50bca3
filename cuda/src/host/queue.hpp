// The host backend's streams and events: CUDA's asynchronous semantics on CPU threads. Each stream
// is an ordered queue drained by its own worker; an event completes when a worker reaches it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mf::host {

struct Event {
    explicit Event(unsigned flags) : flags(flags) {}
    void retain() { refs.fetch_add(1, std::memory_order_relaxed); }
    void release() {
        if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
    bool done() const {
        return reached.load(std::memory_order_acquire) >= recorded.load(std::memory_order_acquire);
    }
    void reach(uint64_t ticket, int64_t stamp_ns);
    void wait(uint64_t ticket);

    const unsigned flags;
    std::atomic<uint64_t> recorded{0};  // tickets handed out by record
    std::atomic<uint64_t> reached{0};   // the highest ticket a worker has passed
    std::atomic<int64_t> stamp_ns{0};
    std::atomic<int> refs{1};
    std::mutex mutex;
    std::condition_variable changed;
};

class Stream {
public:
    Stream();
    // `name` (a string literal) labels the op in a trace (mf_trace_enable).
    void enqueue(const char *name, std::function<void()> op);
    bool idle();
    void synchronize();
    void close();  // the worker drains the queue, then frees the stream

private:
    void run();
    std::mutex mutex_;
    std::condition_variable work_, idle_;
    struct Op {
        const char *name;
        int64_t queued_ns;
        std::function<void()> run;
    };
    std::deque<Op> queue_;
    uint64_t enqueued_ = 0, completed_ = 0;
    bool closing_ = false;
};

Stream *default_stream();
Stream *stream_of(void *raw);  // raw 0 is the default stream
void synchronize_all();        // every live stream, as cudaFree implies
int64_t now_ns();
bool tracing();
void trace(const char *name, const void *stream, int64_t queued_ns, int64_t start_ns, int64_t end_ns);
uint32_t lag_us();

// Rows of a kernel spread over the pool and the calling worker: fn(begin, end) on disjoint ranges.
// How many threads one kernel uses: the stream worker plus pool helpers (0 or > cores: all cores).
void set_kernel_threads(unsigned threads);
unsigned kernel_threads();
void parallel_rows(uint32_t rows, const std::function<void(uint32_t, uint32_t)> &fn);

}  // namespace mf::host
