"""DecodePipeline after faults: a device-side fault in a step's forward (a host function that
raises in stream order), a prefill that raises, and the request's status through its life.
Every request that finishes ``"stop"`` or ``"length"`` is held to the greedy oracle."""

from __future__ import annotations

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError, RequestStatus
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, check_failed, check_the_rest_run, prompts


class ForwardFault(ReferenceModel):
    """The reference model, whose ``fault_at``-th fed forward queues a host function that
    raises after it: the step's wait reports the fault (once), as a kernel fault would."""

    def __init__(self, *args, fault_at=(), **kw):
        super().__init__(*args, **kw)
        self.fault_at = set(fault_at)
        self.forwards = 0

    def _fault(self, stream):
        self.forwards += 1
        if self.forwards in self.fault_at:
            def boom():
                raise RuntimeError(f"injected fault in forward {self.forwards}")
            mf.launch_host_func(stream, boom)

    def decode_batch_fed(self, sources, seqs, stream):
        logits = super().decode_batch_fed(sources, seqs, stream)
        self._fault(stream)
        return logits

    def decode_batch(self, tokens, seqs, stream):
        logits = super().decode_batch(tokens, seqs, stream)
        self._fault(stream)
        return logits


def drive(pipe, limit=400):
    """Step until idle (at most ``limit`` steps, so a pipeline that never gets there fails
    instead of hanging); the number of steps that raised FeedError."""
    faults = 0
    for _ in range(limit):
        if pipe.idle:
            return faults
        try:
            pipe.step()
        except FeedError:
            faults += 1
    raise AssertionError(f"not idle after {limit} steps ({faults} raised)")


def check_against_oracle(reqs, greedy, stops=()):
    """No request finishes "stop"/"length" with tokens other than greedy decoding's; a failed
    one keeps only tokens committed before the fault (a prefix of greedy decoding's)."""
    for req in reqs:
        want = greedy(req.prompt, req.max_new_tokens, VOCAB, stops=stops)
        if req.finish_reason in ("stop", "length"):
            assert req.tokens == want, req
        else:
            assert req.finish_reason in ("error", "abort"), req
            assert req.tokens == want[: len(req.tokens)], req


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fault_at", [1, 3, 6])
def test_a_forward_fault_fails_the_running_requests_and_commits_nothing_wrong(
        host, no_leaks, greedy, depth, fault_at):
    ps = prompts(6, seed=fault_at)
    with ForwardFault(VOCAB, block_size=4, num_blocks=120, max_rows=3,
                      fault_at=(fault_at,)) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9) for p in ps]  # three wait for a row
            running = reqs[:3]
            with pytest.raises(FeedError, match="injected fault"):
                for _ in range(100):
                    pipe.step()
            # The ones in the faulted step (and in flight after it).
            failed = check_failed(reqs, running, ["injected fault"])
            assert pipe.step() == failed  # reported by the next step
            check_the_rest_run(pipe, reqs, running)  # on a clean batch
        assert model.pool.free_count == model.pool.num_blocks


class WaitsFirst(ForwardFault):
    """A model whose fed forward first waits for its stream (a host fallback that needs the work
    before it done): at depth 2 a fault of the step in flight surfaces in that wait, inside the
    next step's launch, before the step's own wait could report it (it is reported once)."""

    def decode_batch_fed(self, sources, seqs, stream):
        mf.stream_synchronize(stream)
        return super().decode_batch_fed(sources, seqs, stream)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fault_at", [1, 2, 4])
def test_a_fault_that_surfaces_in_a_later_launch_is_still_a_fault(host, no_leaks, greedy, depth,
                                                                   fault_at):
    """Not a refusal to retry: the steps in flight ran behind the fault, so the requests in them
    fail with its reason and none of their tokens from it on is committed."""
    ps = prompts(5, seed=40 + fault_at)
    with WaitsFirst(VOCAB, block_size=4, num_blocks=120, max_rows=3,
                    fault_at=(fault_at,)) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=8) for p in ps]
            running = reqs[:3]
            with pytest.raises(mf.HostFunctionError, match="injected fault"):
                for _ in range(100):
                    pipe.step()
            assert pipe.stats.reserved_in_flight == 0
            check_failed(reqs, running, ["injected fault"], most=fault_at - 1)  # one id a step
            check_the_rest_run(pipe, reqs, running)
        assert model.pool.free_count == model.pool.num_blocks


