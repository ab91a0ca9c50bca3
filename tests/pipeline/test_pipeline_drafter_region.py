"""A drafter's output is a region of its own: ``max_rows * (k + 1)`` words it may write, whatever
the step's rows, then guard words the step checks at its one wait (docs/speculative.md, "The
drafter interface"). Before the fix the drafts and the step's input ids shared one buffer of
``rows * (k + 1)`` words, so a drafter that wrote a padded ``max_rows * k`` batch (as a
graph-captured draft head does) or ``k + 1`` ids a row overwrote the inputs: wrong greedy tokens,
no error."""

from __future__ import annotations

import numpy as np

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.drafter import ReferenceDrafter

from conftest import VOCAB, greedy_tokens, model_for, prompts

ROWS, K = 4, 2


class _Writes(ReferenceDrafter):
    """The reference drafter's ids, written the way ``layout`` says, by one copy into ``out``:

    - ``"rows"``: ``rows * k`` ids, row ``r`` at ``r * k`` (the contract's minimum);
    - ``"padded"``: then ``NO_TOKEN`` up to ``max_rows * k`` words (a batch padded to the most
      rows, as a captured head writes);
    - ``"k+1"``: each row's ``k`` drafts at ``r * k``, then one scratch id a row after them all
      (``rows * (k + 1)`` words);
    - ``"full"``: then scratch ids up to ``max_rows * (k + 1)`` words, the whole region;
    - ``"over"`` (only on the calls in ``over``): one word past the region, over a guard word;
      ``"raw"`` the same, written through the device address as a kernel would.
    """

    def __init__(self, layout, over=()):
        super().__init__(VOCAB, K, 0.5)
        self.layout, self.over, self.calls = layout, set(over), 0
        self.kept = []  # the host arrays of the copies, alive until the stream passes them

    def propose(self, batch, out, stream):
        self.calls += 1
        words = self._words(batch.histories, batch.seeds, batch.masks, batch.k)
        region = ROWS * (K + 1)
        if self.layout == "padded":
            words += [NO_TOKEN] * ((ROWS - batch.rows) * K)
        elif self.layout in ("k+1", "full"):
            words += [7] * batch.rows
            if self.layout == "full":
                words += [11] * (region - len(words))
        data = np.array(words, np.uint32)
        self.kept = [data]
        mf.copy_h2d_async(out, data, stream)
        if self.calls in self.over:
            past = np.array([5], np.uint32)
            self.kept.append(past)
            at = out.ptr + region * 4 if self.layout == "raw" else None
            if at is None:  # one copy from the region's start through the word past it
                full = np.concatenate([data, np.full(region + 1 - len(data), 5, np.uint32)])
                self.kept.append(full)
                mf.copy_h2d_async(out, full, stream)
            else:
                mf.copy_h2d_async(at, past, stream)


def _decode(drafter, depth, requests):
    with model_for(rows=ROWS) as model:
        with DecodePipeline(model, ROWS, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=m, **kw) for p, m, kw in requests]
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    return reqs


def _requests():
    """Greedy and sampled requests of different lengths, more than the rows: the batch grows
    and shrinks, so most steps have fewer rows than ``max_rows``."""
    out = []
    for i, p in enumerate(prompts(7, seed=41)):
        sampling = {"temperature": 0.9, "seed": 100 + i} if i % 3 == 1 else {}
        out.append((p, 3 + 4 * (i % 4), sampling))
    return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("layout", ["padded", "k+1", "full"])
def test_a_drafter_may_write_its_whole_region_and_the_tokens_stay_exact(host, no_leaks, layout,
                                                                       depth):
    requests = _requests()
    want = _decode(_Writes("rows"), depth, requests)  # the same drafts, the contract's minimum
    got = _decode(_Writes(layout), depth, requests)
    for a, b, (p, m, sampling) in zip(want, got, requests):
        assert b.finish_reason == a.finish_reason == "length"
        assert b.tokens == a.tokens, (layout, p)  # sampled ones too: the same drafts, the same draws
        if not sampling:
            assert b.tokens == greedy_tokens(p, m, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("how", ["over", "raw"])
def test_a_drafter_that_writes_past_its_region_fails_that_step(host, no_leaks, how, depth):
    """A write past the region lands on a guard word: the step raises FeedError at its wait, its
    rows finish "error" with only the tokens committed before (greedy decoding's), and the
    pipeline carries on exactly with the requests after."""
    drafter = _Writes(how, over=(3,))
    ps = prompts(5, seed=43)
    with model_for(rows=ROWS) as model:
        with DecodePipeline(model, ROWS, depth=depth, speculative=drafter) as pipe:
            first = [pipe.submit(p, max_new_tokens=20) for p in ps[:3]]
            with pytest.raises(FeedError, match="wrote past its region"):
                for _ in range(50):
                    pipe.step()
            pipe.step()  # reports the failed requests
            for req in first:
                assert req.finish_reason == "error" and "past its region" in req.error
                assert req.tokens == greedy_tokens(req.prompt, 20, VOCAB)[: len(req.tokens)]
            later = [pipe.submit(p, max_new_tokens=9) for p in ps[3:]]
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    for req in later:  # the guard was armed again: no stale report, the exact tokens
        assert req.finish_reason == "length" and req.tokens == greedy_tokens(req.prompt, 9, VOCAB)
