// The cuda backend's graphs: the runtime's stream capture, instantiated into an executable graph.
// Relaxed capture mode: the capturing thread may still allocate (a relaxed capture records no
// such call), another thread may end the capture, and other threads are never restricted, as on
// the host backend. The calls that would break a capture (a synchronize, query or wait of the
// capturing stream, host-side inputs) are refused before they reach the runtime (api_graph.cpp).
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/graph.hpp"

namespace mf::cudag {
namespace {
cudaStream_t as_stream(void *raw) { return static_cast<cudaStream_t>(raw); }

mf_status cuda_fail(cudaError_t code, const char *what) {
    (void)cudaGetLastError();  // as cuda_backend.cpp: the next launch check must not see it again
    return fail_cuda((int)code, what);
}
}  // namespace

mf_status capture_begin(void *stream) {
    cudaError_t e = cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeRelaxed);
    return e == cudaSuccess ? MF_SUCCESS : cuda_fail(e, "cudaStreamBeginCapture");
}

mf_status capture_status(void *stream, int *capturing) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(as_stream(stream), &status);
    if (e != cudaSuccess) return cuda_fail(e, "cudaStreamIsCapturing");
    // An invalidated capture still has to be ended: it counts as capturing.
    *capturing = status != cudaStreamCaptureStatusNone;
    return MF_SUCCESS;
}

mf_status capture_end(void *stream, void **out) {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(as_stream(stream), &graph);  // ends it, even when invalid
    if (e != cudaSuccess) {
        if (graph) (void)cudaGraphDestroy(graph);
        return cuda_fail(e, "cudaStreamEndCapture");
    }
    if (!out) {
        e = cudaGraphDestroy(graph);
        return e == cudaSuccess ? MF_SUCCESS : cuda_fail(e, "cudaGraphDestroy");
    }
    cudaGraphExec_t exec = nullptr;
    e = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);  // the executable graph keeps what it needs
    if (e != cudaSuccess) return cuda_fail(e, "cudaGraphInstantiate");
    *out = exec;
    return MF_SUCCESS;
}

mf_status graph_launch(void *graph, void *stream, mf_stream_t) {
    cudaError_t e = cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), as_stream(stream));
    return e == cudaSuccess ? MF_SUCCESS : cuda_fail(e, "cudaGraphLaunch");
}

mf_status graph_destroy(void *graph) {
    cudaError_t e = cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
    return e == cudaSuccess ? MF_SUCCESS : cuda_fail(e, "cudaGraphExecDestroy");
}

mf_status event_record_in_capture(cudaEvent_t event, cudaStream_t stream, bool *done) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    *done = false;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return MF_SUCCESS;  // the plain record reports the stream's trouble
    }
    if (status != cudaStreamCaptureStatusActive) return MF_SUCCESS;
    // External: an event record node, recorded at each launch and visible outside the graph
    // (a plain record in a capture only orders streams within it).
    cudaError_t e = cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal);
    if (e != cudaSuccess) return cuda_fail(e, "cudaEventRecordWithFlags(external)");
    *done = true;
    return MF_SUCCESS;
}

}  // namespace mf::cudag
