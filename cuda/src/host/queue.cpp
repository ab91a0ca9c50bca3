#include "queue.hpp"

#include <chrono>
#include <memory>
#include <unordered_set>

namespace mf::host {
namespace {
std::mutex g_streams_mutex;
std::unordered_set<Stream *> g_streams;
}  // namespace

uint64_t Event::record() {
    std::lock_guard<std::mutex> lock(mutex);
    uint64_t ticket = recorded.load(std::memory_order_relaxed) + 1;
    outstanding.insert(ticket);
    recorded.store(ticket, std::memory_order_release);
    return ticket;
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

Stream::Stream() {
    {
        std::lock_guard<std::mutex> lock(g_streams_mutex);
        g_streams.insert(this);
    }
    std::thread(&Stream::run, this).detach();
}

void Stream::enqueue(const char *name, std::function<void()> op) {
    int64_t queued = tracing() ? now_ns() : 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(Op{name, queued, std::move(op)});
        ++enqueued_;
    }
    work_.notify_one();
}

bool Stream::idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ == enqueued_;
}

void Stream::synchronize() {
    std::unique_lock<std::mutex> lock(mutex_);
    uint64_t target = enqueued_;
    idle_.wait(lock, [&] { return completed_ >= target; });
}

void Stream::close() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        closing_ = true;
    }
    work_.notify_one();
}

void Stream::run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        work_.wait(lock, [&] { return !queue_.empty() || closing_; });
        if (queue_.empty()) break;  // closing, and drained
        Op op = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        if (uint32_t lag = lag_us()) std::this_thread::sleep_for(std::chrono::microseconds(lag));
        int64_t start = op.queued_ns ? now_ns() : 0;
        op.run();
        op.run = nullptr;  // captured references go before the op counts as completed
        if (op.queued_ns) trace(op.name, this == default_stream() ? nullptr : this, op.queued_ns, start, now_ns());
        lock.lock();
        ++completed_;
        idle_.notify_all();
    }
    lock.unlock();
    {
        // Only now: a free that synchronizes every stream also waits for a closed one to drain.
        std::lock_guard<std::mutex> registry(g_streams_mutex);
        g_streams.erase(this);
    }
    release();  // the worker's reference; a caller still in synchronize() holds its own
}

Stream *default_stream() {
    static Stream *stream = new Stream();  // lives for the process, like CUDA's null stream
    return stream;
}

Stream *stream_of(void *raw) { return raw ? static_cast<Stream *>(raw) : default_stream(); }

void synchronize_all() {
    // Held throughout: a stream still in the set is not closed, so its worker cannot free it.
    std::lock_guard<std::mutex> lock(g_streams_mutex);
    for (Stream *stream : g_streams) stream->synchronize();
}

}  // namespace mf::host
