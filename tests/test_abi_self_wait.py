"""A host function that waits for work queued behind itself on its own stream would wait
forever (CUDA forbids CUDA calls in a host function): the host backend refuses the wait with a
clear error instead. Each case runs in a child with a timeout, so a deadlock fails the test."""

from __future__ import annotations

import pytest

from helpers.child import run_python

PRELUDE = """
import metrale_feed as mf
seen = []

def attempt(wait):
    try:
        wait()
        seen.append("returned")
    except Exception as error:  # what the wait raised, inside the host function
        seen.append(error)

def run(stream, wait, after=None):
    seen.clear()
    mf.launch_host_func(stream, attempt, wait)
    if after:
        after()
    mf.stream_synchronize(stream)
    return seen[0]

def refused(outcome, what):
    assert isinstance(outcome, ValueError), outcome
    assert what in str(outcome) and "host function" in str(outcome), outcome
"""

CASES = {
    "stream_synchronize_own_stream": """
        with mf.Stream() as s:
            refused(run(s, lambda: mf.stream_synchronize(s)), "stream_synchronize")
            refused(run(s, lambda: s.synchronize()), "stream_synchronize")
    """,
    "default_stream_synchronize_itself": """
        refused(run(0, lambda: mf.stream_synchronize(0)), "stream_synchronize")
    """,
    "event_recorded_after_it_on_its_stream": """
        with mf.Stream() as s, mf.Event() as e:
            refused(run(s, lambda: e.synchronize(), after=lambda: e.record(s)), "event_synchronize")
            refused(run(s, lambda: mf.event_synchronize(e.handle), after=lambda: e.record(s)),
                    "event_synchronize")
    """,
    # Waits that can end are still allowed: an event recorded before the host function (already
    # reached when it runs) and another stream's work.
    "waits_that_can_end_still_work": """
        with mf.Stream() as s, mf.Stream() as other, mf.Event() as e:
            e.record(s)
            assert run(s, lambda: e.synchronize()) == "returned"
            assert run(s, lambda: other.synchronize()) == "returned"
            mf.launch_host_func(other, lambda: None)
            e.record(other)
            assert run(s, lambda: e.synchronize()) == "returned"
    """,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_self_wait_is_refused_not_a_deadlock(name):
    import textwrap

    code = PRELUDE + textwrap.dedent(CASES[name]) + "\nprint('OK')\n"
    result = run_python(code, timeout=30, check=False)
    assert not result.timed_out, "deadlock: " + result.describe()
    assert result.returncode == 0 and "OK" in result.stdout, result.describe()
