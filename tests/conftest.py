"""Shared fixtures of the metrale_feed tests.

- ``host``: the host backend is active for the test (skipped when it cannot be made active), and
  its fault knobs are reset afterwards.
- ``no_leaks``: the test ends with the live event, stream, pinned and device counts it began with.
- ``dev``: helpers that move numpy arrays into and out of ``DeviceBuffer`` s.
- ``backend``: the test runs once per backend, host, simt and cuda (cuda skipped, with the
  reason, where no device is usable): write a test once, check all three.
- A session started with ``METRALE_FEED_BACKEND=simt`` runs the whole suite on the simt backend:
  ``host`` then keeps simt active (simt is the host backend's runtime, fault knobs included, with
  the CUDA kernels run on the CPU).
- ``@pytest.mark.gpu``: skipped unless the cuda backend is active, with the reason why.
"""

from __future__ import annotations

import gc

import pytest

import metrale_feed
from helpers.leaks import wait_for_counts


def pytest_addoption(parser):
    parser.addoption(
        "--no-backend-matrix", action="store_true",
        help="deselect the tests parametrized over backends (the `backend` fixture): they make "
             "each backend active themselves, so a session on another default backend runs them "
             "exactly as the session that ran them already did (CI's simt pass)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--no-backend-matrix"):
        return
    matrix = [item for item in items
              if "backend" in getattr(getattr(item, "callspec", None), "params", {})]
    if matrix:
        config.hook.pytest_deselected(items=matrix)
        chosen = set(map(id, matrix))
        items[:] = [item for item in items if id(item) not in chosen]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a usable CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: longer runs (soak, wheel install)")


# The backend the import chose (METRALE_FEED_BACKEND, default auto).
IMPORT_BACKEND = metrale_feed.backend()
# What the ``host`` fixture makes active: the host runtime, with the simt kernels in a simt session.
HOST_RUNTIME = "simt" if IMPORT_BACKEND == "simt" else "host"


def _gpu_skip_reason():
    if not metrale_feed.build_info()["cuda"]:
        return "no CUDA build: this metrale_feed was built without the cuda backend"
    if IMPORT_BACKEND != "cuda":
        return "no usable CUDA device (or METRALE_FEED_BACKEND=host): the active backend is host"
    if metrale_feed.backend() != "cuda":
        return "the cuda backend is not active: an earlier test left the host backend selected"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = _gpu_skip_reason()
        if reason:
            pytest.skip(reason)


