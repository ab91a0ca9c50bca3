"""DecodePipeline: its contract case by case, against the host oracle (``greedy``)."""

from __future__ import annotations

import gc
import warnings

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError, Request
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, model_for, prompts


@pytest.mark.parametrize("depth", [1, 2])
def test_tokens_equal_greedy_and_every_block_comes_back(host, no_leaks, greedy, depth):
    with model_for() as model:
        with DecodePipeline(model, 4, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=3 + i) for i, p in enumerate(prompts(7))]
            done = pipe.run()
            assert sorted(map(id, done)) == sorted(map(id, reqs))
            for i, (req, p) in enumerate(zip(reqs, prompts(7))):
                assert req.tokens == greedy(p, 3 + i, VOCAB)
                assert req.finished and req.finish_reason == "length"
            stats = pipe.stats
            assert stats.steps == stats.launches and stats.reserved_in_flight == 0
            assert (stats.ahead_launches > 0) == (depth == 2)
        assert model.pool.free_count == model.pool.num_blocks


def test_depth_1_and_2_give_the_same_tokens_with_stops_and_bans(host, no_leaks, greedy):
    results = []
    for depth in (1, 2):
        with model_for(3) as model, DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = []
            for i, p in enumerate(prompts(6, seed=4)):
                ban = (greedy(p, 1, VOCAB)[0], NO_TOKEN) if i % 2 else None
                traj = greedy(p, 10, VOCAB, ban=ban)
                stops = (traj[i % 10],) if i % 3 == 0 else ()
                reqs.append((pipe.submit(p, max_new_tokens=10, stop_ids=stops, ban=ban), p, stops, ban))
            pipe.run()
            for req, p, stops, ban in reqs:
                assert req.tokens == greedy(p, 10, VOCAB, stops=stops, ban=ban)
                assert req.finish_reason == ("stop" if req.tokens[-1] in stops else "length")
            results.append([r[0].tokens for r in reqs])
    assert results[0] == results[1]


@pytest.mark.parametrize("depth", [1, 2])
def test_stop_on_the_first_token_and_one_new_token(host, no_leaks, greedy, depth):
    p = [5, 6, 7]
    first = greedy(p, 1, VOCAB)[0]
    with model_for() as model, DecodePipeline(model, 4, depth=depth) as pipe:
        a = pipe.submit(p, max_new_tokens=50, stop_ids=[first])
        b = pipe.submit(p, max_new_tokens=1)
        c = pipe.submit([9], max_new_tokens=4)  # a one-id prompt: nothing to prefill
        pipe.run()
        assert (a.tokens, a.finish_reason) == ([first], "stop")
        assert (b.tokens, b.finish_reason) == ([first], "length")
        assert c.tokens == greedy([9], 4, VOCAB)
        if depth == 2:
            assert pipe.stats.rows_discarded >= 1  # a's step ahead was thrown away
            assert pipe.stats.rollbacks >= 1 or pipe.stats.blocks_rolled_back == 0
        assert model.pool.free_count == model.pool.num_blocks


