// The cuda backend: mf::Ops over the CUDA runtime (linked statically). Arguments arrive checked
// (api.cpp); this layer only maps flags, calls the runtime and reports its errors.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "registry.hpp"
#include "cuda/graph.hpp"
#include "cuda/kernels.hpp"
#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/logprob_rule.h"

namespace mf {
namespace {

cudaStream_t as_stream(void *raw) { return static_cast<cudaStream_t>(raw); }
cudaEvent_t as_event(void *raw) { return static_cast<cudaEvent_t>(raw); }

// A failed runtime call also sits in the runtime's last-error slot; clear it there, or the next
// launch check (cudaGetLastError) would report it again as a launch failure.
mf_status cuda_fail(cudaError_t code, const char *what) {
    (void)cudaGetLastError();
    return fail_cuda((int)code, what);
}

#define MF_CUDA_TRY(call, what)                                     \
    do {                                                            \
        cudaError_t mf_err_ = (call);                               \
        if (mf_err_ != cudaSuccess) return cuda_fail(mf_err_, what); \
    } while (0)

// ---- SM count per device, cached: argmax consults it on every call ----

constexpr int kMaxCachedDevices = 64;
std::atomic<int> g_sm_count[kMaxCachedDevices];

mf_status sm_count(int device, int *out) {
    if (device >= 0 && device < kMaxCachedDevices) {
        *out = g_sm_count[device].load(std::memory_order_relaxed);
        if (*out > 0) return MF_SUCCESS;
    }
    MF_CUDA_TRY(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, device),
                "cudaDeviceGetAttribute");
    if (device >= 0 && device < kMaxCachedDevices) g_sm_count[device].store(*out);
    return MF_SUCCESS;
}

// ---- per-stream scratch of the split argmax ----
// A CUDA graph captured on a stream bakes in that stream's scratch: replay it on the capture
// stream (or serialised with it), never concurrently with other argmax launches on that stream.
// Kernels on one stream run in order, so one scratch per stream is race-free. It is sized for the
// device's worst plan, so it is allocated once, on the first split launch on that stream: that
// launch is not graph-capturable (warm up each stream before capture). The per-thread default
// stream is a different stream in each thread, hence the thread in the key.

struct ScratchKey {
    int device;
    uintptr_t stream;
    std::thread::id thread;
    bool operator<(const ScratchKey &o) const {
        return std::tie(device, stream, thread) < std::tie(o.device, o.stream, o.thread);
    }
};

std::mutex g_scratch_mu;
// Never destroyed: freeing device memory during static destruction can outlive the driver.
std::map<ScratchKey, void *> &scratch_map() {
    static auto *m = new std::map<ScratchKey, void *>();
    return *m;
}

cudak::ArgmaxScratch scratch_view(void *base, int sms) {
    auto *partials = static_cast<unsigned long long *>(base);
    auto *counters =
        reinterpret_cast<unsigned int *>(partials + cudak::argmax_scratch_partials(sms));
    return cudak::ArgmaxScratch{partials, counters};
}

mf_status scratch_for(int device, cudaStream_t stream, int sms, cudak::ArgmaxScratch *out) {
    ScratchKey key{device, reinterpret_cast<uintptr_t>(stream), std::thread::id()};
    if (stream == cudaStreamPerThread) key.thread = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(g_scratch_mu);
    auto it = scratch_map().find(key);
    if (it != scratch_map().end()) {
        *out = scratch_view(it->second, sms);
        return MF_SUCCESS;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MF_CUDA_TRY(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone)
        return fail(MF_ERROR_INVALID_VALUE,
                    "argmax_to_feed: the first few-row launch on a stream allocates its scratch "
                    "and cannot be captured; run one launch on this stream before capturing");
    const size_t partial_bytes = cudak::argmax_scratch_partials(sms) * sizeof(unsigned long long);
    const size_t counter_bytes = cudak::argmax_scratch_counters(sms) * sizeof(unsigned int);
    void *base = nullptr;
    MF_CUDA_TRY(cudaMalloc(&base, partial_bytes + counter_bytes), "cudaMalloc");
    // Zero the counters in this stream's order, so they are zero before its first launch even
    // on a non-blocking stream; partials need no initial value.
    cudaError_t e = cudaMemsetAsync(static_cast<char *>(base) + partial_bytes, 0, counter_bytes,
                                    stream);
    if (e != cudaSuccess) {
        cudaFree(base);
        return cuda_fail(e, "cudaMemsetAsync(argmax scratch)");
    }
    try {
        scratch_map().emplace(key, base);
    } catch (...) {  // no exception may cross the C ABI
        cudaFree(base);
        return fail(MF_ERROR_OUT_OF_MEMORY, "argmax_to_feed: out of host memory");
    }
    *out = scratch_view(base, sms);
    return MF_SUCCESS;
}

// Called before a stream is destroyed: its queued kernels may still use the scratch, so wait for
// them (only streams that ran a split argmax have any) and free it.
void scratch_release(cudaStream_t stream) {
    std::vector<void *> bases;
    {
        std::lock_guard<std::mutex> lock(g_scratch_mu);
        auto &m = scratch_map();
        for (auto it = m.begin(); it != m.end();) {
            if (it->first.stream == reinterpret_cast<uintptr_t>(stream)) {
                bases.push_back(it->second);
                it = m.erase(it);
            } else {
                ++it;
            }
        }
    }
    if (bases.empty()) return;
    (void)cudaStreamSynchronize(stream);  // a failure there is the stream's own, reported elsewhere
    for (void *b : bases) (void)cudaFree(b);
    (void)cudaGetLastError();
}

// ---- the table ----

mf_status init() {
    int n = 0;
    MF_CUDA_TRY(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    if (n <= 0) return fail_cuda((int)cudaErrorNoDevice, "cudaGetDeviceCount: no CUDA device");
    // Creates the context and loads a kernel: a device this build has no image for fails here,
    // not at the first launch.
    MF_CUDA_TRY(cudak::kernels_loadable(), "loading the metrale_feed kernels for this device");
    return MF_SUCCESS;
}

mf_status device_count(int *count) {
    MF_CUDA_TRY(cudaGetDeviceCount(count), "cudaGetDeviceCount");
    return MF_SUCCESS;
}

mf_status device_name(int device, char *buf, size_t buflen) {
    cudaDeviceProp prop;
    MF_CUDA_TRY(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    if (buflen > 0) std::snprintf(buf, buflen, "%s", prop.name);
    return MF_SUCCESS;
}

mf_status driver_version(int *version) {
    MF_CUDA_TRY(cudaDriverGetVersion(version), "cudaDriverGetVersion");
    return MF_SUCCESS;
}

mf_status event_create(unsigned flags, void **raw) {
    unsigned f = (flags & MF_EVENT_TIMING) ? cudaEventDefault : cudaEventDisableTiming;
    if (flags & MF_EVENT_BLOCKING) f |= cudaEventBlockingSync;
    cudaEvent_t ev = nullptr;
    MF_CUDA_TRY(cudaEventCreateWithFlags(&ev, f), "cudaEventCreateWithFlags");
    *raw = ev;
    return MF_SUCCESS;
}

mf_status event_destroy(void *raw) {
    MF_CUDA_TRY(cudaEventDestroy(as_event(raw)), "cudaEventDestroy");
    return MF_SUCCESS;
}

mf_status event_record(void *raw, mf_stream_t stream) {
    const auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
    bool captured = false;
    mf_status st = cudag::event_record_in_capture(as_event(raw), s, &captured);
    if (st != MF_SUCCESS || captured) return st;
    MF_CUDA_TRY(cudaEventRecord(as_event(raw), s), "cudaEventRecord");
    return MF_SUCCESS;
}

mf_status event_query(void *raw, int *done) {
    cudaError_t e = cudaEventQuery(as_event(raw));
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();  // "not ready" is an answer, not an error to keep around
        *done = 0;
        return MF_SUCCESS;
    }
    if (e != cudaSuccess) return cuda_fail(e, "cudaEventQuery");
    *done = 1;
    return MF_SUCCESS;
}

mf_status event_synchronize(void *raw) {
    MF_CUDA_TRY(cudaEventSynchronize(as_event(raw)), "cudaEventSynchronize");
    return MF_SUCCESS;
}

// A slice of a wait, polled: a blocking CUDA wait cannot be interrupted for a signal. The poll
// backs off to 200 us, so a long wait costs little CPU and ends within a slice of its work.
template <typename Query>
mf_status poll_for(uint32_t timeout_us, int *done, Query query) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
    uint32_t nap = 5;
    for (;;) {
        mf_status status = query(done);
        if (status != MF_SUCCESS || *done) return status;
        if (std::chrono::steady_clock::now() >= deadline) return MF_SUCCESS;
        std::this_thread::sleep_for(std::chrono::microseconds(nap));
        if (nap < 200) nap *= 2;
    }
}

mf_status event_wait(void *raw, uint32_t timeout_us, uint64_t *mark, int *done) {
    *mark = 1;  // cudaEventQuery answers for the latest record
    return poll_for(timeout_us, done, [raw](int *d) { return event_query(raw, d); });
}

mf_status event_elapsed_ms(void *start, void *end, float *ms) {
    MF_CUDA_TRY(cudaEventElapsedTime(ms, as_event(start), as_event(end)), "cudaEventElapsedTime");
    return MF_SUCCESS;
}

mf_status stream_create(unsigned flags, void **raw) {
    cudaStream_t s = nullptr;
    const unsigned f = (flags & MF_STREAM_NON_BLOCKING) ? cudaStreamNonBlocking : cudaStreamDefault;
    MF_CUDA_TRY(cudaStreamCreateWithFlags(&s, f), "cudaStreamCreateWithFlags");
    *raw = s;
    return MF_SUCCESS;
}

mf_status stream_destroy(void *raw) {
    scratch_release(as_stream(raw));
    MF_CUDA_TRY(cudaStreamDestroy(as_stream(raw)), "cudaStreamDestroy");
    return MF_SUCCESS;
}

mf_status stream_query(void *raw, int *idle) {
    cudaError_t e = cudaStreamQuery(as_stream(raw));
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        *idle = 0;
        return MF_SUCCESS;
    }
    if (e != cudaSuccess) return cuda_fail(e, "cudaStreamQuery");
    *idle = 1;
    return MF_SUCCESS;
}

mf_status stream_synchronize(void *raw) {
    MF_CUDA_TRY(cudaStreamSynchronize(as_stream(raw)), "cudaStreamSynchronize");
    return MF_SUCCESS;
}

mf_status stream_wait(void *raw, uint32_t timeout_us, uint64_t *mark, int *done);

mf_status stream_wait_event(void *raw, void *event_raw) {
    MF_CUDA_TRY(cudaStreamWaitEvent(as_stream(raw), as_event(event_raw), 0), "cudaStreamWaitEvent");
    return MF_SUCCESS;
}

mf_status host_alloc(size_t nbytes, unsigned flags, void **out) {
    unsigned f = cudaHostAllocDefault;
    if (flags & MF_HOST_PORTABLE) f |= cudaHostAllocPortable;
    if (flags & MF_HOST_MAPPED) f |= cudaHostAllocMapped;
    if (flags & MF_HOST_WRITE_COMBINED) f |= cudaHostAllocWriteCombined;
    void *p = nullptr;
    MF_CUDA_TRY(cudaHostAlloc(&p, nbytes, f), "cudaHostAlloc");
    std::memset(p, 0, nbytes);  // host memory: a plain memset, no device work
    *out = p;
    return MF_SUCCESS;
}

// ---- frees made inside a host function ----
// CUDA forbids runtime calls in a host function (a cudaFree there may deadlock or fail), yet a
// host function can free: Python code closing a buffer, or a collection that runs there and
// frees a cycle holding one. Such a free goes to the reaper, a thread that frees in its place,
// and the host function returns at once. The memory left the ledger at the free (alloc_erase),
// so nothing queued later can name it; the reaper's cudaFree waits for the device's queued
// work, as a free made anywhere else does. Started by the first host function launched (never
// inside one: a thread the OS refuses is a status there, and nothing is queued).

thread_local bool t_in_host_func = false;  // this thread is running a host function of ours

struct Reaped {
    void *ptr;
    bool pinned;
};
struct Reaper {
    std::mutex mutex;
    std::condition_variable work;
    std::vector<Reaped> queue;  // capacity reserved ahead, so a push in a host function cannot throw
    bool started = false;
};
Reaper &reaper() {  // never destroyed: a host function may free while the process exits
    static Reaper *instance = new Reaper;
    return *instance;
}

void free_now(void *ptr, bool pinned) {
    alloc_released(ptr);  // out of the ledger (alloc_erase kept it counted until now)
    if (pinned) {
        (void)cudaFreeHost(ptr);
    } else {
        // The reaper's current device may not be the allocation's.
        cudaPointerAttributes attributes{};
        if (cudaPointerGetAttributes(&attributes, ptr) == cudaSuccess && attributes.device >= 0)
            (void)cudaSetDevice(attributes.device);
        (void)cudaFree(ptr);
    }
    (void)cudaGetLastError();  // no caller to report to: the free's owner has returned
}

void reap() {
    Reaper &r = reaper();
    std::vector<Reaped> batch;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(r.mutex);
            r.work.wait(lock, [&r] { return !r.queue.empty(); });
            batch.swap(r.queue);
            r.queue.reserve(batch.capacity());
        }
        for (const Reaped &one : batch) free_now(one.ptr, one.pinned);
        batch.clear();
    }
}

