# The Cython layer's module-level state, all of it, declared here and nowhere else. Each is
# touched only with the GIL held.

# Backend names to the C enum (select_backend).
cdef dict _BACKENDS = {"host": MF_BACKEND_HOST, "cuda": MF_BACKEND_CUDA, "simt": MF_BACKEND_SIMT}
cdef dict _BACKEND_NAMES = {v: k for k, v in _BACKENDS.items()}

# Pinned memory owned by a PinnedBuffer: free_host_pinned refuses it, since the object still
# hands out views of it (its close() is the one way to free it).
cdef set _object_pinned = set()

# Foreign host buffers held for async copies and readbacks: {key: _HeldBuffer}, each released by a
# callback queued behind its copy on the copy's stream (commit_hold, _release_hold), so a buffer
# is given back as soon as the stream has passed the copy (docs/lifetimes.md, rule 6).
cdef dict _pending_holds = {}
cdef size_t _hold_key = 0

# Foreign arrays (tensors) kept alive for queued kernels: (event, arrays) in call order, with
# their events reused (keep_until_passed, release_kept in _coerce.pxi); a call releases from the
# front while the front has passed, so each costs O(1) amortised.
cdef object _kept = _deque()
cdef list _spare_events = []

# Host functions (_hostfunc.pxi):
# stream handle -> the last host function's sequence number on it (launched, run or not).
cdef dict _host_func_seq = {}
# stream handle -> [(sequence, exception)] of host functions that raised, not yet reported.
cdef dict _host_func_errors = {}
# event handle -> (stream, sequence): the last host function queued on the stream the event was
# recorded on, at the record. Only kept once a host function has been launched.
cdef dict _event_marks = {}

# DLPack imports (_dlpack.pxi):
# Whether a type's __dlpack__ takes max_version (DLPack 1.0 producers); learnt once per type.
cdef dict _takes_max_version = {}
# A type's C-level exporter for CPU memory, or None: torch's __dlpack__ is Python (about 3 us of
# checks for streams and devices that a CPU tensor on the host backend does not need) around the
# exporter that makes the same capsule. Learnt once per type.
cdef dict _cpu_exporters = {}

# SAMPLING_PARAMS_DTYPE, loaded on the first host params (fill_params): importing it needs numpy.
cdef object _params_dtype = None

# Rows the last argmax launched into each feed-cell array, by address: the default from_row bound
# of the resolve that reads them (launch order is stream order for one stream). One owner, these
# three functions: a write moves its cells to the end (least recently written first), the table
# keeps the CELL_ROWS_KEPT most recent, and a free forgets every address inside the freed range
# (interior cell pointers too), so a new allocation at a freed address never inherits a stale
# default and nothing grows per call. A resolve of forgotten cells needs prev_rows (ValueError).
cdef dict _cell_rows = {}
CELL_ROWS_KEPT = 4096


cdef inline void note_cell_rows(size_t cells, uint32_t rows):
    _cell_rows.pop(cells, None)
    _cell_rows[cells] = rows
    if len(_cell_rows) > CELL_ROWS_KEPT:
        del _cell_rows[next(iter(_cell_rows))]


cdef inline object cell_rows_of(size_t cells):
    return _cell_rows.get(cells)


cdef void forget_cell_rows(size_t ptr, size_t nbytes):
    _cell_rows.pop(ptr, None)
    if _cell_rows:  # interior pointers: few entries in practice, at most CELL_ROWS_KEPT
        for cells in [c for c in _cell_rows if ptr < c < ptr + nbytes]:
            del _cell_rows[cells]


def _cell_rows_len():
    """How many feed-cell addresses the resolve default remembers (for tests)."""
    return len(_cell_rows)

# Graphs capturing, by stream handle: {stream: weak reference to the Graph}. The objects each
# operation queued on a capturing stream names (buffers, events) are kept by its Graph, so garbage
# collection cannot free memory a replay reads or writes (see note_capture). Weak: a capture
# object dropped unended ends (discards) its capture as it dies (Graph.__dealloc__).
cdef dict _capturing = {}

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
    _kept.clear()
    del _spare_events[:]
    _host_func_seq.clear()
    _host_func_errors.clear()
    _event_marks.clear()
    _capturing.clear()  # the C layer drops the parent's captures in the child too
    _pending_holds.clear()  # the parent's copies: nothing of them runs here


_os.register_at_fork(after_in_child=_forget_parent_events)
