"""The hostile matrix covers the public API: every public function, class and method named below
is called by some case. A case's calls are read from its code objects (its own, those nested in
it, and those of the callables it closes over or takes as defaults), not from any source text."""

from __future__ import annotations

import functools
import types

import test_hostile_config  # noqa: F401 (each registers its cases in _matrix.CASES)
import test_hostile_copies  # noqa: F401
import test_hostile_events  # noqa: F401
import test_hostile_kernels  # noqa: F401
import test_hostile_memory  # noqa: F401
import test_hostile_model  # noqa: F401
import test_hostile_router  # noqa: F401
import test_hostile_streams  # noqa: F401
from _matrix import CASES

PUBLIC = ["Event", "Stream", "PinnedBuffer", "DeviceBuffer", "event_create", "event_record",
          "event_query", "event_synchronize", "destroy_event", "stream_synchronize",
          "copy_d2h_async", "copy_h2d_async", "copy_d2d_async", "alloc_host_pinned",
          "free_host_pinned", "read_pinned_u32", "write_pinned_u32", "argmax_to_feed",
          "resolve_feed", "reference_forward", "configure_host", "host_kernel_threads",
          "AsyncDeviceIo", "ReferenceModel", "BlockPool", "FeedSource", "wait_event",
          "elapsed_ms", "memset_async", "launch_decode", "launch_fed", "await_result",
          "reserve_kv", "teardown", "decode_batch", "decode_batch_fed", "prefill",
          "release_decode_blocks", "wrap", "trace_enable", "RowMask"]


def names_used(obj, seen=None):
    """Global and attribute names the code of ``obj`` refers to, following nested code, closures,
    defaults and partials (how table-driven cases carry the call they make)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    names = set()
    if isinstance(obj, functools.partial):
        names |= names_used(obj.func, seen)
        for arg in list(obj.args) + list(obj.keywords.values()):
            names |= names_used(arg, seen)
        return names
    if isinstance(obj, types.CodeType):
        names |= set(obj.co_names)
        for const in obj.co_consts:
            if isinstance(const, types.CodeType):
                names |= names_used(const, seen)
        return names
    if isinstance(obj, types.FunctionType):
        names |= names_used(obj.__code__, seen)
        for value in list(obj.__defaults__ or ()) + [c.cell_contents for c in obj.__closure__ or ()
                                                    if c.cell_contents is not None]:
            names |= names_used(value, seen)
        # Helpers of the case files (setups, refusal helpers) are part of the calls a case makes.
        for name in obj.__code__.co_names:
            target = obj.__globals__.get(name)
            if isinstance(target, (types.FunctionType, type)) and \
                    getattr(target, "__module__", "").startswith(("test_hostile", "_matrix")):
                names |= names_used(target, seen)
        return names
    if isinstance(obj, type):
        for member in vars(obj).values():
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                names |= names_used(getattr(member, "__func__", getattr(member, "fget", member)), seen)
        return names
    if isinstance(obj, (list, tuple)):
        for item in obj:
            names |= names_used(item, seen)
        if isinstance(obj, str):
            names.add(obj)
    return names


def test_matrix_covers_the_public_api():
    used = set()
    for cases in CASES.values():
        for c in cases:
            used |= names_used(c.fn)
    missing = [name for name in PUBLIC if name not in used]
    assert not missing, f"no hostile case calls {missing}"
    assert sum(len(c) for c in CASES.values()) >= 200
