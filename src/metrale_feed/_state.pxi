# The Cython layer's module-level state, all of it, declared here and nowhere else. Each is
# touched only with the GIL held.

# Backend names to the C enum (select_backend).
cdef dict _BACKENDS = {"host": MF_BACKEND_HOST, "cuda": MF_BACKEND_CUDA, "simt": MF_BACKEND_SIMT}
cdef dict _BACKEND_NAMES = {v: k for k, v in _BACKENDS.items()}

# Pinned memory owned by a PinnedBuffer: free_host_pinned refuses it, since the object still
# hands out views of it (its close() is the one way to free it).
cdef set _object_pinned = set()

# Foreign host buffers held for async copies and readbacks: {key: _HeldBuffer}, each released by a
# callback queued behind its copy on the copy's stream (hold_until_passed, _release_hold), so a buffer
# is given back as soon as the stream has passed the copy (docs/lifetimes.md, rule 6).
cdef dict _pending_holds = {}
cdef size_t _hold_key = 0

# Foreign arrays (tensors) kept alive for queued kernels: (event, arrays) in call order, with
# their events reused (keep_until_passed, release_kept in _launch.pxi); a call releases from the
# front while the front has passed, so each costs O(1) amortised.
cdef object _kept = _deque()
cdef list _spare_events = []

# What this layer keeps per stream, one _StreamState per stream handle that needs any (one that
# never ran a host function, captured or failed has none, so the hot paths test one dict): its
# capturing graph, its host functions' count and their unreported exceptions. The one owner of
# per-stream state; _streams is touched only through the functions below it.
cdef dict _streams = {}
cdef Py_ssize_t _failures = 0  # exceptions kept in all the states, so a wait tests one int


@cython.final
cdef class _StreamState:
    # A weak reference to the Graph capturing the stream through graph_capture, or None. Weak: a
    # capture object dropped unended ends (discards) its capture as it dies (Graph.__dealloc__).
    cdef object graph
    # The last host function's sequence number launched on the stream (run or not), or None:
    # none was launched, or the stream was closed.
    cdef object seq
    # [(sequence, exception)] of host functions that raised, not yet reported (_hostfunc.pxi).
    cdef list failed

    cdef int fail(self, object seq, object exc) except -1:
        global _failures
        if self.failed is None:
            self.failed = []
        self.failed.append((seq, exc))
        _failures += 1
        return 0

    cdef object take_failure(self, object upto):
        """The first exception of a host function numbered at most ``upto`` (any when None),
        removed; or None."""
        global _failures
        if self.failed:
            for i in range(len(self.failed)):
                seq, exc = self.failed[i]
                if upto is None or seq <= upto:
                    del self.failed[i]
                    _failures -= 1
                    return exc
        return None

    cdef list take_failures(self):
        global _failures
        failed, self.failed = self.failed or [], None
        _failures -= len(failed)
        return failed


cdef inline _StreamState stream_state(uint64_t stream):
    """The stream's state, or None when it has none (one dict test when no stream has any)."""
    if not _streams:
        return None
    return _streams.get(stream)


cdef _StreamState stream_state_made(uint64_t stream):
    cdef _StreamState st = _streams.get(stream)
    if st is None:
        st = _StreamState.__new__(_StreamState)
        _streams[stream] = st
    return st


cdef int stream_state_trim(uint64_t stream) except -1:
    """Drop the stream's state once it holds nothing."""
    cdef _StreamState st = stream_state(stream)
    if st is not None and st.graph is None and st.seq is None and not st.failed:
        del _streams[stream]
    return 0

# event handle -> (stream, sequence): the last host function queued on the stream the event was
# recorded on, at the record (_hostfunc.pxi). Only kept once a host function has been launched.
cdef dict _event_marks = {}

# DLPack imports (_dlpack.pxi):
# Whether a type's __dlpack__ takes max_version (DLPack 1.0 producers); learnt once per type.
cdef dict _takes_max_version = {}
# A type's C-level exporter for CPU memory, or None: torch's __dlpack__ is Python (about 3 us of
# checks for streams and devices that a CPU tensor on the host backend does not need) around the
# exporter that makes the same capsule. Learnt once per type.
cdef dict _cpu_exporters = {}
# Whether a type's arrays are read through the buffer protocol on the host backend (numpy's
# ndarray: takes_buffer_import). Learnt once per type.
cdef dict _buffer_imports = {}

# SAMPLING_PARAMS_DTYPE, loaded on the first host params (fill_params): importing it needs numpy.
cdef object _params_dtype = None

# What the last launch wrote into each feed-cell array, by address: the rows of an argmax (an
# int), or the (rows, k) of a verify_to_feed (a tuple). It gives the default bounds of the resolve
# that reads them (resolve_feed's prev_rows, resolve_verified's rows and k; launch order is stream
# order for one stream). One owner, these functions, and one writer, _Launch.queued: a write moves
# its cells to the end (least recently written first), the table keeps the CELL_ROWS_KEPT most
# recent, and a free forgets every address inside the freed range (interior cell pointers too),
# so a new allocation at a freed address never inherits a stale default and nothing grows per
# call. A resolve of forgotten cells needs its bounds given (ValueError).
cdef dict _cell_rows = {}
CELL_ROWS_KEPT = 4096


cdef inline void note_cell_rows(size_t cells, object shape):
    _cell_rows.pop(cells, None)
    _cell_rows[cells] = shape
    if len(_cell_rows) > CELL_ROWS_KEPT:
        del _cell_rows[next(iter(_cell_rows))]


cdef inline object cell_rows_of(size_t cells):
    """The rows an argmax last wrote into ``cells``, or None (none, or a verify wrote last)."""
    shape = _cell_rows.get(cells)
    return shape if type(shape) is not tuple else None


cdef inline object verify_shape_of(size_t cells):
    """The (rows, k) a verify_to_feed last wrote into ``cells``, or None."""
    shape = _cell_rows.get(cells)
    return shape if type(shape) is tuple else None


cdef void forget_cell_rows(size_t ptr, size_t nbytes):
    _cell_rows.pop(ptr, None)
    if _cell_rows:  # interior pointers: few entries in practice, at most CELL_ROWS_KEPT
        for cells in [c for c in _cell_rows if ptr < c < ptr + nbytes]:
            del _cell_rows[cells]


def _cell_rows_len():
    """How many feed-cell addresses the resolve defaults remember (for tests)."""
    return len(_cell_rows)

# Set at interpreter exit (atexit runs before modules are torn down): from then on a buffer
# collected is not freed (on cuda a free waits for the device, and exit never waits;
# docs/host-backend.md, "Exit"). The process's end returns the memory.
cdef bint _exiting = False


def _note_exit():
    global _exiting
    _exiting = True
    # Buffers still held for queued copies are never given back: a worker may still write them
    # while the interpreter tears the module down (their release callbacks are skipped, see
    # _mark_exiting). The process's end returns the memory.
    Py_INCREF(_pending_holds)


_atexit.register(_note_exit)


def _forget_parent_events():
    # A fork()ed child: the parent's events are not this process's (they raise FeedError), so
    # drop them unused instead of recycling them; the arrays they guarded are the parent's work.
    global _failures
    _kept.clear()
    del _spare_events[:]
    _streams.clear()  # the C layer drops the parent's captures in the child too
    _failures = 0
    _event_marks.clear()
    _pending_holds.clear()  # the parent's copies: nothing of them runs here


_os.register_at_fork(after_in_child=_forget_parent_events)
