"""Each mf_status raises its own FeedError subclass through the binding's one error check, so a
caller tells faults apart by type; ``except FeedError`` (and ``except ValueError`` for bad
arguments) still catches them all."""

from __future__ import annotations

import pytest

import metrale_feed as mf
from metrale_feed import _core

# feed.h's mf_status values, written out here: the test is the independent reference.
EXPECTED = {
    1: ValueError,                # MF_ERROR_INVALID_VALUE
    2: mf.InvalidHandleError,     # MF_ERROR_INVALID_HANDLE
    3: mf.FeedMemoryError,        # MF_ERROR_OUT_OF_MEMORY
    4: mf.CudaError,              # MF_ERROR_CUDA
    5: mf.InjectedFault,          # MF_ERROR_INJECTED
    6: mf.BackendUnavailable,     # MF_ERROR_UNAVAILABLE
    7: mf.DeviceError,            # MF_ERROR_DEVICE
    8: mf.CaptureError,           # MF_ERROR_CAPTURE
    9: mf.InternalError,          # MF_ERROR_INTERNAL
}


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_each_status_raises_its_class(status):
    error = _core._status_error(status)
    assert type(error) is EXPECTED[status]
    if status != 1:
        assert isinstance(error, mf.FeedError)  # existing `except FeedError` code keeps working
        assert type(error).status == status


def test_unknown_status_is_the_base_class():
    assert type(_core._status_error(200)) is mf.FeedError


def test_out_of_memory_is_a_memory_error_too():
    assert issubclass(mf.FeedMemoryError, MemoryError) and issubclass(mf.FeedMemoryError, mf.FeedError)
    with pytest.raises(MemoryError):
        mf.alloc_host_pinned(1 << 62)


def test_the_classes_are_exported():
    for cls in set(EXPECTED.values()) - {ValueError}:
        assert getattr(mf, cls.__name__) is cls
        assert cls.__name__ in mf.errors.__all__
        assert cls.__doc__ and "Examples" in cls.__doc__


# The statuses real calls return, on the host backend.

def test_destroyed_handle(host, no_leaks):
    handle = mf.event_create()
    mf.destroy_event(handle)
    with pytest.raises(mf.InvalidHandleError, match="destroyed"):
        mf.event_query(handle)


def test_injected_fault(host, no_leaks):
    host.configure_host(fail_alloc_at=1)
    with pytest.raises(mf.InjectedFault, match="fault injected"):
        mf.alloc_host_pinned(64)


def test_pinned_allocation_too_large(host, no_leaks):
    with pytest.raises(mf.FeedMemoryError):
        mf.alloc_host_pinned(1 << 62)


def test_capture_refusal(host, no_leaks):
    with mf.Stream() as stream:
        with pytest.raises(mf.CaptureError, match="capturing"):
            with mf.graph_capture(stream):
                mf.stream_synchronize(stream)


def test_backend_without_cuda(host):
    if mf.build_info()["cuda"]:
        pytest.skip("this build has the CUDA backend: asking for it is not refused as unavailable")
    with pytest.raises(mf.BackendUnavailable, match="no CUDA backend"):
        mf.set_backend("cuda")
