"""The extension's launch path, read from its sources (docs/lifetimes.md, rules 11 to 14).

Every operation the Python API queues goes through one ``_Launch``: a launcher that called a
queueing entry point of the C layer directly would skip what the launch commits (the kept arrays,
the held buffers, the capture's objects, the event marks), which is how the defects of the
scattered bookkeeping happened. The runtime tests check what each rule does; these keep a new
launcher from going around them.
"""

import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "metrale_feed"

# The C entry points that queue work on a stream (feed.h).
QUEUEING = (
    "mf_argmax_to_feed", "mf_verify_to_feed", "mf_resolve_feed_flags", "mf_resolve_verified",
    "mf_verify_logit_params", "mf_grammar_mask", "mf_grammar_advance",
    "mf_reference_forward", "mf_penalties_update", "mf_penalties_apply", "mf_top_logprobs",
    "mf_combine_partials", "mf_copy_d2h_async", "mf_copy_h2d_async", "mf_copy_d2d_async",
    "mf_memset_async", "mf_event_record", "mf_stream_wait_event",
)

# Calls that do not go through _Launch, each for the reason docs/lifetimes.md gives.
OUTSIDE = {
    # The cimport entry points: C callers own their memory; no GIL, nothing kept.
    ("_event.pxi", "return mf_event_record(event, stream)"),
    ("_kernels.pxi", "return mf_argmax_to_feed(args, stream)"),
    ("_memory.pxi", "return mf_copy_d2h_async(dst, src, nbytes, stream)"),
    ("_memory.pxi", "return mf_copy_h2d_async(dst, src, nbytes, stream)"),
    # The launch's own keep-alive event, recorded behind the work it guards.
    ("_launch.pxi", "status = mf_event_record(event, stream)"),
    # A DLPack import orders the producer's stream before ours: an event of ours, nothing kept.
    ("_dlpack.pxi", "check(mf_event_record(event, p))"),
    ("_dlpack.pxi", "check(mf_stream_wait_event(stream, event))"),
}

CALL = re.compile(r"\b(" + "|".join(QUEUEING) + r")\(")
# The one commit: a _Launch's (launch.queued), or queued_on for a call that coerced nothing.
COMMITS = re.compile(r"(\.queued|\bqueued_on)\(")


def sources():
    files = sorted(SRC.glob("*.pxi"))
    if not files:
        pytest.skip("the extension's sources are not here (an installed wheel holds none)")
    return files


def queueing_calls():
    """(file, stripped line) of every call of a queueing entry point outside declarations."""
    calls = []
    for path in sources():
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if CALL.search(stripped) and not stripped.startswith(("#", "cdef ", "mf_status ")):
                calls.append((path.name, stripped))
    return calls


def test_every_queueing_call_commits_through_the_launch():
    stray = [(f, line) for f, line in queueing_calls()
             if not COMMITS.search(line) and (f, line) not in OUTSIDE]
    assert not stray, "queued outside _Launch.queued (docs/lifetimes.md, rule 11):\n" + "\n".join(
        f"  {f}: {line}" for f, line in stray)


def test_the_exceptions_are_still_there():
    # An exception that no longer matches a line is stale: the list must say what is true.
    found = set(queueing_calls())
    assert OUTSIDE <= found, sorted(OUTSIDE - found)


def test_every_launcher_is_queued():
    # The scan above must see the launchers at all: one queued call per queueing entry point
    # the Python API reaches (a rename that hid them from the pattern would pass vacuously).
    seen = {CALL.search(line).group(1) for f, line in queueing_calls() if COMMITS.search(line)}
    assert seen == set(QUEUEING), sorted(set(QUEUEING) - seen)


def test_module_state_is_declared_in_one_file():
    # One owner for every piece of state: module-level tables live in _state.pxi (constants,
    # written once at import, are upper-case names or read-only lookups of the dtype table).
    table = re.compile(r"^(cdef (dict|list|set|object) _\w+|_[a-z]\w* = (\{|\[|set\(|_deque))")
    stray = [(p.name, line) for p in sources() if p.name != "_state.pxi"
             for line in p.read_text().splitlines() if table.match(line)]
    assert not stray, stray