// Outside host functions only (it may start a thread, and throws when the OS refuses one).
void reaper_start() {
    Reaper &r = reaper();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.started) return;
    if (r.queue.capacity() == 0) r.queue.reserve(64);
    std::thread(reap).detach();
    r.started = true;
}

// True when the free was handed to the reaper: called inside a host function.
bool reaped(void *ptr, bool pinned) {
    if (!t_in_host_func) return false;
    Reaper &r = reaper();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        r.queue.push_back(Reaped{ptr, pinned});  // past the reserve only when frees pile up
    }
    r.work.notify_one();
    return true;
}

mf_status host_free(void *ptr) {
    if (reaped(ptr, true)) return MF_SUCCESS;
    alloc_released(ptr);  // out of the ledger (alloc_erase kept it counted until now)
    MF_CUDA_TRY(cudaFreeHost(ptr), "cudaFreeHost");
    return MF_SUCCESS;
}

mf_status device_alloc(size_t nbytes, void **out) {
    void *p = nullptr;
    MF_CUDA_TRY(cudaMalloc(&p, nbytes), "cudaMalloc");
    *out = p;
    return MF_SUCCESS;
}

mf_status device_free(void *ptr) {
    if (reaped(ptr, false)) return MF_SUCCESS;
    alloc_released(ptr);  // as host_free's
    MF_CUDA_TRY(cudaFree(ptr), "cudaFree");
    return MF_SUCCESS;
}

