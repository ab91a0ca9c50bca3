// The cuda backend's graph entries (graph.cpp), for its Ops table.
#pragma once

#include <cuda_runtime.h>

#include "backend.hpp"

namespace mf::cudag {

mf_status capture_begin(void *stream);
mf_status capture_status(void *stream, int *capturing);
mf_status capture_end(void *stream, void **graph);
mf_status graph_launch(void *graph, void *stream, mf_stream_t handle);
mf_status graph_destroy(void *graph);
// A record on a capturing stream becomes an event record node (*done true); otherwise nothing.
mf_status event_record_in_capture(cudaEvent_t event, cudaStream_t stream, bool *done);

}  // namespace mf::cudag
