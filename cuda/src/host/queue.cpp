#include "queue.hpp"

#include <chrono>
#include <memory>
#include <unordered_set>
#include <vector>

#include "../registry.hpp"

namespace mf::host {
namespace {
// The backend's shared state. Never destroyed: detached workers may still run while the process
// exits, after static destructors (docs/host-backend.md, "Exit"). A fork()ed child starts a fresh
// set (after_fork_child): the parent's workers do not exist there.
struct Shared {
    std::mutex streams_mutex;
    std::unordered_set<Stream *> streams;  // live and draining streams, for synchronize_all
    // Legacy default-stream ordering: held while an op on the default stream or on a blocking
    // stream picks what it must wait for and is queued, so those ops have one global order and
    // their waits cannot form a cycle.
    std::mutex legacy_mutex;
    std::vector<Stream *> blocking;  // blocking streams, until their worker has drained them
    std::atomic<size_t> blocking_count{0};  // blocking.size(), read without the lock
    std::mutex default_mutex;
    std::atomic<Stream *> default_stream{nullptr};
};
Shared *g_shared = new Shared;

Shared &shared() { return *g_shared; }

thread_local const Stream *t_current = nullptr;  // set by Stream::run around each op
// The staging this thread has open (Staging), or none: enqueue() stages on its stream.
thread_local Staging *t_staging = nullptr;
}  // namespace

const Stream *current_stream() { return t_current; }

uint64_t Event::record(const Stream *on) {
    std::lock_guard<std::mutex> lock(mutex);
    uint64_t ticket = recorded.load(std::memory_order_relaxed) + 1;
    outstanding.insert(ticket);
    recorded.store(ticket, std::memory_order_release);
    previous_on = latest_on;
    latest_on = on;
    return ticket;
}

void Event::unrecord(uint64_t ticket) {
    {
        std::lock_guard<std::mutex> lock(mutex);
        outstanding.erase(ticket);
        // Still the latest: back to the record before it, done if that one has run (its reach()
        // saw a later ticket and left latest_done behind). Else a later record supersedes it.
        if (recorded.load(std::memory_order_relaxed) == ticket) {
            recorded.store(ticket - 1, std::memory_order_release);
            latest_on = previous_on;
            if (!outstanding.count(ticket - 1)) latest_done.store(ticket - 1, std::memory_order_release);
        }
    }
    changed.notify_all();
}

bool Event::latest_pending_on(const Stream *stream) {
    if (!stream) return false;
    std::lock_guard<std::mutex> lock(mutex);
    // Queued on this stream and not yet run: behind the op now running, since a stream is FIFO.
    return latest_on == stream && outstanding.count(recorded.load(std::memory_order_relaxed)) != 0;
}

void Event::reach(uint64_t ticket, int64_t stamp) {
    {
        std::lock_guard<std::mutex> lock(mutex);
        outstanding.erase(ticket);
        if (ticket == recorded.load(std::memory_order_relaxed)) {  // the latest record has run
            stamp_ns.store(stamp, std::memory_order_relaxed);
            latest_done.store(ticket, std::memory_order_release);
        }
    }
    changed.notify_all();
}

void Event::wait(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return outstanding.count(ticket) == 0; });
}

bool Event::wait_for(uint64_t ticket, uint32_t timeout_us) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, std::chrono::microseconds(timeout_us),
                            [&] { return outstanding.count(ticket) == 0; });
}

Stream::Stream(bool blocking, bool is_default) : blocking_(blocking && !is_default), default_(is_default) {
    // Registered before its worker starts, and unregistered when the OS refuses the thread, so a
    // throw from here (out of memory) leaves no worker running on a freed Stream and no stale entry.
    register_self();
    try {
        std::thread worker(&Stream::run, this);  // throws std::system_error when the OS refuses
        worker.detach();
    } catch (...) {
        unregister_self();
        throw;
    }
}

void Stream::register_self() {
    Shared &s = shared();
    {
        std::lock_guard<std::mutex> lock(s.streams_mutex);
        s.streams.insert(this);
    }
    if (!blocking_) return;
    try {
        std::lock_guard<std::mutex> lock(s.legacy_mutex);
        s.blocking.push_back(this);
        s.blocking_count.store(s.blocking.size(), std::memory_order_release);
    } catch (...) {
        std::lock_guard<std::mutex> lock(s.streams_mutex);
        s.streams.erase(this);
        throw;
    }
}

