# Backend selection, build facts, host fault knobs, leak counters, NVTX.

cdef dict _BACKENDS = {"host": MF_BACKEND_HOST, "cuda": MF_BACKEND_CUDA}


def select_backend(str name):
    """Make ``name`` ("host" or "cuda") the active backend; a CudaError says why cuda is unusable."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}: use 'host' or 'cuda'")
    check(mf_select_backend(<mf_backend>_BACKENDS[name]))


def backend():
    """The active backend: "cuda" or "host"."""
    return "cuda" if mf_active_backend() == MF_BACKEND_CUDA else "host"


def build_info():
    cdef int version = mf_build_cuda_version()
    # CMake's list: "NN-real" is SASS only, "NN" is SASS and PTX, "NN-virtual" PTX only.
    architectures = []
    for arch in filter(None, mf_build_cuda_archs().decode().split(",")):
        number, _, kind = arch.partition("-")
        if kind != "virtual":
            architectures.append(f"sm_{number}")
        if kind != "real":
            architectures.append(f"compute_{number}")
    return {
        "cuda": bool(mf_build_has_cuda()),
        "cuda_version": f"{version // 1000}.{version % 1000 // 10}" if version else None,
        "architectures": architectures,
        "nvtx": bool(mf_build_has_nvtx()),
    }


def devices():
    """Names of the active backend's CUDA devices (empty on the host backend)."""
    cdef int count = 0
    cdef char name[256]
    check(mf_device_count(&count))
    result = []
    for i in range(count):
        check(mf_device_name(i, name, sizeof(name)))
        result.append(name.decode("utf-8", "replace"))
    return result


def driver_version():
    cdef int version = 0
    check(mf_driver_version(&version))
    return version


def configure_host(*, lag_us=0, fail_event_query_at=0, fail_alloc_at=0, fail_copy_at=0,
                   fail_synchronize_at=0):
    """Host-backend fault knobs; 0 is off, N makes the Nth such call from now fail with a
    FeedError, ``lag_us`` delays every queued operation. Each call sets every knob."""
    cdef mf_host_faults faults
    faults.lag_us = <uint32_t>int_of(lag_us, "lag_us", 0, 10_000_000)  # at most 10 s
    faults.fail_event_query_at = int_of(fail_event_query_at, "fail_event_query_at", 0, UINT64_MAX)
    faults.fail_alloc_at = int_of(fail_alloc_at, "fail_alloc_at", 0, UINT64_MAX)
    faults.fail_copy_at = int_of(fail_copy_at, "fail_copy_at", 0, UINT64_MAX)
    faults.fail_synchronize_at = int_of(fail_synchronize_at, "fail_synchronize_at", 0, UINT64_MAX)
    mf_host_configure(&faults)


def host_faults():
    cdef mf_host_faults f
    mf_host_faults_get(&f)
    return {"lag_us": f.lag_us, "fail_event_query_at": f.fail_event_query_at,
            "fail_alloc_at": f.fail_alloc_at, "fail_copy_at": f.fail_copy_at,
            "fail_synchronize_at": f.fail_synchronize_at}


def host_kernel_threads(threads=None):
    """Threads a host-backend kernel uses (the stream worker included); set with an int, 0 for
    every core. Returns the value in force."""
    if threads is not None:
        mf_host_set_kernel_threads(<unsigned>int_of(threads, "threads", 0, 1024))
    return mf_host_kernel_threads()


def host_argmax_path(portable=None):
    """The host argmax's code path ("avx2" or "portable"); ``portable=True`` forces the portable
    one (both follow the same rule), False restores the best. Returns the path in force."""
    return mf_host_argmax_isa(-1 if portable is None else (1 if portable else 0)).decode()


def live_objects():
    """Counts of live events, streams, pinned and device bytes, for leak checks."""
    cdef uint64_t events, streams, pinned, device
    release_passed()
    drop_spare_events()
    mf_live_counts(&events, &streams, &pinned, &device)
    return {"events": events, "streams": streams, "pinned_bytes": pinned, "device_bytes": device}


@cython.final
cdef class nvtx_range:
    """``with nvtx_range("step"):`` marks a range in the metrale_feed NVTX domain."""
    cdef bytes _name

    def __cinit__(self, str name):
        self._name = name.encode()

    def __enter__(self):
        mf_nvtx_push(self._name)
        return self

    def __exit__(self, *exc):
        mf_nvtx_pop()


def nvtx_enable(bint on):
    mf_nvtx_enable(on)


def trace_enable(capacity=1 << 20):
    """Record what host-backend workers run (see trace_read), up to ``capacity`` records (at most
    2**24); 0 turns it off. Clears either way."""
    mf_trace_enable(<size_t>int_of(capacity, "capacity", 0, 1 << 24))


def trace_read():
    """Drain the host-backend trace: (records, dropped), each record a tuple
    (name, stream, queued_ns, start_ns, end_ns) on the clock of ``trace_now_ns()``."""
    cdef mf_trace_record chunk[256]
    cdef uint64_t dropped = 0
    cdef size_t n, i
    records = []
    while True:
        n = mf_trace_read(chunk, 256, &dropped)
        for i in range(n):
            records.append((chunk[i].name.decode(), chunk[i].stream, chunk[i].queued_ns,
                            chunk[i].start_ns, chunk[i].end_ns))
        if n < 256:
            return records, dropped


def trace_now_ns():
    """The trace clock (monotonic; the same as time.perf_counter_ns() on Linux)."""
    return mf_trace_now_ns()
