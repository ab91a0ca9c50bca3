"""Out of memory while queueing is a status, never a C++ exception across the C ABI (which ends
the process in std::terminate): each refused call raises FeedMemoryError (a MemoryError too) and
queues nothing, and the stream, its events and the calls that did get queued are intact once
memory is back. Run in a child under RLIMIT_AS, so a crash fails this test, not the run."""

from __future__ import annotations

import sys

import pytest

from helpers.child import run_python

CHILD = r"""
import gc, resource, threading
import numpy as np
import metrale_feed as mf

def vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

ROWS, VOCAB, N = 4, 64, 3000
# No numpy.random: an extension module with thread-local storage loaded after the C layer (as it
# imports) makes glibc grow the main thread's TLS table at the first later throw, and glibc ends
# the process when that allocation fails: a libc limit, outside what the C layer can catch.
values = ((np.arange(ROWS * VOCAB, dtype=np.float32) * 7919) % 1000).reshape(ROWS, VOCAB)
stream = mf.Stream()
logits = mf.DeviceBuffer(values.nbytes)
mf.copy_h2d_async(logits, values.tobytes(), stream=stream)
cells, dst = mf.DeviceBuffer(ROWS * 4), mf.PinnedBuffer(ROWS * 4)
src, dev = mf.DeviceBuffer(4096), mf.DeviceBuffer(4096)
event = mf.Event()
gate = threading.Event()
ran, queued = bytearray(N), bytearray(N)  # made now: they need malloc's memory
masks = [(mf.NO_TOKEN, mf.NO_TOKEN)] * ROWS

def mark(i):
    ran[i] = 1

def call(i):
    kind = i % 4
    if kind == 0:
        mf.launch_host_func(stream, mark, i)
    elif kind == 1:
        event.record(stream)
    elif kind == 2:
        mf.copy_d2d_async(dev, src, 64, stream)
    else:  # the host backend copies the masks into its job: a vector, a std::function
        mf.argmax_to_feed(logits, masks, cells, dst, None, stream, rows=ROWS, vocab=VOCAB,
                          dtype="float32")

for i in range(4):  # every path once, so the episode meets no first-use allocation
    call(i)
stream.synchronize()
ran[0] = 0
entered = threading.Event()

def hold():
    entered.set()
    gate.wait()

mf.launch_host_func(stream, hold)  # the worker waits here: what is queued next piles up
entered.wait()  # and is inside the wait before memory runs out (the wait allocates nothing more)

resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (64 << 20), resource.RLIM_INFINITY))
ballast, small = [], []
for size in (1 << 20, 1 << 16, 4096, 600):  # malloc's memory (above pymalloc's 512 bytes)
    try:
        while True:
            ballast.append(bytearray(size))
    except MemoryError:
        pass
try:
    while True:
        small.append(bytearray(64))  # pymalloc's
except MemoryError:
    pass
del small[-40000:]  # room for the interpreter: pymalloc keeps it, malloc stays exhausted

feed_oom = other_oom = 0
for i in range(1, N):
    try:
        call(i)
        queued[i] = 1
    except mf.FeedMemoryError:
        feed_oom += 1
    except MemoryError:  # the interpreter's own allocation, before the C layer was reached
        other_oom += 1

del ballast, small
gc.collect()
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
gate.set()
stream.synchronize()
event.synchronize()  # no record was left half-made: the wait ends
assert event.query() is True
# Nothing refused was queued: exactly the host functions whose launch returned have run.
assert [i for i in range(N) if ran[i]] == [i for i in range(N) if queued[i] and i % 4 == 0]
# The stream still works, and the argmax still gives the reference's ids.
mf.argmax_to_feed(logits, masks, cells, dst, event, stream, rows=ROWS, vocab=VOCAB, dtype="float32")
event.synchronize()
assert list(np.frombuffer(bytes(memoryview(dst)), np.uint32)) == list(values.argmax(axis=1))
assert feed_oom > 0, "no call reached the C layer's out-of-memory path"
print("RESULT", sum(queued), feed_oom, other_oom)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_queueing_out_of_memory_is_a_status_and_queues_nothing():
    result = run_python(CHILD, timeout=120, check=False)
    assert not result.timed_out, result.describe()
    assert "terminate called" not in result.stderr, result.describe()
    assert result.returncode == 0 and "RESULT" in result.stdout, result.describe()