class VerifyWaitsFirst(ReferenceModel):
    """WaitsFirst's speculative twin: each verify forward waits for its stream first, and the
    ``fault_at``-th queues a host function that raises after it."""

    def __init__(self, *args, fault_at=(), **kw):
        super().__init__(*args, **kw)
        self.fault_at = set(fault_at)
        self.forwards = 0

    def decode_batch_verify(self, fed, seqs, k, stream, **kw):
        mf.stream_synchronize(stream)
        logits = super().decode_batch_verify(fed, seqs, k, stream, **kw)
        self.forwards += 1
        if self.forwards in self.fault_at:
            def boom(at=self.forwards):
                raise RuntimeError(f"injected fault in verify {at}")
            mf.launch_host_func(stream, boom)
        return logits


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fault_at", [1, 3])
def test_a_speculative_fault_that_surfaces_in_a_later_launch_is_still_a_fault(
        host, no_leaks, greedy, depth, fault_at):
    from metrale_feed.testing.drafter import ReferenceDrafter

    ps = prompts(5, seed=50 + fault_at)
    with VerifyWaitsFirst(VOCAB, block_size=4, num_blocks=160, max_rows=3,
                          fault_at=(fault_at,)) as model:
        drafter = ReferenceDrafter(VOCAB, 2, 0.5)
        with DecodePipeline(model, 3, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=12) for p in ps]
            running = reqs[:3]
            with pytest.raises(mf.HostFunctionError, match="injected fault"):
                for _ in range(100):
                    pipe.step()
            # Each verify step emits 1 to k + 1 = 3 ids a row.
            check_failed(reqs, running, ["injected fault"], most=3 * (fault_at - 1))
            check_the_rest_run(pipe, reqs, running)
        assert model.pool.free_count == model.pool.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_repeated_faults_never_finish_a_request_with_wrong_tokens(host, no_leaks, greedy, depth):
    """Faults at several forwards, submissions between them, stops: after each fault the
    pipeline goes on, and the oracle holds for every request that finishes normally."""
    ps = prompts(10, seed=23)
    stops = (5, 17)
    with ForwardFault(VOCAB, block_size=2, num_blocks=200, max_rows=4,
                      fault_at=(2, 7, 8, 15)) as model:
        with DecodePipeline(model, 4, depth=depth) as pipe:
            reqs = []
            faults = 0
            for p in ps:
                reqs.append(pipe.submit(p, max_new_tokens=6, stop_ids=stops))
                try:
                    pipe.step()
                except FeedError:
                    faults += 1
            faults += drive(pipe)
            assert faults >= 2
            assert all(r.finished for r in reqs)
            check_against_oracle(reqs, greedy, stops)
            assert any(r.finish_reason == "error" for r in reqs)
            assert any(r.finish_reason in ("stop", "length") for r in reqs)
        assert model.pool.free_count == model.pool.num_blocks


