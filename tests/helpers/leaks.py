"""Leak checks over ``live_objects()`` that allow for deferred frees.

Closing a buffer, a model or a pipeline does not wait for the streams: memory that queued work
still reads is freed once that work has passed (the first call after it lets go of it). So a
count taken right after a close may still hold those bytes, for as long as the streams lag,
which on a loaded machine with the host backend's lag switched on is more than a few
milliseconds. These helpers poll until the counts come back, up to a generous deadline, and
return (or name) what was still live at the deadline.
"""

import gc
import time

import metrale_feed


def wait_for_counts(expected, timeout=20.0):
    """``live_objects()`` once it equals ``expected``, else the last counts seen at the
    deadline (polled, collecting garbage each time)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        counts = metrale_feed.live_objects()
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.005)


def assert_counts_back(before, what="objects left"):
    """Fails unless ``live_objects()`` comes back to ``before`` (see ``wait_for_counts``)."""
    counts = wait_for_counts(before)
    assert counts == before, f"{what}: started with {before}, ended with {counts}"