def test_fcfs_admission_beyond_max_rows(host, no_leaks, greedy):
    ps = prompts(5, seed=2)
    with model_for(2) as model, DecodePipeline(model, 2, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=4 + 2 * i) for i, p in enumerate(ps)]
        pipe.step()
        assert [len(r.tokens) > 0 for r in reqs] == [True, True, False, False, False]
        order = [0, 1]
        while not pipe.idle:
            pipe.step()
            for i, r in enumerate(reqs):
                if r.tokens and i not in order:
                    order.append(i)
        assert order == [0, 1, 2, 3, 4]  # first come, first served
        for i, (r, p) in enumerate(zip(reqs, ps)):
            assert r.tokens == greedy(p, 4 + 2 * i, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
def test_submissions_between_steps_join_the_next_launch(host, no_leaks, greedy, depth):
    ps = prompts(6, seed=8)
    with model_for(6) as model, DecodePipeline(model, 6, depth=depth) as pipe:
        reqs = [(pipe.submit(ps[0], max_new_tokens=12), ps[0])]
        for p in ps[1:]:
            pipe.step()
            pipe.step()
            reqs.append((pipe.submit(p, max_new_tokens=7), p))
        pipe.run()
        for req, p in reqs:
            assert req.tokens == greedy(p, len(req.tokens) and req.max_new_tokens, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_with_a_step_in_flight(host, no_leaks, greedy, depth):
    mf.configure_host(lag_us=300)  # the step ahead is still running when the abort comes
    ps = prompts(3, seed=3)
    with model_for(3, block_size=2) as model, DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=20) for p in ps]
        waiting = pipe.submit(ps[0], max_new_tokens=5)  # waits for a row: joins after the abort
        pipe.step()
        pipe.step()
        victim = reqs[1]
        seen = list(victim.tokens)
        pipe.abort(victim)
        assert victim.finished and victim.finish_reason == "abort"
        pipe.abort(victim)  # finished: left as it is
        reported = pipe.step()
        assert victim in reported
        pipe.run()
        assert victim.tokens == seen  # nothing committed after the abort
        assert seen == greedy(ps[1], 20, VOCAB)[: len(seen)]
        for r, p in ((reqs[0], ps[0]), (reqs[2], ps[2]), (waiting, ps[0])):
            assert r.tokens == greedy(p, r.max_new_tokens, VOCAB)
        if depth == 2:
            assert pipe.stats.rows_discarded >= 1
        assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == model.pool.num_blocks


def test_abort_a_waiting_request(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        a = pipe.submit([1, 2], max_new_tokens=5)
        b = pipe.submit([3, 4], max_new_tokens=5)
        pipe.abort(b)
        assert b.finish_reason == "abort" and b.tokens == []
        done = pipe.run()
        assert done == [b, a]
        with pytest.raises(FeedError, match="not submitted to this pipeline"):
            pipe.abort(object())


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_when_the_pool_runs_dry(host, no_leaks, greedy, depth):
    """Four requests that each fit alone in 8 blocks of 2 but not together: the youngest gives
    its blocks back and resumes by recompute; the tokens are those of greedy decoding."""
    ps = prompts(4, seed=11, lo=3, hi=6)
    with model_for(4, num_blocks=8, block_size=2) as model:
        with DecodePipeline(model, 4, depth=depth, debug=True) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9) for p in ps]
            pipe.run()
            assert pipe.stats.preemptions > 0
            for r, p in zip(reqs, ps):
                assert r.tokens == greedy(p, 9, VOCAB)
                assert r.finish_reason == "length"
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == 8


def test_bad_input_at_submit_queues_nothing(host, no_leaks):
    with model_for(2, num_blocks=4, block_size=2) as model, DecodePipeline(model, 2) as pipe:
        cases = [
            (ValueError, "empty", dict(prompt_ids=[], max_new_tokens=1)),
            (ValueError, "vocabulary", dict(prompt_ids=[VOCAB], max_new_tokens=1)),
            (ValueError, "vocabulary", dict(prompt_ids=[-1], max_new_tokens=1)),
            (TypeError, None, dict(prompt_ids=[1.0], max_new_tokens=1)),
            (ValueError, "max_new_tokens", dict(prompt_ids=[1], max_new_tokens=0)),
            (TypeError, None, dict(prompt_ids=[1], max_new_tokens=2.5)),
            (ValueError, "stop id", dict(prompt_ids=[1], max_new_tokens=1, stop_ids=[VOCAB])),
            (ValueError, "ban id", dict(prompt_ids=[1], max_new_tokens=1, ban=(VOCAB, NO_TOKEN))),
            (ValueError, "KV blocks", dict(prompt_ids=[1] * 6, max_new_tokens=4)),  # 9 positions
        ]
        for error, match, kw in cases:
            with pytest.raises(error, match=match):
                pipe.submit(kw.pop("prompt_ids"), **kw)
        assert pipe.idle and pipe.stats.admitted == 0
        ok = pipe.submit([1] * 5, max_new_tokens=4)  # 8 positions: exactly the pool
        pipe.run()
        assert len(ok.tokens) == 4
        req = pipe.submit([1], max_new_tokens=2)
        with pytest.raises(ValueError, match="ban id"):
            req.ban = (0, VOCAB)
        with pytest.raises((TypeError, ValueError)):
            req.ban = 5
    with pytest.raises(FeedError, match="closed"):
        pipe.submit([1], max_new_tokens=1)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_ban_changed_between_steps_applies_from_the_next_launch(host, no_leaks, greedy, depth):
    p = [4, 4, 2]
    with model_for(1) as model, DecodePipeline(model, 1, depth=depth) as pipe:
        req = pipe.submit(p, max_new_tokens=10)
        pipe.step()
        pipe.step()
        # Depth 2: one step is already in flight with the old ban.
        at = len(req.tokens) + (depth - 1)
        ban = (greedy(p + req.tokens, 10, VOCAB)[depth - 1], NO_TOKEN)
        req.ban = ban
        assert req.ban == ban and isinstance(req.ban, mf.RowMask)
        pipe.run()
        assert req.tokens == greedy(p, 10, VOCAB, switch=(at, ban))