mf_status memset_async(void *dev, int value, size_t nbytes, void *stream) {
    MF_CUDA_TRY(cudaMemsetAsync(dev, value, nbytes, as_stream(stream)), "cudaMemsetAsync");
    return MF_SUCCESS;
}

mf_status copy_async(void *dst, const void *src, size_t nbytes, CopyKind kind, void *stream) {
    const cudaMemcpyKind k = kind == kD2H   ? cudaMemcpyDeviceToHost
                             : kind == kH2D ? cudaMemcpyHostToDevice
                                            : cudaMemcpyDeviceToDevice;
    MF_CUDA_TRY(cudaMemcpyAsync(dst, src, nbytes, k, as_stream(stream)), "cudaMemcpyAsync");
    return MF_SUCCESS;
}

mf_status pick(const mf_argmax_args *a, void *stream);

// The id of each row, then (logprobs, or a partial call's records) each row's (m, s) after it; a
// partial call without MF_ARGS_PARTIAL_LOGPROBS gets its records and header there, without (m, s).
mf_status argmax(const mf_argmax_args *a, void *stream) {
    if (a->rows == 0) return MF_SUCCESS;
    mf_status st = MF_SUCCESS;
    if (a->flags & MF_ARGS_SELECT)  // a stage of the split filters (select_feed.cu)
        MF_CUDA_TRY(cudak::launch_select_stage(*a, as_stream(stream)), "launching mf_select_stage_kernel");
    else
        st = pick(a, stream);
    if (st == MF_SUCCESS && (a->logprobs || (a->flags & MF_ARGS_PARTIAL)) && cudak::stage_has_records(*a))
        MF_CUDA_TRY(cudak::launch_logprob_stats(*a, as_stream(stream)), "launching mf_logprob_stats_kernel");
    return st;
}