void Stream::unregister_self() {
    Shared &s = shared();
    if (blocking_) {
        std::lock_guard<std::mutex> legacy(s.legacy_mutex);
        for (auto it = s.blocking.begin(); it != s.blocking.end(); ++it)
            if (*it == this) {
                s.blocking.erase(it);
                break;
            }
        s.blocking_count.store(s.blocking.size(), std::memory_order_release);
    }
    std::lock_guard<std::mutex> registry(s.streams_mutex);
    s.streams.erase(this);
}

void Stream::publish(Op *ops, size_t n) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        // Under the lock the worker sees none of them until all are in: a push that throws (a new
        // block of the deque, out of memory) takes back the ones before it, and the queue is as
        // it was.
        size_t pushed = 0;
        try {
            for (; pushed < n; ++pushed)
                queue_.push_back(Queued{ops[pushed].name, ops[pushed].queued_ns, std::move(ops[pushed].run)});
        } catch (...) {
            while (pushed--) queue_.pop_back();
            throw;
        }
        enqueued_ += n;
    }
    work_.notify_one();
}

void Stream::enqueue(const char *name, std::function<void()> op, Undo undo) {
    if (Staging *staging = t_staging; staging && staging->stream_ == this) {
        staging->ops_.push_back(Op{name, tracing() ? now_ns() : 0, std::move(op), undo});
        return;
    }
    Op one{name, tracing() ? now_ns() : 0, std::move(op), {}};
    submit(&one, 1);
}

void Stream::submit(Op *ops, size_t n) {
    if (!blocking_ && !default_) return publish(ops, n);  // non-blocking: no ordering
    // CUDA's legacy default stream: its work waits for all work queued before it on blocking
    // streams, and work on a blocking stream waits for all work queued before it on stream 0.
    Shared &s = shared();
    if (default_ && s.blocking_count.load(std::memory_order_acquire) == 0) return publish(ops, n);
    std::lock_guard<std::mutex> legacy(s.legacy_mutex);
    // Allocated before any stream is retained, and the retains given back if queueing throws
    // (out of memory): a refused op leaves no reference behind.
    std::vector<std::pair<Stream *, uint64_t>> waits;
    waits.reserve(default_ ? s.blocking.size() : 1);
    auto consider = [&](Stream *other) {
        if (other == this) return;
        std::lock_guard<std::mutex> lock(other->mutex_);
        if (other->completed_ < other->enqueued_) {
            other->retain();
            waits.emplace_back(other, other->enqueued_);
        }
    };
    if (default_) {
        for (Stream *other : s.blocking) consider(other);
    } else if (Stream *d = s.default_stream.load(std::memory_order_acquire)) {
        consider(d);
    }
    if (waits.empty()) return publish(ops, n);
    try {
        // The first op waits; the others are behind it on this stream.
        ops[0].run = [waits, op = std::move(ops[0].run)] {
            for (auto &[other, target] : waits) {
                other->wait_until(target);
                other->release();
            }
            op();
        };
        publish(ops, n);
    } catch (...) {
        for (auto &wait : waits) wait.first->release();
        throw;
    }
}

Staging::Staging(Stream *stream) : stream_(stream) {
    if (t_staging && t_staging->stream_ == stream) {
        outer_ = t_staging;
        mark_ = outer_->ops_.size();
        return;
    }
    ops_.reserve(4);  // a kernel, two copies and a record: one allocation for the usual call
    prev_ = t_staging;
    t_staging = this;
}

Staging::~Staging() {
    if (!outer_ && t_staging == this) t_staging = prev_;
    if (done_) return;
    if (outer_)
        outer_->discard_from(mark_);
    else
        discard_from(0);
}

void Staging::discard_from(size_t mark) noexcept {
    for (size_t i = ops_.size(); i-- > mark;)
        if (ops_[i].undo.fn) ops_[i].undo.fn(ops_[i].undo.ctx, ops_[i].undo.arg);
    ops_.erase(ops_.begin() + (std::ptrdiff_t)mark, ops_.end());
}

