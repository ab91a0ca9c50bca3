"""The exceptions of metrale_feed (docs/design.md, "The error model")."""

from __future__ import annotations

__all__ = ["FeedError", "CudaError", "NoDeviceTokenFeed", "KvPoolExhausted"]


class FeedError(RuntimeError):
    """Base of every error the package raises for a failed operation or an unusable handle.

    Catch it to handle any failure of the feed; bad arguments raise ``ValueError`` or ``TypeError``
    instead, before anything is queued (docs/design.md, "The error model").

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

    def __init__(self, message: str, code: int = 0, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name


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
