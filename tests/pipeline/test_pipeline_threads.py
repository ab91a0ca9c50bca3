"""DecodePipeline with other threads: one thread steps while others submit and abort. Each
scenario runs in a child interpreter with a timeout, so a deadlock fails the test instead of
hanging the run; every request is held to the greedy oracle."""

from __future__ import annotations

import pytest

from helpers.child import run_python

SCENARIO = r"""
import random, sys, threading, time
sys.path.insert(0, {tests!r})
import metrale_feed as mf
from conftest import VOCAB, greedy_tokens, model_for, prompts

DEPTH, SUBMITTERS, PER_THREAD = {depth}, {submitters}, {per_thread}
sys.setswitchinterval(1e-6)  # thread switches anywhere, so races show
errors, reqs, lock = [], [], threading.Lock()
posted = threading.Event()
with model_for(4, num_blocks=512, block_size=4) as model:
    pipe = mf.DecodePipeline(model, 4, depth=DEPTH)
    submitted = threading.Semaphore(0)

    def submitter(index):
        try:
            rng = random.Random(index)
            for n, p in enumerate(prompts(PER_THREAD, seed=index)):
                req = pipe.submit(p, max_new_tokens=rng.randint(1, 8))
                with lock:
                    reqs.append(req)
                if n % 5 == 4:
                    pipe.abort(req)  # at once, or when the running step ends
                time.sleep(rng.random() * 0.001)
        except BaseException as exc:
            errors.append(("submitter", index, repr(exc)))

    threads = [threading.Thread(target=submitter, args=(i,), daemon=True)
               for i in range(SUBMITTERS)]
    for t in threads:
        t.start()
    steps = 0
    try:
        while any(t.is_alive() for t in threads) or not pipe.idle:
            pipe.step()  # idle or not: a submit may land at any point of it
            steps += 1
    except BaseException as exc:
        errors.append(("loop", repr(exc)))
    for t in threads:
        t.join(30)
    pipe.close()
    assert not errors, errors
    assert len(reqs) == SUBMITTERS * PER_THREAD
    for req in reqs:
        assert req.finished, req
        want = greedy_tokens(req.prompt, req.max_new_tokens, VOCAB)
        if req.finish_reason == "abort":
            assert req.tokens == want[: len(req.tokens)], req
        else:
            assert req.finish_reason == "length" and req.tokens == want, req
    assert model.pool.free_count == model.pool.num_blocks
    assert sorted(r._order for r in reqs) == list(range(1, len(reqs) + 1))
print("OK", steps)
"""


@pytest.mark.parametrize("depth", [1, 2])
def test_submit_and_abort_from_other_threads_while_one_steps(depth):
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    code = SCENARIO.format(tests=tests, depth=depth, submitters=3, per_thread=15)
    result = run_python(code, timeout=120)
    assert "OK" in result.stdout, result.describe()


def test_two_threads_stepping_one_pipeline_take_turns():
    """step() from two threads at once: the calls are serialised, every token is the oracle's."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    code = rf"""
import sys, threading
sys.path.insert(0, {tests!r})
import metrale_feed as mf
from conftest import VOCAB, greedy_tokens, model_for, prompts

errors = []
with model_for(4) as model, mf.DecodePipeline(model, 4) as pipe:
    reqs = [pipe.submit(p, max_new_tokens=12) for p in prompts(10, seed=3)]
    def loop():
        try:
            while not pipe.idle:
                pipe.step()
        except BaseException as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    assert not errors, errors
    for r in reqs:
        assert r.finish_reason == "length" and r.tokens == greedy_tokens(r.prompt, 12, VOCAB), r
print("OK")
"""
    result = run_python(code, timeout=120)
    assert "OK" in result.stdout, result.describe()
