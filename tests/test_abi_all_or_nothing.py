"""A call made of several queued pieces (a kernel, the copies of its results, an event record;
a graph's calls) queues all of them or none: a fault injected at any piece raises the typed error,
and then, once the stream has drained, the cells and destinations still hold what they held
before and the event is in its previous state. The same call without the fault then gives the
right ids. Each call runs in a child interpreter, so a crash or a hang fails its test only."""

from __future__ import annotations

import pytest

from helpers.child import run_python

PRELUDE = r"""
import numpy as np
import metrale_feed as mf
from metrale_feed import _core

ROWS, VOCAB, K = 4, 64, 1
SENTINEL = 0xA5A5A5A5
values = ((np.arange(ROWS * (K + 1) * VOCAB, dtype=np.float32) * 7919) % 1000).reshape(-1, VOCAB)
best = values.argmax(axis=1).astype(np.uint32)
stream = mf.Stream()
logits = mf.DeviceBuffer(values.nbytes)
mf.copy_h2d_async(logits, values.tobytes(), stream=stream)
stream.synchronize()

def device_words(buf, n):
    out = np.zeros(n, np.uint32)
    mf.copy_d2h_async(buf, out, stream)
    stream.synchronize()
    return out

def fill(bufs, hosts):
    # The sentinel everywhere a call writes: device buffers through a copy, host ones directly.
    for buf in bufs:
        words = np.full(buf.nbytes // 4, SENTINEL, np.uint32)
        mf.copy_h2d_async(buf, words, stream=stream)
    stream.synchronize()
    for host in hosts:
        np.frombuffer(host, np.uint32)[:] = SENTINEL

def untouched(bufs, hosts, what):
    stream.synchronize()
    for buf in bufs:
        assert (device_words(buf, buf.nbytes // 4) == SENTINEL).all(), f"{what}: a device output was written"
    for host in hosts:
        assert (np.frombuffer(host, np.uint32) == SENTINEL).all(), f"{what}: a host output was written"

def never_recorded(event):
    other = mf.Event(timing=True)
    other.record(stream)
    stream.synchronize()
    try:
        event.elapsed_ms(other)
    except (mf.FeedError, ValueError) as error:
        return "never" in str(error)
    finally:
        other.close()
    return False

def check_refused(call, bufs, hosts, faults, label):
    # Each fault in turn: refused with its typed error, nothing written, both events as before.
    for knobs in faults:
        fill(bufs, hosts)
        done, fresh = mf.Event(), mf.Event(timing=True)
        done.record(stream)
        stream.synchronize()
        for event in (done, fresh):
            mf.configure_host(**knobs)
            try:
                call(event)
            except mf.InjectedFault:
                pass
            else:
                raise AssertionError(f"{label} {knobs}: the call was not refused")
            finally:
                mf.configure_host()
            untouched(bufs, hosts, f"{label} {knobs}")
        assert done.query(), f"{label} {knobs}: a completed event was left pending"
        assert never_recorded(fresh), f"{label} {knobs}: a never-recorded event was recorded"
        done.close()
        fresh.close()
    # The same call without a fault: its event completes and its outputs are the reference's.
    fill(bufs, hosts)
    event = mf.Event()
    call(event)
    event.synchronize()
    stream.synchronize()  # a graph queues work behind its record
    event.close()
"""

ARGMAX = PRELUDE + r"""
cells, lp = mf.DeviceBuffer(ROWS * 4), mf.DeviceBuffer(ROWS * 4)
dst, lp_dst = mf.PinnedBuffer(ROWS * 4), mf.PinnedBuffer(ROWS * 4)
rows = values[:ROWS]
params = mf.sampling_params(ROWS, temperature=0.0, seed=5)

def argmax(event):
    mf.argmax_to_feed(logits, None, cells, dst, event, stream, rows=ROWS, vocab=VOCAB, dtype="float32",
                      logprobs=lp, logprobs_dst=lp_dst)

def sample(event):
    mf.sample_to_feed(logits, params, cells, dst, event, stream, rows=ROWS, vocab=VOCAB, dtype="float32",
                      logprobs=lp, logprobs_dst=lp_dst)

faults = [dict(fail_copy_at=1), dict(fail_copy_at=2)]  # the ids' copy, the logprobs' copy
for label, call in (("argmax_to_feed", argmax), ("sample_to_feed", sample)):
    check_refused(call, [cells, lp], [dst, lp_dst], faults, label)
    assert list(np.frombuffer(dst, np.uint32)) == list(best[:ROWS]), label
    assert list(device_words(cells, ROWS)) == list(best[:ROWS]), label
print("OK")
"""