class NoFeedModel(ReferenceModel):
    def supports_device_token_feed(self):
        return False


def test_a_model_without_the_device_feed_runs_at_depth_1_only(host, no_leaks, greedy):
    with NoFeedModel(VOCAB, block_size=3, num_blocks=60, max_rows=2) as model:
        with pytest.raises(FeedError, match="depth=1"):
            DecodePipeline(model, 2, depth=2)
        with DecodePipeline(model, 2, depth=1) as pipe:
            ps = prompts(3, seed=5)
            reqs = [pipe.submit(p, max_new_tokens=6) for p in ps]
            pipe.run()
            assert [r.tokens for r in reqs] == [greedy(p, 6, VOCAB) for p in ps]
        assert model.pool.free_count == 60


class PushesModel(NoFeedModel):
    """The synchronous path with a model that pushes ``push(seq, token)`` instead of its input."""

    def decode_batch(self, tokens, seqs, stream=None):
        logits = super().decode_batch(tokens, seqs, stream)  # pushes its inputs (accepted)
        for token, seq in zip(tokens, seqs):
            self.push(seq, token)
        return logits


@pytest.mark.parametrize("write", ["wrong id", "extend", "assign", "item", "clear", "pop",
                                   "iadd"])
def test_the_sequence_view_refuses_writes_it_would_drop(host, no_leaks, write):
    """A running request's ``SequenceState.tokens`` is the pipeline's: a model's push of the id
    it writes is accepted (the pipeline commits it itself), any other write raises FeedError
    naming the owner instead of being dropped, and nothing of the refused step is committed."""

    def push(seq, token):
        if write == "wrong id":
            seq.tokens.append((token + 1) % VOCAB)
        elif write == "extend":
            seq.tokens.extend([token, token])
        elif write == "assign":
            seq.tokens = [token]
        elif write == "item":
            seq.tokens[0] = token
        elif write == "clear":
            seq.tokens.clear()
        elif write == "pop":
            seq.tokens.pop()
        else:
            tokens = seq.tokens
            tokens += [(token + 1) % VOCAB]

    with PushesModel(VOCAB, block_size=3, num_blocks=60, max_rows=2) as model:
        model.push = push
        with DecodePipeline(model, 2, depth=1) as pipe:
            req = pipe.submit([5, 6, 7], max_new_tokens=4)
            with pytest.raises(FeedError, match="the pipeline owns"):
                pipe.step()
            assert req.tokens == [] and not req.finished


def test_the_sequence_view_accepts_the_pushes_of_prefill_and_decode(host, no_leaks, greedy):
    """What the reference model pushes on the synchronous path (its prefill's history, then
    each step's input) is the pipeline's own history: accepted, and the view reads it back."""

    def push(seq, token):
        seen.append(list(seq.tokens))
        seq.tokens += [token]  # the same push again, as ``+=``: checked, and changes nothing

    with PushesModel(VOCAB, block_size=3, num_blocks=60, max_rows=2) as model:
        seen = []
        model.push = push
        with DecodePipeline(model, 2, depth=1) as pipe:
            p = [5, 6, 7]
            req = pipe.submit(p, max_new_tokens=4)
            pipe.run()
            out = greedy(p, 4, VOCAB)
            assert req.tokens == out
            history = p + out
            assert seen == [history[:n] for n in range(len(p) - 1, len(p) + 3)]


