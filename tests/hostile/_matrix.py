"""The hostile matrix's machinery: the case registry, the helpers its cases share, and the runner.

Each case makes one bad call and asserts the exception's type and part of its message, then that
nothing was launched (destinations still hold their sentinels once the stream is drained) and that
nothing leaked (``live_objects()`` is back to its count before the case). The cases live in the
``test_hostile_*.py`` files beside this one, a file per part of the API.

The cases run in child interpreters, one group per child: this file run as a script with the
case file, the group and the first case, faulthandler on. A case that crashes or hangs the child
fails by name, and the parent starts the group again after it, so one crash does not hide the
cases behind it. A case registered with ``bug="..."`` is a strict xfail naming a known library bug.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import os
import re
import sys
import time
from functools import lru_cache

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DeviceBuffer, Event, FeedError, PinnedBuffer, Stream

if __package__ in (None, "") and os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for helpers
from helpers.child import run_python  # noqa: E402

NT = mf.NO_TOKEN
MARK = "@@case "  # prefix of a child's per-case result line

# ---------------------------------------------------------------------------------------------
# The case registry
# ---------------------------------------------------------------------------------------------


class Case:
    __slots__ = ("group", "name", "fn", "bug", "module")

    def __init__(self, group, name, fn, bug, module):
        self.group, self.name, self.fn, self.bug, self.module = group, name, fn, bug, module


CASES: dict = {}


def add(group, name, fn, bug=None, module=None):
    """Register a case; its case file (``module``) is the caller's module by default."""
    module = module or sys._getframe(1).f_globals["__name__"]
    cases = CASES.setdefault(group, [])
    assert all(c.name != name for c in cases), f"duplicate case {group}-{name}"
    assert all(c.module == module for c in cases), f"group {group} spans two case files"
    cases.append(Case(group, name, fn, bug, module))


def case(group, bug=None):
    def register(fn):
        add(group, fn.__name__, fn, bug, module=fn.__module__)
        return fn
    return register


def raises(exc, match, fn, *args, **kwargs):
    """Call ``fn``; it must raise ``exc`` (a type or tuple) with ``match`` (a regex) in its text."""
    try:
        fn(*args, **kwargs)
    except exc as error:
        text = str(error)
        if match is not None and not re.search(match, text):
            raise AssertionError(f"{type(error).__name__} raised, but {text!r} does not match "
                                 f"{match!r}") from None
        return error
    except BaseException as error:
        raise AssertionError(f"expected {exc}, got {type(error).__name__}: {error}") from None
    raise AssertionError(f"expected {exc} matching {match!r}: nothing was raised")


# Device and host buffers with sentinels, to see that a refused call launched nothing.

def dev_with(data):
    buf = DeviceBuffer(len(data))
    mf.copy_h2d_async(buf, bytes(data))
    mf.stream_synchronize(0)
    return buf


def dev_bytes(buf):
    out = bytearray(buf.nbytes)
    mf.copy_d2h_async(buf, out)
    mf.stream_synchronize(0)
    return bytes(out)


def pinned_with(data):
    buf = PinnedBuffer(len(data))
    memoryview(buf)[:] = bytes(data)
    return buf


def drained():
    mf.stream_synchronize(0)


FOREIGN = np.zeros(256, np.uint8)  # host memory this package did not allocate


# Helpers more than one case file uses.

def closed_event():
    e = Event()
    e.close()
    return e


def _destroyed_handle():
    h = mf.event_create()
    mf.destroy_event(h)
    return h


def closed_stream():
    s = Stream()
    s.close()
    return s


def _model(**kw):
    from metrale_feed.testing.reference import ReferenceModel

    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 8)
    kw.setdefault("max_rows", 4)
    return ReferenceModel(kw.pop("vocab", 16), **kw)


# The child: run a group's cases from `start`, one result line each
# ---------------------------------------------------------------------------------------------

def _settled_counts(expected, timeout=2.0):
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        mf.stream_synchronize(0)
        counts = mf.live_objects()
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.002)


def _child(group, start):
    faulthandler.enable()
    import traceback

    assert mf.backend() in ("host", "simt"), "the hostile matrix runs on the host runtime"
    for index, c in enumerate(CASES[group]):
        if index < start:
            continue
        mf.configure_host()
        gc.collect()
        mf.stream_synchronize(0)
        before = mf.live_objects()
        sys.stderr.write(f"case {group}-{c.name}\n")  # the last one named is the one that crashed
        sys.stderr.flush()
        ok, detail = True, ""
        try:
            c.fn()
        except BaseException:  # noqa: BLE001 (any failure is this case's result)
            ok, detail = False, traceback.format_exc(limit=4)
        mf.configure_host()
        after = _settled_counts(before)
        if ok and after != before:
            ok, detail = False, f"leaked: live_objects {before} before, {after} after"
        print(MARK + json.dumps({"index": index, "name": c.name, "ok": ok, "detail": detail}),
              flush=True)


# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# The parent: one child per group, resumed after a crash
# ---------------------------------------------------------------------------------------------

CHILD_TIMEOUT = 60


@lru_cache(maxsize=None)
def group_results(path, group):
    """{index: (ok, detail)} for every case of ``group`` (registered by the case file ``path``);
    a crash or hang is the result of the case the child was running."""
    results, start, n = {}, 0, len(CASES[group])
    while start < n:
        child = run_python(argv=[os.path.abspath(__file__), path, group, str(start)],
                           timeout=CHILD_TIMEOUT, check=False)
        for line in child.stdout.splitlines():
            if line.startswith(MARK):
                record = json.loads(line[len(MARK):])
                results[record["index"]] = (record["ok"], record["detail"])
        missing = [i for i in range(start, n) if i not in results]
        if not missing:
            break
        first = missing[0]
        how = "timed out" if child.timed_out else f"exit {child.returncode}"
        results[first] = (False, f"the child died in this case ({how}); its stderr ends:\n"
                                 f"{child.stderr[-3000:]}")
        start = first + 1
    return results


def hostile_test(module_name):
    """The parametrised test of the case file ``module_name``: one test per case it registered."""
    path = os.path.abspath(sys.modules[module_name].__file__)
    params = [
        pytest.param(group, index, id=f"{group}-{c.name}",
                     marks=[pytest.mark.xfail(strict=True, reason=c.bug)] if c.bug else [])
        for group, cases in CASES.items() for index, c in enumerate(cases) if c.module == module_name
    ]

    @pytest.mark.parametrize("group,index", params)
    def test_hostile(group, index):
        ok, detail = group_results(path, group)[index]
        assert ok, f"{group}-{CASES[group][index].name}:\n{detail}"

    return test_hostile


def run_case_file(path, group, start):
    """The child: import the case file (which registers its cases here) and run ``group``."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _child(group, start)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _matrix  # the registry the case file fills, not this __main__ copy

    _matrix.run_case_file(sys.argv[1], sys.argv[2], int(sys.argv[3]))
