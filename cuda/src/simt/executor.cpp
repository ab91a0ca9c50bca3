// The simt executor (executor.hpp): fibers per block, a scheduler that releases a barrier or a
// shuffle only when CUDA would, and a grid runner over one or several OS threads.
#include "simt/executor.hpp"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <map>
#include <new>
#include <random>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MF_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MF_SIMT_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define MF_SIMT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MF_SIMT_TSAN 1
#endif
#endif
#ifdef MF_SIMT_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
// Under valgrind a fiber's stack must be registered, or every access to it is reported as
// invalid (valgrind sees a stack pointer it does not know). The macros do nothing elsewhere.
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define MF_SIMT_VALGRIND 1
#endif
#endif
#ifdef MF_SIMT_TSAN
#include <sanitizer/tsan_interface.h>
#endif

// The fiber switch. On x86-64 a few instructions that save the callee-saved registers on the
// old stack and restore them from the new one (a kernel's thread switches at every barrier and
// shuffle, so this is the executor's hot path); elsewhere ucontext, which also saves the signal
// mask (a system call per switch).
#if defined(__x86_64__) && defined(__linux__)
#define MF_SIMT_FAST_SWITCH 1
extern "C" void mf_simt_switch(void **save_sp, void *next_sp);
asm(R"(
    .text
    .p2align 4
    .globl mf_simt_switch
    .hidden mf_simt_switch
    .type mf_simt_switch, @function
mf_simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size mf_simt_switch, .-mf_simt_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

namespace mf::simt {

thread_local Where tl_where;

namespace {

std::mutex g_config_mu;
Config g_config;
std::mutex g_names_mu;
std::map<std::string, uint64_t> *g_names = new std::map<std::string, uint64_t>;  // never freed: exit
std::atomic<uint64_t> g_launches{0}, g_blocks{0}, g_threads{0}, g_switches{0}, g_barriers{0}, g_shuffles{0};

constexpr size_t kStackBytes = 256 * 1024;  // kernel parameters are copied onto it (up to 16 KiB)
constexpr unsigned kMaxThreadsPerBlock = 1024;

// A fault found by the scheduler, on the scheduler's own stack (never inside a fiber). It is a
// message and a return value, not a C++ exception: a sanitizer runtime preloaded into Python may
// not intercept throws.
thread_local std::string tl_block_fault;

const char *base_name(const char *path) {
    const char *slash = std::strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// Keeps the fault's message for the launch to report.
void keep_fault(const Launch &l, const char *fmt, va_list ap) {
    char text[768];
    std::vsnprintf(text, sizeof text, fmt, ap);
    char head[256];
    std::snprintf(head, sizeof head, "simt: kernel %s (launched at %s:%d), block (%u, %u, %u): ", l.kernel,
                  base_name(l.file), l.line, tl_where.block.x, tl_where.block.y, tl_where.block.z);
    tl_block_fault = std::string(head) + text;
}

// Keeps the fault's message and returns false, for `return fault(...)` in a bool function.
bool fault(const Launch &l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool fault(const Launch &l, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    keep_fault(l, fmt, ap);
    va_end(ap);
    return false;
}

// The same for a function whose int result is a progress count: returns kFaulted.
constexpr int kFaulted = -1;
int faulted(const Launch &l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int faulted(const Launch &l, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    keep_fault(l, fmt, ap);
    va_end(ap);
    return kFaulted;
}

enum State : uint8_t { kReady, kBarrier, kShuffle, kDone };

// A fiber's saved state while it is switched out: its stack pointer (the registers are on the
// stack), or a ucontext.
struct Context {
#ifdef MF_SIMT_FAST_SWITCH
    void *sp = nullptr;
#else
    ucontext_t uc;
#endif
};

struct Lane {
    Context ctx;
    void *stack = nullptr;
#ifdef MF_SIMT_TSAN
    void *tsan = nullptr;
#endif
    unsigned valgrind_id = 0;  // the stack's registration (valgrind only)
    State state = kDone;
    const char *file = nullptr;
    int line = 0;
    // The shuffle it waits in.
    ShuffleKind kind = kIdx;
    uint32_t mask = 0;
    int arg = 0, width = 32;
    uint64_t value = 0, result = 0;
};

// The fibers of the block that runs on this OS thread (its stacks are kept for the next block).
struct Block {
    std::vector<Lane> lanes;
    unsigned count = 0;    // lanes of this block
    unsigned current = 0;  // the running lane
    Context scheduler;
    const void *scheduler_stack = nullptr;  // its bounds, for AddressSanitizer (filled as lanes start)
    size_t scheduler_stack_size = 0;
#ifdef MF_SIMT_TSAN
    void *tsan_scheduler = nullptr;
#endif
    void (*body)(void *) = nullptr;
    void *ctx = nullptr;

    ~Block() {
        for (Lane &l : lanes) {
            if (!l.stack) continue;
#ifdef MF_SIMT_VALGRIND
            VALGRIND_STACK_DEREGISTER(l.valgrind_id);
#endif
#ifdef MF_SIMT_ASAN
            // Its frames' redzones would outlive it in the shadow and poison the next mapping here.
            __asan_unpoison_memory_region(static_cast<char *>(l.stack) + 4096, kStackBytes - 4096);
#endif
            munmap(l.stack, kStackBytes);
#ifdef MF_SIMT_TSAN
            if (l.tsan) __tsan_destroy_fiber(l.tsan);
#endif
        }
    }
};
thread_local Block tl_block;

// The one switch: saves the running context in `from`, resumes `to`. The sanitizers are told of
// every switch (the stack that runs next, and whether the one left is finished).
void switch_context(Block &b, Context &from, Context &to, const void *to_stack, size_t to_size,
                    bool from_finished, void *tsan_to, bool on_lane) {
    g_switches.fetch_add(1, std::memory_order_relaxed);
#ifdef MF_SIMT_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake, to_stack, to_size);
#else
    (void)to_stack, (void)to_size, (void)from_finished;
#endif
#ifdef MF_SIMT_TSAN
    __tsan_switch_to_fiber(tsan_to, 0);
#else
    (void)tsan_to;
#endif
#ifdef MF_SIMT_FAST_SWITCH
    mf_simt_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
#ifdef MF_SIMT_ASAN
    // Back on `from`'s stack. A lane learns the scheduler's stack here, for its switches back.
    if (on_lane) __sanitizer_finish_switch_fiber(fake, &b.scheduler_stack, &b.scheduler_stack_size);
    else __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)b, (void)on_lane;
#endif
}

void *tsan_fiber(Lane &l) {
#ifdef MF_SIMT_TSAN
    return l.tsan;
#else
    (void)l;
    return nullptr;
#endif
}

void *tsan_scheduler(Block &b) {
#ifdef MF_SIMT_TSAN
    return b.tsan_scheduler;
#else
    (void)b;
    return nullptr;
#endif
}

void to_lane(Block &b, unsigned i) {
    b.current = i;
    tl_where.thread = Dim{i % tl_where.block_dim.x, (i / tl_where.block_dim.x) % tl_where.block_dim.y,
                          i / (tl_where.block_dim.x * tl_where.block_dim.y)};
    Lane &l = b.lanes[i];
    switch_context(b, b.scheduler, l.ctx, static_cast<char *>(l.stack) + 4096, kStackBytes - 4096, false,
                   tsan_fiber(l), false);
}

// From the running lane back to the scheduler (the lane's state says why).
void to_scheduler(Block &b) {
    Lane &l = b.lanes[b.current];
    switch_context(b, l.ctx, b.scheduler, b.scheduler_stack, b.scheduler_stack_size, l.state == kDone,
                   tsan_scheduler(b), true);
}

void lane_main() {
    Block &b = tl_block;
#ifdef MF_SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
    b.body(b.ctx);
    b.lanes[b.current].state = kDone;
    to_scheduler(b);
    std::abort();  // a finished lane is never resumed
}

bool prepare(Block &b, unsigned n) {
    if (b.lanes.size() < n) b.lanes.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        Lane &l = b.lanes[i];
        if (!l.stack) {
            void *p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0);
            if (p == MAP_FAILED) return false;
            mprotect(p, 4096, PROT_NONE);  // a guard page below the stack: an overflow faults
            l.stack = p;
#ifdef MF_SIMT_VALGRIND
            l.valgrind_id = VALGRIND_STACK_REGISTER(static_cast<char *>(p) + 4096, static_cast<char *>(p) + kStackBytes);
#endif
#ifdef MF_SIMT_TSAN
            l.tsan = __tsan_create_fiber(0);
#endif
        }
#ifdef MF_SIMT_ASAN
        // The last block's frames on this stack were never unwound (a finished lane is switched
        // away from, not returned): clear their redzones before the stack is used again.
        __asan_unpoison_memory_region(static_cast<char *>(l.stack) + 4096, kStackBytes - 4096);
#endif
#ifdef MF_SIMT_FAST_SWITCH
        // A fresh stack as mf_simt_switch leaves one: six zero registers below the entry address,
        // placed so that lane_main starts with the stack alignment of a called function.
        void **top = reinterpret_cast<void **>(static_cast<char *>(l.stack) + kStackBytes);
        top[-1] = nullptr;  // lane_main's return address: it never returns
        top[-2] = reinterpret_cast<void *>(&lane_main);
        for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
        l.ctx.sp = top - 8;
#else
        getcontext(&l.ctx.uc);
        l.ctx.uc.uc_stack.ss_sp = l.stack;
        l.ctx.uc.uc_stack.ss_size = kStackBytes;
        l.ctx.uc.uc_link = nullptr;
        makecontext(&l.ctx.uc, lane_main, 0);
#endif
        l.state = kReady;
    }
    b.count = n;
    return true;
}

std::string sites(const Block &b, State s) {
    std::vector<std::pair<const char *, int>> seen;
    for (unsigned i = 0; i < b.count; ++i) {
        const Lane &l = b.lanes[i];
        if (l.state != s) continue;
        std::pair<const char *, int> site{l.file, l.line};
        if (std::find(seen.begin(), seen.end(), site) == seen.end()) seen.push_back(site);
    }
    std::string out;
    for (auto &[file, line] : seen) {
        char one[160];
        std::snprintf(one, sizeof one, "%s%s:%d", out.empty() ? "" : ", ", base_name(file), line);
        out += one;
    }
    return out;
}

int source_lane(const Lane &l, int lane) {
    const int w = l.width, group = lane & ~(w - 1), in = lane - group;
    switch (l.kind) {
    case kIdx: return group + ((l.arg % w) + w) % w;
    case kXor: {
        const int src = lane ^ l.arg;
        return (src & ~(w - 1)) == group ? src : lane;  // outside the lane's segment: its own value
    }
    case kUp: return in - l.arg >= 0 ? lane - l.arg : lane;
    case kDown: return in + l.arg < w ? lane + l.arg : lane;
    }
    return lane;
}

// Releases every shuffle whose lanes have all arrived: 1 when a shuffle was released, 0 when none
// could be, kFaulted on a fault.
int release_shuffles(const Launch &launch, Block &b) {
    int progress = 0;
    for (unsigned w0 = 0; w0 < b.count; w0 += 32) {
        const unsigned size = std::min(32u, b.count - w0);
        for (unsigned i = 0; i < size; ++i) {
            Lane &first = b.lanes[w0 + i];
            if (first.state != kShuffle) continue;
            const uint32_t mask = first.mask;
            if (!(mask >> i & 1u))
                return faulted(launch, "a shuffle at %s:%d in warp %u: lane %u is not in its own mask 0x%08x",
                      base_name(first.file), first.line, w0 / 32, i, mask);
            bool complete = true;
            for (unsigned j = 0; j < 32; ++j) {
                if (!(mask >> j & 1u)) continue;
                if (j >= size)
                    return faulted(launch, "a shuffle at %s:%d in warp %u names lane %u in mask 0x%08x, but the warp "
                          "has %u lanes", base_name(first.file), first.line, w0 / 32, j, mask, size);
                const Lane &other = b.lanes[w0 + j];
                if (other.state == kDone)
                    return faulted(launch, "a shuffle at %s:%d in warp %u names lane %u in mask 0x%08x, which has "
                          "exited", base_name(first.file), first.line, w0 / 32, j, mask);
                if (other.state != kShuffle) {
                    complete = false;
                    continue;
                }
                if (other.mask != mask || other.file != first.file || other.line != first.line)
                    return faulted(launch, "lanes %u and %u of warp %u meet in different shuffles (%s:%d mask 0x%08x, "
                          "%s:%d mask 0x%08x)", i, j, w0 / 32, base_name(first.file), first.line, mask,
                          base_name(other.file), other.line, other.mask);
            }
            if (!complete) continue;
            for (unsigned j = 0; j < 32; ++j) {
                if (!(mask >> j & 1u)) continue;
                Lane &l = b.lanes[w0 + j];
                const int src = source_lane(l, (int)j);
                if (!(mask >> src & 1u))
                    return faulted(launch, "lane %u of warp %u reads lane %d in a shuffle at %s:%d, which its mask "
                          "0x%08x does not name", j, w0 / 32, src, base_name(l.file), l.line, mask);
                l.result = b.lanes[w0 + src].value;
            }
            for (unsigned j = 0; j < 32; ++j)
                if (mask >> j & 1u) b.lanes[w0 + j].state = kReady;
            g_shuffles.fetch_add(1, std::memory_order_relaxed);
            progress = 1;
        }
    }
    return progress;
}

// false on a fault (tl_block_fault says why).
bool run_block(const Launch &launch, Block &b) {
    const unsigned n = launch.block.x * launch.block.y * launch.block.z;
    if (!prepare(b, n)) return fault(launch, "out of memory for the stacks of %u fibers", n);
    unsigned live = n;
    while (true) {
        for (unsigned i = 0; i < n; ++i) {
            if (b.lanes[i].state != kReady) continue;
            to_lane(b, i);
            if (b.lanes[i].state == kDone) --live;
        }
        if (live == 0) return true;
        const int released = release_shuffles(launch, b);
        if (released == kFaulted) return false;
        if (released > 0) continue;
        // Nothing else can move: every live thread must wait in the same barrier.
        unsigned at_barrier = 0;
        const Lane *first = nullptr;
        for (unsigned i = 0; i < n; ++i) {
            const Lane &l = b.lanes[i];
            if (l.state != kBarrier) continue;
            ++at_barrier;
            if (!first) first = &l;
            else if (l.file != first->file || l.line != first->line)
                return fault(launch, "threads of the block wait at different __syncthreads (%s)", sites(b, kBarrier).c_str());
        }
        if (at_barrier != live) {
            if (at_barrier)
                return fault(launch, "__syncthreads at %s is not reached by every live thread of the block: %u of %u "
                      "wait there, the others in shuffles at %s", sites(b, kBarrier).c_str(), at_barrier, live,
                      sites(b, kShuffle).c_str());
            return fault(launch, "the shuffles at %s never complete: a lane their masks name does not arrive",
                  sites(b, kShuffle).c_str());
        }
        for (unsigned i = 0; i < n; ++i)
            if (b.lanes[i].state == kBarrier) b.lanes[i].state = kReady;
        g_barriers.fetch_add(1, std::memory_order_relaxed);
    }
}

thread_local std::string tl_fault;

// The blocks of one launch on this OS thread, taken from `next` in `order`.
void run_blocks(const Launch &launch, void (*body)(void *), void *ctx, const std::vector<uint32_t> &order,
                std::atomic<size_t> &next, std::atomic<bool> &stop, std::mutex &mu, std::string &first_fault) {
    Block &b = tl_block;
#ifdef MF_SIMT_TSAN
    if (!b.tsan_scheduler) b.tsan_scheduler = __tsan_get_current_fiber();
#endif
    b.body = body;
    b.ctx = ctx;
    tl_where.block_dim = launch.block;
    tl_where.grid_dim = launch.grid;
    const unsigned lanes = launch.block.x * launch.block.y * launch.block.z;
    for (size_t k; !stop.load(std::memory_order_relaxed) && (k = next.fetch_add(1)) < order.size();) {
        const uint32_t id = order[k];
        tl_where.block = Dim{id % launch.grid.x, (id / launch.grid.x) % launch.grid.y,
                             id / (launch.grid.x * launch.grid.y)};
        if (!run_block(launch, b)) {
            std::lock_guard<std::mutex> lock(mu);
            if (first_fault.empty()) first_fault = tl_block_fault;
            stop.store(true);
            return;
        }
        g_blocks.fetch_add(1, std::memory_order_relaxed);
        g_threads.fetch_add(lanes, std::memory_order_relaxed);
    }
}

}  // namespace

Config config() {
    std::lock_guard<std::mutex> lock(g_config_mu);
    return g_config;
}

void configure(const Config &c) {
    std::lock_guard<std::mutex> lock(g_config_mu);
    g_config = c;
}

Counters counters() {
    return Counters{g_launches.load(), g_blocks.load(), g_threads.load(), g_switches.load(), g_barriers.load(),
                    g_shuffles.load()};
}

void syncthreads(const char *file, int line) {
    Block &b = tl_block;
    Lane &l = b.lanes[b.current];
    l.state = kBarrier;
    l.file = file;
    l.line = line;
    to_scheduler(b);
}

uint64_t shuffle(ShuffleKind kind, uint32_t mask, uint64_t bits, int arg, int width, const char *file, int line) {
    Block &b = tl_block;
    Lane &l = b.lanes[b.current];
    l.state = kShuffle;
    l.kind = kind;
    l.mask = mask;
    l.value = bits;
    l.arg = arg;
    l.width = (width > 0 && width <= 32 && (width & (width - 1)) == 0) ? width : 32;
    l.file = file;
    l.line = line;
    to_scheduler(b);
    return b.lanes[b.current].result;
}

int run_grid(const Launch &launch, void (*body)(void *), void *ctx) {
    tl_fault.clear();
    g_launches.fetch_add(1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(g_names_mu);
        ++(*g_names)[launch.kernel];
    }
    const uint64_t lanes = (uint64_t)launch.block.x * launch.block.y * launch.block.z;
    const uint64_t blocks = (uint64_t)launch.grid.x * launch.grid.y * launch.grid.z;
    if (lanes == 0 || lanes > kMaxThreadsPerBlock || blocks == 0 || blocks > UINT32_MAX) {
        char text[256];
        std::snprintf(text, sizeof text, "simt: kernel %s (launched at %s:%d): invalid configuration, grid %llu "
                      "blocks of %llu threads", launch.kernel, launch.file, launch.line,
                      (unsigned long long)blocks, (unsigned long long)lanes);
        tl_fault = text;
        return 1;
    }
    const Config c = config();
    std::vector<uint32_t> order(blocks);
    for (uint32_t i = 0; i < blocks; ++i) order[i] = i;
    if (c.order == 1) std::reverse(order.begin(), order.end());
    if (c.order == 2) {
        std::mt19937_64 rng(c.seed ^ (g_launches.load() * 0x9E3779B97F4A7C15ull));
        std::shuffle(order.begin(), order.end(), rng);
    }
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::string first_fault;
    const Where saved = tl_where;  // a launch from inside a kernel's thread (the self-test) keeps it
    const unsigned helpers = (unsigned)std::min<uint64_t>(c.threads > 1 ? c.threads - 1 : 0, blocks - 1);
    std::vector<std::thread> pool;
    try {
        for (unsigned t = 0; t < helpers; ++t)
            pool.emplace_back([&] { run_blocks(launch, body, ctx, order, next, stop, mu, first_fault); });
    } catch (const std::system_error &) {
        // Fewer threads than asked: the blocks still all run, on those that started.
    }
    run_blocks(launch, body, ctx, order, next, stop, mu, first_fault);
    for (std::thread &t : pool) t.join();
    tl_where = saved;
    tl_fault = first_fault;
    return first_fault.empty() ? 0 : 1;
}

std::string kernel_launches() {
    std::lock_guard<std::mutex> lock(g_names_mu);
    std::string out;
    for (const auto &[name, n] : *g_names) out += name + "=" + std::to_string(n) + "\n";
    return out;
}

std::string take_fault() {
    std::string f;
    f.swap(tl_fault);
    return f;
}

int peek_fault() { return tl_fault.empty() ? 0 : 1; }

}  // namespace mf::simt