mf_status combine(const mf_combine_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_combine(*a, as_stream(stream)), "launching mf_combine_kernel");
    return MF_SUCCESS;
}

mf_status pick(const mf_argmax_args *a, void *stream) {
    if (a->params) {  // the same descriptor; the sampler's own kernel reads the same rule
        MF_CUDA_TRY(cudak::launch_sample(*a, as_stream(stream)), "launching mf_sample_kernel");
        return MF_SUCCESS;
    }
    const uintptr_t esize = mf_dtype_size(a->dtype);
    if (reinterpret_cast<uintptr_t>(a->logits) % esize != 0)
        return fail(MF_ERROR_INVALID_VALUE,
                    "argmax_to_feed: logits pointer %p is not aligned to its %u-byte elements",
                    a->logits, (unsigned)esize);
    int device = 0, sms = 0;
    MF_CUDA_TRY(cudaGetDevice(&device), "cudaGetDevice");
    mf_status st = sm_count(device, &sms);
    if (st != MF_SUCCESS) return st;
    const cudak::ArgmaxPlan plan = cudak::argmax_plan(a->rows, a->vocab, a->dtype, sms);
    cudak::ArgmaxScratch scratch{nullptr, nullptr};
    if (plan.splits > 1) {
        if ((uint64_t)a->rows * plan.splits > cudak::argmax_scratch_partials(sms) ||
            a->rows > cudak::argmax_scratch_counters(sms))
            return fail(MF_ERROR_INVALID_VALUE, "argmax_to_feed: split plan exceeds its scratch");
        st = scratch_for(device, as_stream(stream), sms, &scratch);
        if (st != MF_SUCCESS) return st;
    }
    MF_CUDA_TRY(cudak::launch_argmax(*a, plan, scratch, as_stream(stream)),
                "launching mf_argmax_kernel");
    return MF_SUCCESS;
}

