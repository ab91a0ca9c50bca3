// A small pool so one kernel's rows use every core: the stream worker that runs the kernel works
// too, and helpers take slices of rows from a shared counter.
#include <algorithm>
#include <memory>
#include <system_error>

#include "queue.hpp"

namespace mf::host {
namespace {

struct Job {
    const std::function<void(uint32_t, uint32_t)> *fn;
    uint32_t rows, grain;
    std::atomic<uint32_t> next{0}, finished{0};
    std::mutex mutex;
    std::condition_variable all_done;

    void work() {
        for (;;) {
            uint32_t begin = next.fetch_add(grain, std::memory_order_relaxed);
            if (begin >= rows) return;
            uint32_t end = std::min(rows, begin + grain);
            (*fn)(begin, end);
            if (finished.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == rows) {
                std::lock_guard<std::mutex> lock(mutex);
                all_done.notify_all();
            }
        }
    }
};

class Pool {
public:
    Pool() {
        unsigned cores = std::max(1u, std::thread::hardware_concurrency());
        helpers_ = 0;
        try {
            for (unsigned i = 0; i + 1 < cores; ++i, ++helpers_) std::thread(&Pool::serve, this).detach();
        } catch (const std::system_error &) {
            // The OS refused a thread: the kernels run on the helpers there are (or on the worker).
        }
    }
    unsigned helpers() const { return helpers_; }
    void post(const std::shared_ptr<Job> &job, unsigned helpers) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (unsigned i = 0; i < helpers; ++i) jobs_.push_back(job);
        }
        wake_.notify_all();
    }

private:
    void serve() {
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return !jobs_.empty(); });
                job = std::move(jobs_.front());
                jobs_.pop_front();
            }
            job->work();
        }
    }
    unsigned helpers_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<std::shared_ptr<Job>> jobs_;
};

// Helpers are detached and live for the process. A fork()ed child has none of them: it starts a
// new pool on first use and leaves the parent's behind.
std::mutex g_pool_mutex;
std::atomic<Pool *> g_pool{nullptr};

Pool &pool() {
    Pool *p = g_pool.load(std::memory_order_acquire);
    if (p) return *p;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    p = g_pool.load(std::memory_order_relaxed);
    if (!p) {
        p = new Pool();
        g_pool.store(p, std::memory_order_release);
    }
    return *p;
}


std::atomic<unsigned> g_threads{0};  // 0: every core

}  // namespace

void pool_before_fork() { g_pool_mutex.lock(); }
void pool_after_fork(bool child) {
    if (child) g_pool.store(nullptr, std::memory_order_relaxed);
    g_pool_mutex.unlock();
}

void set_kernel_threads(unsigned threads) { g_threads.store(threads, std::memory_order_relaxed); }

unsigned kernel_threads() {
    unsigned cores = pool().helpers() + 1, wanted = g_threads.load(std::memory_order_relaxed);
    return wanted == 0 || wanted > cores ? cores : wanted;
}

void parallel_rows(uint32_t rows, const std::function<void(uint32_t, uint32_t)> &fn) {
    Pool &p = pool();
    unsigned helpers = kernel_threads() - 1;
    if (rows <= 1 || helpers == 0) {
        if (rows) fn(0, rows);
        return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->rows = rows;
    // Slices small enough to balance the cores, large enough that the counter is not contended.
    job->grain = std::max(1u, rows / ((helpers + 1) * 4));
    p.post(job, helpers);
    job->work();
    std::unique_lock<std::mutex> lock(job->mutex);
    job->all_done.wait(lock, [&] { return job->finished.load(std::memory_order_acquire) == rows; });
}

}  // namespace mf::host
