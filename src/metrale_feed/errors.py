"""The exceptions of metrale_feed (docs/design.md, "The error model")."""

from __future__ import annotations

__all__ = ["FeedError", "CudaError", "InvalidHandleError", "FeedMemoryError", "InjectedFault",
           "BackendUnavailable", "DeviceError", "CaptureError", "InternalError",
           "NoDeviceTokenFeed", "KvPoolExhausted"]


class FeedError(RuntimeError):
    """Base of every error the package raises for a failed operation or an unusable handle.

    Catch it to handle any failure of the feed; bad arguments raise ``ValueError`` or ``TypeError``
    instead, before anything is queued (docs/design.md, "The error model"). A failed call of the C
    layer raises the subclass of its status (``status`` holds the ``mf_status`` value), so a
    caller can tell faults apart without reading messages.

    Attributes
    ----------
    status : int or None
        The C layer's ``mf_status`` this class stands for (None: the base, and errors raised by
        the Python layers themselves).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> ev = mf.Event(); ev.close()
    >>> try:
    ...     ev.record(0)
    ... except mf.FeedError as error:
    ...     print(error)
    the event is closed
    """

    status: int | None = None


class CudaError(FeedError):
    """The CUDA runtime failed.

    Parameters
    ----------
    message : str
    code : int, optional
        The ``cudaError_t`` value.
    name : str, optional
        Its enumerator, e.g. ``"cudaErrorNoDevice"``.

    Attributes
    ----------
    code : int
    name : str

    Examples
    --------
    >>> import metrale_feed as mf
    >>> try:
    ...     mf.set_backend("cuda")
    ... except mf.CudaError as error:     # a build with CUDA, on a machine without a usable GPU
    ...     print(error.name)             # doctest: +SKIP
    ... except mf.FeedError:              # a build without the CUDA backend
    ...     pass
    ... else:
    ...     mf.set_backend("host")
    """

    status = 4  # MF_ERROR_CUDA

    def __init__(self, message: str, code: int = 0, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class InvalidHandleError(FeedError):
    """A destroyed, freed or unknown handle or pointer (``MF_ERROR_INVALID_HANDLE``).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> handle = mf.event_create(); mf.destroy_event(handle)
    >>> try:
    ...     mf.event_query(handle)
    ... except mf.InvalidHandleError as error:
    ...     print(error.status)
    2
    """

    status = 2


class FeedMemoryError(FeedError, MemoryError):
    """Out of memory (``MF_ERROR_OUT_OF_MEMORY``): a page-locked or device allocation, or the C
    layer's own bookkeeping while queueing, failed. Nothing was queued. It is a ``MemoryError``
    too, so code that handles running out of memory in general catches it.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> issubclass(mf.FeedMemoryError, MemoryError) and issubclass(mf.FeedMemoryError, mf.FeedError)
    True
    """

    status = 3


class InjectedFault(FeedError):
    """A host-backend fault knob fired (``MF_ERROR_INJECTED``; ``configure_host``).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.configure_host(fail_alloc_at=1)
    >>> try:
    ...     mf.alloc_host_pinned(64)
    ... except mf.InjectedFault as error:
    ...     print(error.status)
    5
    >>> mf.configure_host()
    """

    status = 5


class BackendUnavailable(FeedError):
    """The backend or feature is not there (``MF_ERROR_UNAVAILABLE``): not compiled in, no usable
    device, or a fork()ed child of a process that used CUDA.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> try:
    ...     mf.set_backend("cuda")
    ... except mf.BackendUnavailable:   # a build without the CUDA backend
    ...     pass
    ... except mf.CudaError:            # doctest: +SKIP
    ...     pass
    ... else:
    ...     mf.set_backend("host")
    """

    status = 6


class DeviceError(FeedError):
    """Queued work failed (``MF_ERROR_DEVICE``, an asynchronous error).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.DeviceError.status
    7
    """

    status = 7


class HostFunctionError(DeviceError):
    """A host function queued with ``launch_host_func`` raised: queued work failed, as a kernel
    fault would. It is reported once, at the next wait or query of its stream or of an event
    recorded there after it; the function's own exception is its ``__cause__``. A scheduler
    treats it as a fault of the work queued before that wait, never as a refusal to retry.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Stream() as stream:
    ...     mf.launch_host_func(stream, int, "not a number")
    ...     try:
    ...         stream.synchronize()
    ...     except mf.HostFunctionError as error:
    ...         print(type(error.__cause__).__name__, isinstance(error, mf.DeviceError))
    ValueError True
    """


class CaptureError(FeedError):
    """Not allowed on a stream that is capturing a graph, or a capture in the wrong state
    (``MF_ERROR_CAPTURE``; docs/graphs.md).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Stream() as stream:
    ...     try:
    ...         with mf.graph_capture(stream):
    ...             mf.stream_synchronize(stream)
    ...     except mf.CaptureError as error:
    ...         print(error.status)
    8
    """

    status = 8


class InternalError(FeedError):
    """A defect of the C layer caught at its boundary (``MF_ERROR_INTERNAL``): an unexpected C++
    exception, turned into a status instead of ending the process. Please report it.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.InternalError.status
    9
    """

    status = 9


# mf_status -> the class raise_status (_errors.pxi) raises; MF_ERROR_INVALID_VALUE is ValueError.
STATUS_ERRORS: dict[int, type[FeedError]] = {
    cls.status: cls
    for cls in (InvalidHandleError, FeedMemoryError, CudaError, InjectedFault, BackendUnavailable,
                DeviceError, CaptureError, InternalError)
    if cls.status is not None
}


class NoDeviceTokenFeed(FeedError, NotImplementedError):
    """A ``ModelDeviceFeed`` method the model does not implement (the trait's error default).

    Its message is ``"<method>: this model has no device token feed"``.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> class Plain(mf.ModelDeviceFeed):
    ...     pass
    >>> try:
    ...     Plain().alloc_host_pinned(64)
    ... except mf.NoDeviceTokenFeed as error:
    ...     print(error)
    alloc_host_pinned: this model has no device token feed
    """


class KvPoolExhausted(FeedError):
    """The KV block pool has no free block (``BlockPool.alloc``, ``reserve_decode_block``).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> pool = mf.BlockPool(1); _ = pool.alloc()
    >>> try:
    ...     pool.alloc()
    ... except mf.KvPoolExhausted as error:
    ...     print(error)
    the KV block pool is exhausted (1 blocks in use)
    """
