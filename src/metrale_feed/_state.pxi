# The Cython layer's module-level state, all of it, declared here and nowhere else. Each is
# touched only with the GIL held.

# Backend names to the C enum (select_backend).
cdef dict _BACKENDS = {"host": MF_BACKEND_HOST, "cuda": MF_BACKEND_CUDA}

# Pinned memory owned by a PinnedBuffer: free_host_pinned refuses it, since the object still
# hands out views of it (its close() is the one way to free it).
cdef set _object_pinned = set()

# Foreign host buffers held for async copies, per stream: {stream: deque of (event, _HeldBuffer)}.
# Work on one stream completes in order, so only each queue's head needs asking (see
# release_passed): a copy costs O(1), however many are outstanding.
cdef dict _held = {}

# Rows the last argmax launched into each feed-cell array, by address: the default from_row bound
# of the resolve that reads them (launch order is stream order for one stream).
cdef dict _cell_rows = {}

# Graphs capturing, by stream handle: {stream: Graph}. The objects each operation queued on a
# capturing stream names (buffers, events) are kept by its Graph, so garbage collection cannot
# free memory a replay reads or writes (see note_capture).
cdef dict _capturing = {}

# Set at interpreter exit (atexit runs before modules are torn down): from then on a buffer
# collected is not freed, since a free waits for queued work and exit never does
# (docs/host-backend.md, "Exit"). The process's end returns the memory.
cdef bint _exiting = False


def _note_exit():
    global _exiting
    _exiting = True


_atexit.register(_note_exit)