void Staging::commit() {
    if (outer_) {  // joined: the outermost one publishes
        done_ = true;
        return;
    }
    t_staging = prev_;  // what publishing queues is queued, not staged again
    if (!ops_.empty()) stream_->submit(ops_.data(), ops_.size());  // a throw: ~Staging takes back all
    done_ = true;
    ops_.clear();
}

bool Stream::enqueue_if_busy(const char *name, std::function<void()> op) {
    int64_t queued = tracing() ? now_ns() : 0;
    // Under the lock: a busy stream's worker is still running, so it will reach the op.
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_ == enqueued_) return false;
    queue_.push_back(Queued{name, queued, std::move(op)});
    ++enqueued_;
    work_.notify_one();
    return true;
}

bool Stream::idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ == enqueued_;
}

uint64_t Stream::enqueued() {
    std::lock_guard<std::mutex> lock(mutex_);
    return enqueued_;
}

bool Stream::wait_for(uint64_t target, uint32_t timeout_us) {
    std::unique_lock<std::mutex> lock(mutex_);
    return idle_.wait_for(lock, std::chrono::microseconds(timeout_us), [&] { return completed_ >= target; });
}

void Stream::wait_until(uint64_t target) {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return completed_ >= target; });
}

void Stream::synchronize() { wait_until(enqueued()); }

void Stream::close() {
    // Notified under the lock: once it is released the worker may drain, finish and free the
    // stream, condition variable included.
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
    work_.notify_one();
}

void Stream::run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        work_.wait(lock, [&] { return !queue_.empty() || closing_; });
        if (queue_.empty()) break;  // closing, and drained
        Queued op = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        if (uint32_t lag = lag_us()) std::this_thread::sleep_for(std::chrono::microseconds(lag));
        int64_t start = op.queued_ns ? now_ns() : 0;
        t_current = this;
        op.run();
        t_current = nullptr;
        op.run = nullptr;  // captured references go before the op counts as completed
        if (op.queued_ns) trace(op.name, default_ ? nullptr : this, op.queued_ns, start, now_ns());
        lock.lock();
        ++completed_;
        idle_.notify_all();
    }
    lock.unlock();
    unregister_self();  // only now: a free that synchronizes every stream waits for a closed one
    release();  // the worker's reference; a caller still in synchronize() holds its own
}

Stream *default_stream() {
    // Lives for the process (for a fork()ed child: from its first use there), like CUDA's null stream.
    Shared &s = shared();
    Stream *stream = s.default_stream.load(std::memory_order_acquire);
    if (stream) return stream;
    std::lock_guard<std::mutex> lock(s.default_mutex);
    stream = s.default_stream.load(std::memory_order_relaxed);
    if (!stream) {
        stream = new Stream(false, true);
        s.default_stream.store(stream, std::memory_order_release);
    }
    return stream;
}

Stream *stream_of(void *raw) { return raw ? static_cast<Stream *>(raw) : default_stream(); }

std::vector<Stream *> retain_live_streams() {
    std::vector<Stream *> streams;
    std::lock_guard<std::mutex> lock(shared().streams_mutex);
    streams.reserve(shared().streams.size());
    for (Stream *stream : shared().streams) {
        stream->retain();
        streams.push_back(stream);
    }
    return streams;
}

void synchronize_all() {
    // A snapshot, each retained: the waits happen without the registry lock held.
    std::vector<Stream *> streams = retain_live_streams();
    for (Stream *stream : streams) {
        stream->synchronize();
        stream->release();
    }
}

void before_fork() {
    Shared &s = shared();
    s.default_mutex.lock();
    s.legacy_mutex.lock();
    s.streams_mutex.lock();
    pool_before_fork();
    trace_before_fork();
}

void after_fork_parent() {
    trace_after_fork();
    pool_after_fork(false);
    Shared &s = shared();
    s.streams_mutex.unlock();
    s.legacy_mutex.unlock();
    s.default_mutex.unlock();
}

void after_fork_child() {
    trace_after_fork();
    pool_after_fork(true);
    // The parent's streams, events and workers are left behind (their handles now fail: the
    // registry's fork epoch); the child gets a fresh default stream on first use.
    Shared *old = g_shared;
    old->streams_mutex.unlock();
    old->legacy_mutex.unlock();
    old->default_mutex.unlock();
    g_shared = new Shared;
}

}  // namespace mf::host