def test_a_refused_host_token_step_is_undone_through_the_view(host, no_leaks, greedy):
    """The feed method raises after ``decode_batch`` pushed its inputs: the router's undo of the
    push goes through the view (which the push never changed), so the step raises the model's
    own error, not the view's, and the next ``step()`` carries on exactly."""

    class FlakyFeed(NoFeedModel):
        calls = 0

        def argmax_batch_to_feed(self, *args, **kwargs):
            FlakyFeed.calls += 1
            if FlakyFeed.calls == 2:
                raise FeedError("injected: the feed method failed")
            return super().argmax_batch_to_feed(*args, **kwargs)

    ps = prompts(2, seed=3, lo=2, hi=4)
    with FlakyFeed(VOCAB, block_size=3, num_blocks=60, max_rows=2) as model:
        with DecodePipeline(model, 2, depth=1) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=5) for p in ps]
            pipe.step()
            with pytest.raises(FeedError, match="injected"):
                pipe.step()
            pipe.run()
            assert [r.tokens for r in reqs] == [greedy(p, 5, VOCAB) for p in ps]
        assert model.pool.free_count == 60


def test_constructor_checks(host, no_leaks):
    with model_for(2) as model:
        with pytest.raises(ValueError, match="depth"):
            DecodePipeline(model, 2, depth=3)
        with pytest.raises(ValueError, match="max_rows"):
            DecodePipeline(model, 3)
        with pytest.raises(TypeError, match="prefill"):
            DecodePipeline(mf.ModelDeviceFeed.__new__(type("M", (mf.ModelDeviceFeed,), {})), 2)


@pytest.mark.parametrize("env", [False, True])
def test_debug_mode_counts_one_wait_per_step_at_depth_2(host, no_leaks, greedy, monkeypatch, env):
    """With host lag, admissions and prefills between steps: the await of the oldest step is
    the only wait of the host (the model's staging grows instead of waiting)."""
    if env:
        monkeypatch.setenv("METRALE_FEED_DEBUG", "1")
    mf.configure_host(lag_us=200)
    ps = prompts(12, seed=6, lo=1, hi=40)
    with model_for(4, num_blocks=400) as model:
        pipe = DecodePipeline(model, 4, debug=None if env else True)
        assert pipe.debug
        reqs = []
        for i, p in enumerate(ps):
            reqs.append(pipe.submit(p, max_new_tokens=5 + i % 4))
            pipe.step()
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps > 0
        assert [r.tokens for r in reqs] == [greedy(p, 5 + i % 4, VOCAB) for i, p in enumerate(ps)]
        pipe.close()
        assert pipe.stats.host_syncs == pipe.stats.steps  # nothing was in flight at close


def test_debug_mode_catches_a_stale_feed_read(host, no_leaks, monkeypatch):
    """A scheduler bug that feeds a row from a cell the previous step did not write (here: the
    model is made to accept any row, and the pipeline feeds each row from the next one): in debug
    mode the cell holds NO_TOKEN and the step raises before committing anything."""
    import metrale_feed.sched.pipeline as pl

    class LaxModel(ReferenceModel):
        def argmax_batch_to_feed(self, *args):
            super().argmax_batch_to_feed(*args)
            self.feed_prev_rows = self.feed_max_rows  # a wrong bound: stale cells are readable

    monkeypatch.setattr(pl, "_identity", lambda rows: [mf.FeedSource.feed(i + 1) for i in range(rows)])
    for debug in (False, True):
        with LaxModel(VOCAB, block_size=4, num_blocks=50, max_rows=4) as model:
            with DecodePipeline(model, 4, depth=1, debug=debug) as pipe:
                req = pipe.submit([1, 2, 3], max_new_tokens=5)
                if not debug:
                    pipe.run()  # no error: the wrong ids go unnoticed
                    assert len(req.tokens) == 5
                    continue
                pipe.step()
                with pytest.raises(FeedError, match="debug: row 0 .* read input id 0xffffffff"):
                    pipe.step()