VERIFY = PRELUDE + r"""
words, logit_rows = ROWS * (K + 2), ROWS * (K + 1)
cells, lp = mf.DeviceBuffer(words * 4), mf.DeviceBuffer(logit_rows * 4)
dst, lp_dst = mf.PinnedBuffer(words * 4), mf.PinnedBuffer(logit_rows * 4)
drafts = np.ascontiguousarray(best.reshape(ROWS, K + 1)[:, :K])  # every draft accepted

def verify(event):
    mf.verify_to_feed(logits, drafts, cells, dst, event, stream, k=K, vocab=VOCAB, dtype="float32",
                      logprobs=lp, logprobs_dst=lp_dst)

fill([cells, lp], [dst, lp_dst])
verify(None)
stream.synchronize()
want = np.frombuffer(dst, np.uint32).copy()
check_refused(verify, [cells, lp], [dst, lp_dst], [dict(fail_copy_at=1), dict(fail_copy_at=2)], "verify_to_feed")
assert list(np.frombuffer(dst, np.uint32)) == list(want)
# The greedy verify of accepted drafts emits each row's argmaxes.
assert list(want.reshape(ROWS, K + 2)[:, 2]) == list(best.reshape(ROWS, K + 1)[:, 1])
print("OK")
"""

COMBINE = PRELUDE + r"""
parts = mf.DeviceBuffer(_core._partial_bytes(ROWS))
cells, lp = mf.DeviceBuffer(ROWS * 4), mf.DeviceBuffer(ROWS * 4)
dst, lp_dst, fault = mf.PinnedBuffer(ROWS * 4), mf.PinnedBuffer(ROWS * 4), mf.PinnedBuffer(4)
_core._argmax_partial(logits, None, parts, None, stream, start=0, stop=VOCAB, vocab=VOCAB,
                      dtype="float32", call=1, rows=ROWS, logprobs=True)
stream.synchronize()

def combine(event):
    _core._combine_partials(parts, 1, cells, dst, event, stream, rows=ROWS, vocab=VOCAB, call=1,
                            fault_dst=fault, logprobs=lp, logprobs_dst=lp_dst)

# The ids' copy, the logprobs' copy, the fault word's copy.
faults = [dict(fail_copy_at=n) for n in (1, 2, 3)]
check_refused(combine, [cells, lp], [dst, lp_dst, fault], faults, "combine_partials")
assert list(np.frombuffer(dst, np.uint32)) == list(best[:ROWS])
assert np.frombuffer(fault, np.uint32)[0] == 0
print("OK")
"""

GRAPH = PRELUDE + r"""
cells, copied = mf.DeviceBuffer(ROWS * 4), mf.DeviceBuffer(ROWS * 4)
dst, again = mf.PinnedBuffer(ROWS * 4), mf.PinnedBuffer(ROWS * 4)

def launch(event):
    # The argmax with its readback and record, then a device copy and a readback of it behind the
    # record. A capture queues nothing: the faults hit the launch's pieces only.
    with mf.graph_capture(stream) as graph:
        mf.argmax_to_feed(logits, None, cells, dst, event, stream, rows=ROWS, vocab=VOCAB, dtype="float32")
        mf.copy_d2d_async(copied, cells, ROWS * 4, stream)
        mf.copy_d2h_async(copied, again, stream)
    try:
        graph.launch(stream)
    finally:
        graph.close()

# The argmax's readback, the device copy (after the record), the last readback.
faults = [dict(fail_copy_at=n) for n in (1, 2, 3)]
check_refused(launch, [cells, copied], [dst, again], faults, "graph launch")
assert list(np.frombuffer(dst, np.uint32)) == list(best[:ROWS])
assert list(np.frombuffer(again, np.uint32)) == list(best[:ROWS])
print("OK")
"""

HELD_COPY = PRELUDE + r"""
src = mf.DeviceBuffer(ROWS * 4)
mf.copy_h2d_async(src, best[:ROWS], stream=stream)
stream.synchronize()
held = bytearray(np.full(ROWS, SENTINEL, np.uint32).tobytes())
mf.configure_host(fail_copy_at=1)
try:
    mf.copy_d2h_async(src, held, stream)
except mf.InjectedFault:
    pass
else:
    raise AssertionError("the copy was not refused")
finally:
    mf.configure_host()
stream.synchronize()
assert (np.frombuffer(held, np.uint32) == SENTINEL).all()
held += b"1234"  # resizable: a refused copy kept no hold on it
del held[-4:]
mf.copy_d2h_async(src, held, stream)
stream.synchronize()
assert list(np.frombuffer(held, np.uint32)) == list(best[:ROWS])
print("OK")
"""


@pytest.mark.parametrize("code", [ARGMAX, VERIFY, COMBINE, GRAPH, HELD_COPY],
                         ids=["argmax_and_sample", "verify", "combine", "graph_launch", "held_copy"])
def test_a_refused_call_queued_nothing(code):
    result = run_python(code, timeout=120, check=False)
    assert not result.timed_out, result.describe()
    assert result.returncode == 0 and "OK" in result.stdout, result.describe()
