"""The exceptions of metrale_feed (docs/design.md, "The error model")."""

from __future__ import annotations

__all__ = ["FeedError", "CudaError", "NoDeviceTokenFeed", "KvPoolExhausted"]


class FeedError(RuntimeError):
    """Base of every error the feed raises for a failed operation or an unusable handle."""


class CudaError(FeedError):
    """The CUDA runtime failed; ``code`` is the ``cudaError_t`` and ``name`` its enumerator."""

    def __init__(self, message: str, code: int = 0, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class NoDeviceTokenFeed(FeedError, NotImplementedError):
    """A ``ModelDeviceFeed`` method the model does not implement (the trait's error default)."""


class KvPoolExhausted(FeedError):
    """The KV block pool has no free block."""