mf_status resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                  uint32_t *out, bool sources_on_device, void *stream) {
    if (n == 0) return MF_SUCCESS;
    MF_CUDA_TRY(cudak::launch_resolve(sources, n, cells, prev_rows, out, sources_on_device,
                                      as_stream(stream)),
                "launching mf_resolve_kernel");
    return MF_SUCCESS;
}

mf_status reference_forward(const mf_reference_args *a, void *stream) {
    if (a->rows == 0) return MF_SUCCESS;
    MF_CUDA_TRY(cudak::launch_reference(*a, as_stream(stream)), "launching mf_reference_kernel");
    return MF_SUCCESS;
}

mf_status verify(const mf_verify_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_verify(*a, as_stream(stream)), "launching mf_verify_kernel");
    return MF_SUCCESS;
}

mf_status penalties(const mf_penalty_args *a, bool update, void *stream) {
    MF_CUDA_TRY(cudak::launch_penalties(*a, update, as_stream(stream)),
                update ? "launching mf_penalty_update_kernel" : "launching mf_penalty_apply_kernel");
    return MF_SUCCESS;
}

mf_status top_logprobs(const mf_top_logprobs_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_top_logprobs(*a, as_stream(stream)), "launching mf_top_logprobs_kernel");
    return MF_SUCCESS;
}

mf_status top_combine(const mf_top_combine_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_top_combine(*a, as_stream(stream)), "launching mf_top_combine_kernel");
    return MF_SUCCESS;
}

mf_status select_decide(const mf_select_decide_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_select_decide(*a, as_stream(stream)), "launching mf_select_decide_kernel");
    return MF_SUCCESS;
}

mf_status grammar_mask(const mf_grammar_mask_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_grammar_mask(*a, as_stream(stream)), "launching mf_grammar_mask_kernel");
    return MF_SUCCESS;
}

mf_status grammar_advance(const mf_grammar_advance_args *a, void *stream) {
    MF_CUDA_TRY(cudak::launch_grammar_advance(*a, as_stream(stream)), "launching mf_grammar_advance_kernel");
    return MF_SUCCESS;
}

mf_status resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                           uint32_t *out_advance, void *stream) {
    MF_CUDA_TRY(cudak::launch_resolve_verified(cells, rows, k, out_ids, out_advance, as_stream(stream)),
                "launching mf_resolve_verified_kernel");
    return MF_SUCCESS;
}

mf_status verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                              mf_sampling_params *out, void *stream) {
    MF_CUDA_TRY(cudak::launch_verify_logit_params(params, advance, rows, k, out, as_stream(stream)),
                "launching mf_verify_logit_params_kernel");
    return MF_SUCCESS;
}

mf_status stream_wait(void *raw, uint32_t timeout_us, uint64_t *mark, int *done) {
    *mark = 1;  // cudaStreamQuery answers for all work queued so far
    return poll_for(timeout_us, done, [raw](int *d) { return stream_query(raw, d); });
}