def test_close_with_steps_in_flight_returns_everything(host, no_leaks):
    mf.configure_host(lag_us=2000)
    with model_for(4) as model:
        pipe = DecodePipeline(model, 4)
        reqs = [pipe.submit(p, max_new_tokens=30) for p in prompts(6)]
        pipe.step()
        pipe.close()
        pipe.close()  # idempotent
        assert all(r.finish_reason == "abort" for r in reqs)
        assert model.pool.free_count == model.pool.num_blocks
        with pytest.raises(FeedError, match="closed"):
            pipe.step()


def test_stats_by_name_and_the_lazy_exports(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        pipe.submit([1], max_new_tokens=2)
        pipe.run()
        d = pipe.stats.as_dict()
        for name in ("launches", "ahead_launches", "reserved_blocks", "peak_reserved_in_flight",
                     "rollbacks", "blocks_rolled_back", "steps", "host_syncs", "rows_discarded",
                     "preemptions"):
            assert d[name] == pipe.stats[name] == getattr(pipe.stats, name)
        with pytest.raises(KeyError):
            pipe.stats["nope"]
    assert mf.Request is Request


def test_a_generic_model_without_block_size_reserves_every_row(host, no_leaks, greedy):
    """A model that declares no block size and no pool (its feed_info) and no prefill_many
    (None blocks the BatchPrefill capability): reserve_kv per row per step, one prefill per
    request, and preemption still works from KvPoolExhausted alone."""

    class Opaque(ReferenceModel):
        prefill_many = None  # a method set to None: the capability is not there

        def feed_info(self):
            return super().feed_info()._replace(block_size=None, pool=None)

        def prefill(self, seq, ids, stream=None):
            ReferenceModel.prefill_many(self, [seq], [ids], stream)

    ps = prompts(3, seed=13, lo=2, hi=4)
    with Opaque(VOCAB, block_size=2, num_blocks=9, max_rows=3) as model:
        with DecodePipeline(model, 3) as pipe:
            assert pipe._block_size is None and pipe._prefill_many is None
            reqs = [pipe.submit(p, max_new_tokens=8) for p in ps]
            pipe.run()
            assert [r.tokens for r in reqs] == [greedy(p, 8, VOCAB) for p in ps]
            assert pipe.stats.preemptions > 0
        assert model.pool.free_count == 9


def test_admit_prefills_before_the_next_step(host, no_leaks, greedy):
    ps = prompts(3, seed=21)
    with model_for(2) as model, DecodePipeline(model, 2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=4) for p in ps]
        free = model.pool.free_count
        assert pipe.admit() == 2  # max_rows: the third waits
        assert model.pool.free_count < free and pipe.stats.admitted == 2
        assert pipe.admit() == 0
        pipe.run()
        assert [r.tokens for r in reqs] == [greedy(p, 4, VOCAB) for p in ps]


def test_a_pipeline_dropped_without_close_returns_its_blocks(host, no_leaks):
    with model_for(2) as model:
        pipe = DecodePipeline(model, 2)
        pipe.submit([1, 2, 3], max_new_tokens=40)
        pipe.step()
        assert model.pool.free_count < model.pool.num_blocks
        with pytest.warns(ResourceWarning, match="not closed"):
            del pipe
            gc.collect()
        assert model.pool.free_count == model.pool.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_a_launch_that_raises_can_be_retried(host, no_leaks, greedy, depth):
    """The model's step raises once (here at a launch that crosses block boundaries): step()
    raises it, nothing is committed or counted twice, and the next step() carries on exactly."""

    class Flaky(ReferenceModel):
        calls = 0

        def decode_batch_fed(self, *args):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise FeedError("injected: the forward failed")
            return super().decode_batch_fed(*args)

    ps = prompts(3, seed=17, lo=2, hi=3)
    with Flaky(VOCAB, block_size=2, num_blocks=60, max_rows=3) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=7) for p in ps]
            with pytest.raises(FeedError, match="injected"):
                while True:
                    pipe.step()
            pipe.run()
            assert [r.tokens for r in reqs] == [greedy(p, 7, VOCAB) for p in ps]
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == 60
