// A small pool so one kernel's rows use every core: the stream worker that runs the kernel works
// too, and helpers take slices of rows from a shared counter.
#include <algorithm>
#include <memory>

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
        helpers_ = cores - 1;
        for (unsigned i = 0; i < helpers_; ++i) std::thread(&Pool::serve, this).detach();
    }
    unsigned helpers() const { return helpers_; }
    void post(const std::shared_ptr<Job> &job) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (unsigned i = 0; i < helpers_; ++i) jobs_.push_back(job);
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

Pool &pool() {
    static Pool *instance = new Pool();  // helpers are detached and live for the process
    return *instance;
}

}  // namespace

void parallel_rows(uint32_t rows, const std::function<void(uint32_t, uint32_t)> &fn) {
    Pool &p = pool();
    if (rows <= 1 || p.helpers() == 0) {
        if (rows) fn(0, rows);
        return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->rows = rows;
    // Slices small enough to balance the cores, large enough that the counter is not contended.
    job->grain = std::max(1u, rows / ((p.helpers() + 1) * 4));
    p.post(job);
    job->work();
    std::unique_lock<std::mutex> lock(job->mutex);
    job->all_done.wait(lock, [&] { return job->finished.load(std::memory_order_acquire) == rows; });
}

}  // namespace mf::host
