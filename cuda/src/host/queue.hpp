// The host backend's streams and events: CUDA's asynchronous semantics on CPU threads. Each stream
// is an ordered queue drained by its own worker; an event completes when a worker reaches it.
// docs/host-backend.md states the semantics (threads, fork, signals, exit, the default stream).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

namespace mf::host {

// Each record is a ticket. A query asks whether the latest ticket has run (lock-free); a wait
// (synchronize, stream_wait_event) waits for the ticket current when it was called, whatever
// later records on other streams do: CUDA's semantics.
class Stream;

struct Event {
    explicit Event(unsigned flags) : flags(flags) {}
    void retain() { refs.fetch_add(1, std::memory_order_relaxed); }
    void release() {
        if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
    bool done() const {
        return latest_done.load(std::memory_order_acquire) == recorded.load(std::memory_order_acquire);
    }
    uint64_t record(const Stream *on);  // a new ticket on stream `on`, outstanding until reach()
    // Takes back a record whose op could not be queued (out of memory): the event is as before.
    void unrecord(uint64_t ticket);
    // True when the latest ticket is still queued on `stream`: a wait for it from that stream's
    // own worker could never end (the worker would wait for work queued behind itself).
    bool latest_pending_on(const Stream *stream);
    void reach(uint64_t ticket, int64_t stamp_ns);
    void wait(uint64_t ticket);
    bool wait_for(uint64_t ticket, uint32_t timeout_us);  // true once the ticket has run

    const unsigned flags;
    std::atomic<uint64_t> recorded{0};     // the latest ticket handed out
    std::atomic<uint64_t> latest_done{0};  // == recorded once the latest ticket has run
    std::atomic<int64_t> stamp_ns{0};      // when the latest ticket ran
    std::atomic<int> refs{1};
    std::mutex mutex;
    std::condition_variable changed;
    std::unordered_set<uint64_t> outstanding;  // tickets queued, not yet run (under mutex)
    const Stream *latest_on = nullptr;         // the stream of the latest ticket (under mutex)
    const Stream *previous_on = nullptr;       // and of the one before it, for unrecord()
};

// What takes back a queued piece that is discarded before it was published (an event record's
// ticket and reference): fn(ctx, arg), which must not throw. Empty for most pieces.
struct Undo {
    void (*fn)(void *ctx, uint64_t arg) = nullptr;
    void *ctx = nullptr;
    uint64_t arg = 0;
};

class Staging;

class Stream {
public:
    // blocking: a stream created without MF_STREAM_NON_BLOCKING, which orders against the legacy
    // default stream both ways. Throws std::system_error when the OS refuses the worker thread.
    explicit Stream(bool blocking, bool is_default = false);
    // The worker holds one reference and drops it when it has drained a closed stream; a caller
    // blocked in synchronize() holds another, so neither frees the stream under the other.
    void retain() { refs_.fetch_add(1, std::memory_order_relaxed); }
    void release() {
        if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
    // `name` (a string literal) labels the op in a trace (mf_trace_enable). While this thread
    // stages pieces for this stream (Staging), the op is staged instead, and `undo` runs if the
    // staging is discarded; otherwise it is queued at once and `undo` is not kept.
    void enqueue(const char *name, std::function<void()> op, Undo undo = {});
    // Queues `op` behind the work queued so far, with no ordering against other streams, unless
    // the stream is idle (then false, and nothing is queued). A deferred free's marker.
    bool enqueue_if_busy(const char *name, std::function<void()> op);
    bool idle();
    uint64_t enqueued();                               // ops queued so far
    bool wait_for(uint64_t target, uint32_t timeout_us);  // true once `target` ops have completed
    void wait_until(uint64_t target);
    void synchronize();
    void close();  // the worker drains the queue, then frees the stream

    struct Op {
        const char *name;
        int64_t queued_ns;
        std::function<void()> run;
        Undo undo;  // staged pieces only; not kept in the queue
    };

private:
    friend class Staging;
    void run();
    void register_self();    // in the registries; throws (registering nothing) when out of memory
    void unregister_self();  // never throws
    // Queues ops[0..n) behind the work queued so far, ordered against the legacy default stream
    // as one call: all of them, or (a throw: out of memory) none.
    void submit(Op *ops, size_t n);
    void publish(Op *ops, size_t n);  // the same without the legacy ordering
    std::mutex mutex_;
    std::condition_variable work_, idle_;
    struct Queued {
        const char *name;
        int64_t queued_ns;
        std::function<void()> run;
    };
    std::deque<Queued> queue_;
    uint64_t enqueued_ = 0, completed_ = 0;
    bool closing_ = false;
    const bool blocking_, default_;
    std::atomic<int> refs_{1};
};

// A call made of several queued pieces (a kernel, the copies of its results, an event record;
// a graph's calls) stages them on this thread and publishes them in one step, so a call refused
// between two pieces (an injected fault, out of memory) queued none of them (docs/host-backend.md,
// "A refused call queued nothing"). While one is open, this thread's enqueue() on its stream
// stages instead of queueing. A staging opened on the same stream while one is open joins it:
// its pieces are published with the outer one's, and discarding it takes back its own only.
class Staging {
public:
    explicit Staging(Stream *stream);  // throws (nothing staged) when out of memory
    ~Staging();                        // not committed: takes back what it staged, newest first
    Staging(const Staging &) = delete;
    Staging &operator=(const Staging &) = delete;
    // Publishes every staged piece in one step. A throw (out of memory) takes them all back first.
    void commit();

private:
    friend class Stream;
    void discard_from(size_t mark) noexcept;
    Stream *stream_;
    Staging *outer_ = nullptr;  // the open staging this one joined (same stream), or none
    Staging *prev_ = nullptr;   // the thread's open staging before this one (another stream)
    size_t mark_ = 0;           // joined: where this one's pieces begin in the outer one's
    bool done_ = false;
    std::vector<Stream::Op> ops_;
};

Stream *default_stream();
// The stream whose worker is running the calling thread's current op (a host function, so far
// the only op that runs caller code), or nullptr on any other thread. A wait on that stream's
// later work from there would wait for itself: CUDA forbids it in a host function, and the host
// backend refuses it instead of deadlocking.
const Stream *current_stream();
Stream *stream_of(void *raw);  // raw 0 is the default stream
void synchronize_all();        // every live stream, as cudaFree implies
std::vector<Stream *> retain_live_streams();  // a snapshot, each retained (release() each)
int64_t now_ns();
bool tracing();
void trace(const char *name, const void *stream, int64_t queued_ns, int64_t start_ns, int64_t end_ns);
uint32_t lag_us();

// Rows of a kernel spread over the pool and the calling worker: fn(begin, end) on disjoint ranges.
// How many threads one kernel uses: the stream worker plus pool helpers (0 or > cores: all cores).
void set_kernel_threads(unsigned threads);
unsigned kernel_threads();
void parallel_rows(uint32_t rows, const std::function<void(uint32_t, uint32_t)> &fn);

// fork() support of the parts with threads or locks (queue.cpp, pool.cpp, trace.cpp).
void trace_before_fork();
void trace_after_fork();  // parent and child: unlock
void pool_before_fork();
void pool_after_fork(bool child);  // child: the helpers are gone, a new pool starts on first use

}  // namespace mf::host