def test_a_prefill_that_raises_leaves_nothing_behind(host, no_leaks, greedy):
    """A prefill that raises (not a full pool): step() raises it, the request stays waiting with
    no view and no block, and close() and abort() work after it and free every event and
    pinned byte of the ring."""

    class BadPrefill(ReferenceModel):
        fail = True

        def prefill_many(self, seqs, id_lists, stream=None):
            if self.fail:
                raise RuntimeError("injected: the prefill failed")
            super().prefill_many(seqs, id_lists, stream)

    with BadPrefill(VOCAB, block_size=4, num_blocks=50, max_rows=2) as model:
        pipe = DecodePipeline(model, 2)
        a = pipe.submit([1, 2, 3], max_new_tokens=3)
        b = pipe.submit([4, 5], max_new_tokens=3)
        with pytest.raises(RuntimeError, match="injected"):
            pipe.step()
        assert a.status is RequestStatus.WAITING and a._seq is None
        pipe.abort(b)
        assert b.finish_reason == "abort"
        pipe.close()
        assert a.finish_reason == "abort"
        assert model.pool.free_count == 50

    with BadPrefill(VOCAB, block_size=4, num_blocks=50, max_rows=2) as model:
        with DecodePipeline(model, 2) as pipe:  # and it may simply be retried
            a = pipe.submit([1, 2, 3], max_new_tokens=3)
            with pytest.raises(RuntimeError, match="injected"):
                pipe.step()
            model.fail = False
            drive(pipe)
            assert a.tokens == greedy([1, 2, 3], 3, VOCAB)
        assert model.pool.free_count == 50


def test_a_one_by_one_prefill_that_raises_admits_none_of_its_batch(host, no_leaks, greedy):
    """A model without ``prefill_many`` is prefilled one request at a time: when the second one's
    prefill raises, the first one (already prefilled) is not left waiting with a view and its
    blocks (the status says waiting, so it has neither); the whole admission is undone and is
    retried by the next step."""

    class OneByOne(ReferenceModel):
        prefill_many = None  # the capability is not there: one prefill per request
        calls = 0

        def prefill(self, seq, ids, stream=None):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("injected: the second prefill failed")
            ReferenceModel.prefill_many(self, [seq], [ids], stream)

    ps = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    with OneByOne(VOCAB, block_size=2, num_blocks=60, max_rows=3) as model:
        with DecodePipeline(model, 3) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=4) for p in ps]
            with pytest.raises(RuntimeError, match="injected"):
                pipe.step()
            assert [(r.status, r._seq) for r in reqs] == [(RequestStatus.WAITING, None)] * 3
            assert model.pool.free_count == 60
            drive(pipe)
            assert [r.tokens for r in reqs] == [greedy(p, 4, VOCAB) for p in ps]
        assert model.pool.free_count == 60


def test_status_moves_from_waiting_through_running_and_preempted_to_finished(host, no_leaks):
    assert issubclass(RequestStatus, __import__("enum").Enum)
    assert mf.RequestStatus is RequestStatus
    seen = {}

    with ReferenceModel(VOCAB, block_size=2, num_blocks=9, max_rows=3) as model:
        with DecodePipeline(model, 3) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=8) for p in prompts(4, seed=5, lo=2, hi=3)]
            stopper = pipe.submit([9, 9], max_new_tokens=8,
                                  stop_ids=range(VOCAB))  # stops on its first token
            assert all(r.status is RequestStatus.WAITING for r in reqs)
            for _ in range(400):
                if pipe.idle:
                    break
                pipe.step()
                for r in reqs + [stopper]:
                    seen.setdefault(id(r), []).append(r.status)
                    # the rest of its state follows the status: a view (and blocks) exactly
                    # while it runs, a block boundary scheduled only then
                    running = r.status is RequestStatus.RUNNING
                    assert (r._seq is not None) is running, (r, r._seq)
                    assert running or (r._bound == -1 and r not in pipe._running)
            aborted = pipe.submit([1, 2], max_new_tokens=3)
            pipe.abort(aborted)
    assert pipe.stats.preemptions > 0
    for r in reqs:
        statuses = seen[id(r)]
        assert statuses[-1] is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
        assert RequestStatus.RUNNING in statuses
        assert all(not s.finished for s in statuses[: statuses.index(statuses[-1])])
    assert any(RequestStatus.PREEMPTED in seen[id(r)] for r in reqs)
    assert stopper.status is RequestStatus.FINISHED_STOPPED and stopper.finish_reason == "stop"
    assert aborted.status is RequestStatus.FINISHED_ABORTED and aborted.tokens == []
    assert [s.finished for s in RequestStatus] == [False] * 3 + [True] * 6
    assert "length" in repr(reqs[0])
