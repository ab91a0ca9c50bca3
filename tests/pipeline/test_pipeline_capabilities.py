"""What a model can do beyond the Protocols' calls is read from its ``FeedInfo`` once, at
construction, never from its methods' signatures (issue 24): a declaration wins over a
signature both ways, and the defaults are the trait's."""

from __future__ import annotations

import pytest

from metrale_feed import DecodePipeline, FeedError
from metrale_feed.contract import FeedInfo
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, greedy_tokens


def test_the_defaults_are_what_the_trait_declares():
    info = FeedInfo(vocab=10)
    # The trait's feed methods take the logprobs keywords and VerifyStep takes advance=; the
    # trait's sample_batch_to_feed draws nothing.
    assert (info.logprobs, info.top_logprobs, info.raw_logits, info.verify_advance) == (True,) * 4
    assert info.sampling is False
    assert info.penalties is False  # a step's penalties as two calls around the feed method


@pytest.mark.parametrize("field, submit, match", [
    ("logprobs", dict(logprobs=True), "logprobs=False"),
    ("top_logprobs", dict(logprobs=True, top_logprobs=2), "top_logprobs=False"),
    ("raw_logits", dict(logprobs=True, presence_penalty=0.5), "raw_logits=False"),
])
def test_a_declared_lack_is_refused_at_submit_whatever_the_signature(host, no_leaks, field,
                                                                      submit, match):
    """The feed methods take every keyword, the FeedInfo says one is missing: the declaration
    wins (the refusal names it), and nothing else is refused."""

    class Declares(ReferenceModel):
        def feed_info(self):
            return super().feed_info()._replace(**{field: False})

    with Declares(VOCAB, block_size=4, num_blocks=40, max_rows=1) as model, \
            DecodePipeline(model, 1) as pipe:
        with pytest.raises(FeedError, match=match):
            pipe.submit([1, 2], max_new_tokens=2, **submit)
        assert pipe.idle
        req = pipe.submit([1, 2], max_new_tokens=3)
        pipe.run()
    assert req.tokens == greedy_tokens([1, 2], 3, VOCAB)


def test_capabilities_are_read_once_at_construction(host, no_leaks):
    calls = []

    class Counting(ReferenceModel):
        def feed_info(self):
            calls.append(1)
            return super().feed_info()

    with Counting(VOCAB, block_size=4, num_blocks=40, max_rows=2) as model, \
            DecodePipeline(model, 2) as pipe:
        made = len(calls)
        for _ in range(3):
            pipe.submit([3, 4], max_new_tokens=2, logprobs=True, top_logprobs=1)
        pipe.run()
        assert len(calls) == made


def test_a_verify_step_declared_without_advance_runs_at_depth_1_only(host, no_leaks):
    class Declares(ReferenceModel):  # its decode_batch_verify takes advance=, it says not
        def feed_info(self):
            return super().feed_info()._replace(verify_advance=False)

    with Declares(VOCAB, block_size=4, num_blocks=60, max_rows=2) as model:
        with pytest.raises(TypeError, match="verify_advance=False"):
            DecodePipeline(model, 2, depth=2, speculative=ReferenceDrafter(VOCAB, 2, 0.5))
        with DecodePipeline(model, 2, depth=1,
                            speculative=ReferenceDrafter(VOCAB, 2, 0.5)) as pipe:
            req = pipe.submit([4, 5], max_new_tokens=6)
            pipe.run()
    assert req.tokens == greedy_tokens([4, 5], 6, VOCAB)


def test_no_signature_is_read():
    import pathlib

    sched = pathlib.Path(__file__).resolve().parents[2] / "src" / "metrale_feed" / "sched"
    for path in sched.glob("*.py"):
        assert "inspect" not in path.read_text(), path.name