mf_status current_device(int *device) {
    MF_CUDA_TRY(cudaGetDevice(device), "cudaGetDevice");
    return MF_SUCCESS;
}

// The runtime calls the host function on one of its own threads once the stream reaches it.
// It runs through run_host_call, which marks the thread, so that a free it makes goes to the
// reaper instead of calling CUDA there. A call captured into a graph runs at each launch: the
// graph owns it (a user object, deleted with the last graph that holds it); otherwise it runs
// once and deletes itself.
struct HostCall {
    mf_host_fn fn;
    void *data;
    bool once;
};

void CUDART_CB run_host_call(void *raw) {
    HostCall *call = static_cast<HostCall *>(raw);
    bool outer = t_in_host_func;
    t_in_host_func = true;
    call->fn(call->data);
    t_in_host_func = outer;
    if (call->once) delete call;
}

void CUDART_CB delete_host_call(void *raw) { delete static_cast<HostCall *>(raw); }

mf_status launch_host_func(mf_host_fn fn, void *data, void *stream) {
    reaper_start();  // before anything is queued: a refused thread leaves nothing behind
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    MF_CUDA_TRY(cudaStreamGetCaptureInfo(as_stream(stream), &capture, nullptr, &graph),
                "cudaStreamGetCaptureInfo");
    bool captured = capture == cudaStreamCaptureStatusActive;
    HostCall *call = new HostCall{fn, data, !captured};
    if (captured) {
        cudaUserObject_t object;
        cudaError_t e = cudaUserObjectCreate(&object, call, delete_host_call, 1, cudaUserObjectNoDestructorSync);
        if (e != cudaSuccess) {
            delete call;
            return cuda_fail(e, "cudaUserObjectCreate");
        }
        // The graph takes the reference: it deletes the call when the last graph goes.
        e = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
        if (e != cudaSuccess) {
            (void)cudaUserObjectRelease(object, 1);  // deletes the call
            return cuda_fail(e, "cudaGraphRetainUserObject");
        }
    }
    cudaError_t e = cudaLaunchHostFunc(as_stream(stream), run_host_call, call);
    if (e != cudaSuccess) {
        if (!captured) delete call;  // a captured one is the graph's, deleted with it
        return cuda_fail(e, "cudaLaunchHostFunc");
    }
    return MF_SUCCESS;
}

}  // namespace

extern const Ops cuda_ops;
const Ops cuda_ops = {
    .name = "cuda",
    .init = init,
    .device_count = device_count,
    .device_name = device_name,
    .driver_version = driver_version,
    .event_create = event_create,
    .event_destroy = event_destroy,
    .event_record = event_record,
    .event_query = event_query,
    .event_synchronize = event_synchronize,
    .event_elapsed_ms = event_elapsed_ms,
    .event_wait = event_wait,
    .stream_create = stream_create,
    .stream_destroy = stream_destroy,
    .stream_query = stream_query,
    .stream_synchronize = stream_synchronize,
    .stream_wait_event = stream_wait_event,
    .stream_wait = stream_wait,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .device_alloc = device_alloc,
    .device_free = device_free,
    .memset_async = memset_async,
    .copy_async = copy_async,
    .argmax = argmax,
    .resolve = resolve,
    .reference_forward = reference_forward,
    .launch_host_func = launch_host_func,
    .current_device = current_device,
    .combine = combine,
    .verify = verify,
    .resolve_verified = resolve_verified,
    .verify_logit_params = verify_logit_params,
    .penalties = penalties,
    .argmax_penalised = nullptr,  // the kernels' order: apply, pick, update
    .verify_penalised = nullptr,  // the kernels' order: apply, verify, update
    .top_logprobs = top_logprobs,
    .top_combine = top_combine,
    .select_decide = select_decide,
    .grammar_mask = grammar_mask,
    .grammar_advance = grammar_advance,
    .capture_begin = cudag::capture_begin,
    .capture_status = cudag::capture_status,
    .capture_end = cudag::capture_end,
    .graph_launch = cudag::graph_launch,
    .graph_destroy = cudag::graph_destroy,
    .capture_keep = nullptr,
    // None: the pieces of a call are queued by the runtime, none after a failure of ours
    // (docs/host-backend.md, "A refused call queued nothing").
    .stage_open = nullptr,
    .stage_close = nullptr,
};

}  // namespace mf
