// The simt executor: runs a CUDA grid on the CPU. Each block's threads are cooperative fibers,
// switched only where CUDA makes threads meet (a __syncthreads, a warp shuffle), so a kernel runs
// as written, with its real barriers, shuffles, shared memory and atomics. It is stricter than a
// GPU: a barrier that not every live thread of the block reaches, or a shuffle whose mask names a
// lane that does not arrive, is a fault naming the kernel and the line, never a silent pass.
//
// Blocks run in order, reversed or in a seeded random order (a setting), on one thread or on
// several at once (the parallel mode), so arrival counters, __threadfence and last-block combines
// meet real concurrency. Shared memory is thread_local storage of the executing OS thread: every
// fiber of a block runs on that thread, and blocks that run at the same time run on different ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace mf::simt {

struct Dim {
    unsigned x, y, z;
};

// The executor's settings (mf_simt_configure). order: 0 in order, 1 reversed, 2 seeded random.
struct Config {
    int sm_count = 132;  // what the launch planning sees (an H200's)
    int order = 0;
    uint64_t seed = 0;
    int threads = 1;  // OS threads that run blocks at once (1: the calling thread alone)
};
Config config();
void configure(const Config &c);

// Counters since the process started (the tests and the bench read them).
struct Counters {
    uint64_t launches, blocks, threads, switches, barriers, shuffles;
};
Counters counters();
// Launches per kernel (its name as the launch wrote it, e.g. "mf_argmax_kernel<E, MaxRows>"),
// as "name=count" lines.
std::string kernel_launches();

// The thread and block the calling fiber is; valid only inside a kernel.
struct Where {
    Dim thread, block, block_dim, grid_dim;
};
extern thread_local Where tl_where;

// The collectives (the shim's __syncthreads and __shfl_*_sync expand to these).
enum ShuffleKind { kIdx = 0, kXor = 1, kUp = 2, kDown = 3 };
void syncthreads(const char *file, int line);
uint64_t shuffle(ShuffleKind kind, uint32_t mask, uint64_t bits, int arg, int width, const char *file,
                 int line);

// One launch: the grid and block shape, and what each thread runs (body(ctx)).
struct Launch {
    const char *kernel;
    const char *file;
    int line;
    Dim grid, block;
    size_t shared_bytes;
};
// Runs the whole grid before returning; 0, or an error code with last_fault() saying why.
int run_grid(const Launch &launch, void (*body)(void *), void *ctx);
// The message of the calling thread's last fault ("" when none); take_fault() also clears it.
std::string take_fault();
int peek_fault();

// The launcher the shim's MF_LAUNCH expands to: kernel(args...) on every thread of the grid, the
// arguments converted to the kernel's parameter types once, as a CUDA launch copies them.
template <class... P>
struct Launcher {
    Launch launch;
    void (*kernel)(P...);
    template <class... A>
    void operator()(A &&...args) const {
        static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
        struct Ctx {
            void (*kernel)(P...);
            std::tuple<std::decay_t<P>...> params;
        } ctx{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
        run_grid(launch, [](void *c) {
            Ctx &k = *static_cast<Ctx *>(c);
            std::apply(k.kernel, k.params);
        }, &ctx);
    }
};

template <class... P>
Launcher<P...> launcher(const char *kernel, const char *file, int line, Dim grid, Dim block,
                        size_t shared_bytes, void (*fn)(P...)) {
    return Launcher<P...>{Launch{kernel, file, line, grid, block, shared_bytes}, fn};
}

// A fault the test-only kernels provoke on purpose (selftest.cpp): 0 when the executor caught
// nothing, else 1 with the message in `message`.
int selftest(const char *which, std::string *message);

}  // namespace mf::simt