# Kernel name -> the test cases (in this process) that launched it on the simt backend, printed
# at the end of the session: how much of the suite ran each CUDA kernel for real.
_SIMT_CASES: dict = {}
_SIMT_BEFORE = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_SIMT_BEFORE] = metrale_feed.simt_config()["kernels"]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The kernels a test ran ride on its teardown report, so that under pytest-xdist the
    # controller, which runs no test, still counts them.
    outcome = yield
    if call.when == "teardown" and _SIMT_BEFORE in item.stash:
        before = item.stash[_SIMT_BEFORE]
        ran = sorted(name for name, n in metrale_feed.simt_config()["kernels"].items()
                     if n > before.get(name, 0))
        outcome.get_result().user_properties.append(("simt_kernels", ran))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, ran in report.user_properties:
            if key == "simt_kernels":
                for name in ran:
                    _SIMT_CASES[name] = _SIMT_CASES.get(name, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if _SIMT_CASES:
        terminalreporter.write_sep("-", "simt: test cases that ran each CUDA kernel")
        for name in sorted(_SIMT_CASES):
            terminalreporter.write_line(f"{_SIMT_CASES[name]:6d}  {name}")


@pytest.fixture(params=["portable", "best"])
def path(request, host):
    """The host backend with each of its argmax paths in turn (portable C++, then the best the
    CPU has); yields the path's name and restores the best path after."""
    host.host_argmax_path(request.param == "portable")
    yield host.host_argmax_path()
    host.host_argmax_path(False)


@pytest.fixture
def host():
    """The host backend (simt in a simt session), active for this test; fault knobs off before
    and after."""
    yield from _host_runtime(HOST_RUNTIME)


@pytest.fixture
def vector(host):
    """The host backend's vector path on one kernel thread (skipped where the CPU has only the
    portable one), for the tests that compare it with the portable path."""
    if host.host_argmax_path(False) == "portable":
        pytest.skip("no vector path on this CPU: both paths are the portable one")
    host.host_kernel_threads(1)
    yield
    host.host_kernel_threads(0)


@pytest.fixture
def simt():
    """The simt backend, active for this test; its executor's settings reset after."""
    yield from _host_runtime("simt")


def _host_runtime(name):
    previous = metrale_feed.backend()
    if previous != name:
        gc.collect()
        try:
            metrale_feed.set_backend(name)
        except (metrale_feed.FeedError, ValueError) as error:
            pytest.skip(f"cannot switch to the {name} backend: {error}")
    metrale_feed.configure_host()
    threads = getattr(metrale_feed, "host_kernel_threads", None)
    kernel_threads = threads() if threads else None
    try:
        yield metrale_feed
    finally:
        metrale_feed.configure_host()
        metrale_feed.configure_simt()
        metrale_feed.stream_synchronize(0)
        if threads:
            threads(kernel_threads)
        if previous != name:
            gc.collect()
            try:
                metrale_feed.set_backend(previous)
            except (metrale_feed.FeedError, ValueError) as error:
                pytest.fail(f"cannot switch back to the {previous} backend after a host test "
                            f"(objects still live: {metrale_feed.live_objects()}): {error}")


@pytest.fixture(params=["host", "simt", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """The package with ``request.param`` ("host", "simt" or "cuda") active for this test."""
    if request.param in ("host", "simt"):
        yield from _host_runtime(request.param)
        return
    # The gpu mark has skipped this unless the cuda backend is the active one.
    assert metrale_feed.backend() == "cuda"
    yield metrale_feed
    metrale_feed.stream_synchronize(0)


class LeakCheck:
    def __init__(self):
        gc.collect()
        metrale_feed.stream_synchronize(0)
        self.start = metrale_feed.live_objects()

    def check(self):
        counts = wait_for_counts(self.start)
        assert counts == self.start, f"leaked: started with {self.start}, ended with {counts}"


@pytest.fixture
def no_leaks():
    """Asserts, after the test, that live_objects() is back to its counts at the start."""
    leak = LeakCheck()
    yield leak
    leak.check()


class DeviceHelpers:
    """numpy <-> DeviceBuffer through the package's own async copies."""

    @staticmethod
    def as_bytes(array):
        import numpy as np

        array = np.ascontiguousarray(array)
        return array.reshape(-1).view(np.uint8)

    def upload(self, array, stream=0, pad=0):
        """A new DeviceBuffer holding the bytes of ``array`` (plus ``pad`` zero bytes)."""
        raw = self.as_bytes(array)
        buf = metrale_feed.DeviceBuffer(max(1, raw.nbytes + pad))
        if raw.nbytes:
            metrale_feed.copy_h2d_async(buf, raw, stream)
            metrale_feed.stream_synchronize(stream)
        return buf

    def write(self, buf, array, offset=0, stream=0):
        raw = self.as_bytes(array)
        target = buf if offset == 0 else buf.ptr + offset
        metrale_feed.copy_h2d_async(target, raw, stream)
        metrale_feed.stream_synchronize(stream)

    def download(self, buf, dtype="uint8", count=None, offset=0, stream=0):
        """``count`` items of ``dtype`` read from ``buf`` at byte ``offset`` (default: all of it)."""
        import numpy as np

        dtype = np.dtype(dtype)
        if count is None:
            count = (buf.nbytes - offset) // dtype.itemsize
        out = np.empty(count, dtype=np.uint8 if dtype.itemsize == 1 else dtype)
        if count:
            source = buf if offset == 0 else buf.ptr + offset
            metrale_feed.copy_d2h_async(source, out.view(np.uint8), stream)
            metrale_feed.stream_synchronize(stream)
        return out.view(dtype)


@pytest.fixture
def dev():
    return DeviceHelpers()
