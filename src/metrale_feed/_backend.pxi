# Backend selection, build facts, host fault knobs, leak counters, NVTX.

def select_backend(str name):
    """Make ``name`` the active backend (``metrale_feed.set_backend`` calls this).

    Parameters
    ----------
    name : {"host", "cuda", "simt"}
        ``simt`` is the host backend's runtime with the CUDA kernels run on the CPU.

    Raises
    ------
    ValueError
        An unknown name.
    CudaError
        The cuda backend is unusable; the message says why (no driver, no device, ...).
    FeedError
        This build has no CUDA backend, or events, streams or memory are still live.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}: use 'host', 'cuda' or 'simt'")
    # The keep-alive events of foreign arrays whose work has passed are this module's, not the
    # caller's: give them back first, as live_objects() does, or they alone refuse the switch.
    release_passed()
    drop_spare_events()
    check(mf_select_backend(<mf_backend>_BACKENDS[name]))


def backend():
    """The active backend.

    Returns
    -------
    {"cuda", "host", "simt"}

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.backend() in ("cuda", "host", "simt")
    True
    """
    return _BACKEND_NAMES[mf_active_backend()]


_SIMT_ORDERS = ("in-order", "reversed", "random")


def configure_simt(*, sm_count=132, order="in-order", seed=0, threads=1):
    """Set the simt executor's settings; each call sets every one (the defaults restore them).

    Parameters
    ----------
    sm_count : int
        The SM count the launch planning sees (1 to 1024; 132, an H200's, by default). With few SMs
        a few-row argmax already splits its rows, so the split path and its last-block combine run
        at small shapes.
    order : {"in-order", "reversed", "random"}
        The order in which a launch's blocks run.
    seed : int
        The seed of the random order.
    threads : int
        OS threads that run a launch's blocks at once (1 to 64; 1 runs them on the stream's worker):
        more than one makes blocks meet in atomics and the last-block combine for real.

    Raises
    ------
    ValueError
        A setting out of range.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.configure_simt(sm_count=4, order="random", seed=7)
    >>> mf.simt_config()["sm_count"]
    4
    >>> mf.configure_simt()
    """
    cdef mf_simt_config c
    if order not in _SIMT_ORDERS:
        raise ValueError(f"order must be one of {_SIMT_ORDERS}, not {order!r}")
    for name, value, low, high in (("sm_count", sm_count, 1, 1024), ("threads", threads, 1, 64),
                                   ("seed", seed, 0, 2**64 - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an int from {low} to {high}, not {value!r}")
    c.sm_count = sm_count
    c.order = _SIMT_ORDERS.index(order)
    c.seed = seed
    c.threads = threads
    check(mf_simt_configure(&c))


def simt_config():
    """The simt executor's settings in force (see ``configure_simt``), with its counters.

    Returns
    -------
    dict
        ``sm_count``, ``order``, ``seed``, ``threads``; ``counters``: launches, blocks, threads,
        fiber switches, barriers and shuffles run since the process started; ``kernels``: launches
        per kernel (its name as the launch site wrote it).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> sorted(mf.simt_config()["counters"])
    ['barriers', 'blocks', 'launches', 'shuffles', 'switches', 'threads']
    """
    cdef mf_simt_config c
    cdef uint64_t n[6]
    mf_simt_config_get(&c)
    mf_simt_counters(n)
    need = mf_simt_kernel_launches(NULL, 0)
    text = bytearray(need + 1)
    mf_simt_kernel_launches(text, need + 1)
    kernels = {}
    for line in text[:need].decode().splitlines():
        name, _, count = line.rpartition("=")
        kernels[name] = int(count)
    return {"sm_count": c.sm_count, "order": _SIMT_ORDERS[c.order], "seed": c.seed, "threads": c.threads,
            "counters": dict(zip(("launches", "blocks", "threads", "switches", "barriers", "shuffles"),
                                 [n[i] for i in range(6)])),
            "kernels": kernels}


def _simt_selftest(str which):
    """Run a test-only kernel that breaks a CUDA rule: (caught, message); "" lists the kernels."""
    cdef char message[1024]
    cdef bytes name = which.encode()
    caught = mf_simt_selftest(name, message, sizeof(message))
    return caught, message.decode(errors="replace")


def build_info():
    """What this build of the extension contains.

    Returns
    -------
    dict
        ``cuda`` (bool: the CUDA backend was built), ``cuda_version`` (the toolkit's "major.minor",
        or None), ``architectures`` (``sm_NN`` for SASS, ``compute_NN`` for PTX) and ``nvtx``.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> sorted(mf.build_info())
    ['architectures', 'cuda', 'cuda_version', 'nvtx']
    """
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
    """Names of the active backend's CUDA devices.

    Returns
    -------
    list of str
        Empty on the host backend.

    Raises
    ------
    CudaError
        The runtime could not list the devices.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.devices() if mf.backend() == "host" else []
    []
    """
    cdef int count = 0
    cdef char name[256]
    check(mf_device_count(&count))
    result = []
    for i in range(count):
        check(mf_device_name(i, name, sizeof(name)))
        result.append(name.decode("utf-8", "replace"))
    return result


def driver_version():
    """The CUDA version the installed driver supports, as CUDA encodes it (12020 is 12.2).

    Returns
    -------
    int
        0 on the host backend.

    Raises
    ------
    CudaError
        The runtime could not ask the driver.
    """
    cdef int version = 0
    check(mf_driver_version(&version))
    return version


def configure_host(*, lag_us=0, fail_event_query_at=0, fail_alloc_at=0, fail_copy_at=0,
                   fail_synchronize_at=0, fail_event_create_at=0):
    """Set the host backend's fault knobs; each call sets every knob (0 is off).

    Parameters
    ----------
    lag_us : int, optional
        Delay every queued host-backend operation by this many microseconds (at most 10 s), so
        asynchronous results arrive late, as on a busy GPU.
    fail_event_query_at, fail_alloc_at, fail_copy_at, fail_synchronize_at : int, optional
        Make the Nth such call from now fail with a ``FeedError``.
    fail_event_create_at : int, optional
        Make the Nth event creation from now fail; it counts the binding's own events too (those
        that hold a buffer for a copy), so it stands for a full event table.

    Raises
    ------
    ValueError
        A negative value, or ``lag_us`` above 10 s.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.configure_host(lag_us=1000)
    >>> mf.host_faults()["lag_us"]
    1000
    >>> mf.configure_host()   # everything off again
    """
    cdef mf_host_faults faults
    faults.lag_us = <uint32_t>int_of(lag_us, "lag_us", 0, 10_000_000)  # at most 10 s
    faults.fail_event_query_at = int_of(fail_event_query_at, "fail_event_query_at", 0, UINT64_MAX)
    faults.fail_alloc_at = int_of(fail_alloc_at, "fail_alloc_at", 0, UINT64_MAX)
    faults.fail_copy_at = int_of(fail_copy_at, "fail_copy_at", 0, UINT64_MAX)
    faults.fail_synchronize_at = int_of(fail_synchronize_at, "fail_synchronize_at", 0, UINT64_MAX)
    faults.fail_event_create_at = int_of(fail_event_create_at, "fail_event_create_at", 0, UINT64_MAX)
    mf_host_configure(&faults)


def host_faults():
    """The host backend's fault knobs in force (see ``configure_host``).

    Returns
    -------
    dict
        ``lag_us``, ``fail_event_query_at``, ``fail_alloc_at``, ``fail_copy_at``,
        ``fail_synchronize_at``.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.host_faults()["fail_alloc_at"]
    0
    """
    cdef mf_host_faults f
    mf_host_faults_get(&f)
    return {"lag_us": f.lag_us, "fail_event_query_at": f.fail_event_query_at,
            "fail_alloc_at": f.fail_alloc_at, "fail_copy_at": f.fail_copy_at,
            "fail_synchronize_at": f.fail_synchronize_at,
            "fail_event_create_at": f.fail_event_create_at}


def host_kernel_threads(threads=None):
    """Get or set the threads a host-backend kernel uses (the stream's worker included).

    Parameters
    ----------
    threads : int, optional
        The count to use, 0 for every core (at most 1024); None only reads it.

    Returns
    -------
    int
        The count in force.

    Raises
    ------
    ValueError
        ``threads`` outside 0..1024.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.host_kernel_threads(1)   # a simulated device of one core
    1
    >>> _ = mf.host_kernel_threads(0)
    """
    if threads is not None:
        mf_host_set_kernel_threads(<unsigned>int_of(threads, "threads", 0, 1024))
    return mf_host_kernel_threads()


def host_argmax_path(portable=None):
    """Get or force the host argmax's code path; both paths follow the same rule.

    Parameters
    ----------
    portable : bool, optional
        True forces the portable path, False restores the best one (AVX2 where the CPU has it);
        None only reads it.

    Returns
    -------
    {"avx2", "portable"}
        The path in force.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.host_argmax_path(True)
    'portable'
    >>> _ = mf.host_argmax_path(False)
    """
    return mf_host_argmax_isa(-1 if portable is None else (1 if portable else 0)).decode()


_HOST_FLOORS = {"hash": 1, "race": 2, "stats": 3, "top_p": 4, "top_p_log": 5}


def _host_floor(str which, logits):
    """Bench-only: run feed.h's mf_host_floor loop ``which`` (a key of _HOST_FLOORS) over a C-contiguous
    2-D float32 host array, on the host kernel threads; returns its checksum (None: no such loop on
    this CPU)."""
    what = _HOST_FLOORS.get(which)
    if what is None:
        raise ValueError(f"no floor {which!r}: one of {sorted(_HOST_FLOORS)}")
    cdef _HeldBuffer held = host_buffer_of(logits, False, "logits")
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 2 or held.view.len != 4 * shape[0] * shape[1]:
        raise ValueError("logits must be a 2-D float32 array")
    cdef uint32_t rows = shape[0], vocab = shape[1]
    cdef unsigned w = what
    cdef const float *p = <const float *>held.view.buf
    cdef double out
    with nogil:
        out = mf_host_floor(w, p, rows, vocab)
    return None if out != out else out  # NaN: no such loop here


def live_objects():
    """Counts of live events, streams, pinned and device bytes, for leak checks.

    Returns
    -------
    dict
        ``events``, ``streams``, ``graphs``, ``pinned_bytes``, ``device_bytes``.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> before = mf.live_objects()
    >>> with mf.Event():
    ...     mf.live_objects()["events"] == before["events"] + 1
    True
    """
    cdef uint64_t events, streams, pinned, device
    release_passed()
    drop_spare_events()
    mf_live_counts(&events, &streams, &pinned, &device)
    return {"events": events, "streams": streams, "graphs": mf_live_graphs(), "pinned_bytes": pinned,
            "device_bytes": device}


@cython.final
cdef class nvtx_range:
    """A context manager that marks a range in the ``metrale_feed`` NVTX domain.

    Profilers (Nsight Systems) show it beside the package's own ranges; with no profiler attached it
    costs one flag test.

    Parameters
    ----------
    name : str
        The range's label.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.nvtx_range("schedule"):
    ...     pass
    """
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
