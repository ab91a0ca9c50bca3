// The host backend's graphs (graph.cpp): a capture keeps the public calls made on its stream, a
// launch re-issues them on the launch stream.
#pragma once

#include "../backend.hpp"

namespace mf::host {

mf_status capture_begin(void *stream);
mf_status capture_status(void *stream, int *capturing);
mf_status capture_end(void *stream, void **graph);
mf_status graph_launch(void *graph, void *stream, mf_stream_t handle);
mf_status graph_destroy(void *graph);
bool capture_keep(void *stream, Replay &&replay);

}  // namespace mf::host
