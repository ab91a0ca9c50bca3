"""``SamplingParams``: one typed, checked object per request, and ``submit(params=)``.

The object must refuse exactly what ``submit``'s keywords refuse, with the same messages; a
request submitted with it must decode as the same keywords would; and it is what the request
keeps (``Request.params``)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

import metrale_feed as mf

from conftest import VOCAB, model_for, prompts

# Each bad keyword set, refused at construction: the same type and message through submit.
BAD = [
    dict(temperature=-0.5), dict(temperature=float("nan")), dict(temperature="0.8"),
    dict(temperature=True), dict(temperature=None), dict(temperature=1e39),
    dict(top_k=-1), dict(top_k=2 ** 32), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.5),
    dict(min_p=1.0), dict(min_p=-0.1), dict(seed=-1), dict(seed=2 ** 64),
    dict(repetition_penalty=0.0), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
    dict(logit_bias=[(1, 2.0)]), dict(logit_bias={-1: 1.0}), dict(logit_bias={1: float("inf")}),
    dict(logit_bias={i: 1.0 for i in range(mf._core.MAX_LOGIT_BIAS + 1)}),
    dict(min_tokens=-1), dict(min_tokens="2"), dict(logprobs=1), dict(top_logprobs=2),
    dict(logprobs=True, top_logprobs=mf._core.MAX_TOP_LOGPROBS + 1),
]


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.mark.parametrize("bad", BAD, ids=lambda d: ",".join(f"{k}" for k in d))
def test_construction_refuses_what_submit_refuses_with_its_message(bad):
    with pytest.raises((TypeError, ValueError)) as made:
        mf.SamplingParams(**bad)
    model = model_for(rows=2)
    try:
        with mf.DecodePipeline(model, 2) as pipe:
            with pytest.raises(type(made.value)) as submitted:
                pipe.submit([1, 2], max_new_tokens=4, **bad)
            assert str(submitted.value) == str(made.value)
            assert pipe.run() == []  # nothing was queued
    finally:
        model.close()


def test_values_are_the_float32_the_kernels_read_and_the_defaults_are_submits():
    p = mf.SamplingParams(temperature=0.7, top_p=0.3, min_p=0.1, repetition_penalty=1.1,
                          presence_penalty=0.3, frequency_penalty=-0.2, logit_bias={9: 0.1, 3: 1})
    assert (p.temperature, p.top_p, p.min_p) == (_f32(0.7), _f32(0.3), _f32(0.1))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (
        _f32(1.1), _f32(0.3), _f32(-0.2))
    assert list(p.logit_bias.items()) == [(3, 1.0), (9, _f32(0.1))]  # sorted by id
    with pytest.raises(TypeError):
        p.logit_bias[3] = 2.0  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    d = mf.SamplingParams()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.seed) == (0.0, 0, 1.0, 0.0, 0)
    assert (d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (d.logit_bias, d.min_tokens, d.logprobs, d.top_logprobs) == (None, 0, False, 0)
    assert not d.sampled and not d.penalised
    assert mf.SamplingParams(logit_bias={}).logit_bias is None
    assert mf.SamplingParams(min_tokens=1).penalised
    assert not mf.SamplingParams(repetition_penalty=1.0).penalised


def test_equal_params_are_equal_and_hash_alike_and_replace_checks_again():
    a = mf.SamplingParams(temperature=0.5, logit_bias={4: 1.0, 2: -1.0}, seed=3)
    b = mf.SamplingParams(temperature=0.5, logit_bias={2: -1.0, 4: 1.0}, seed=3)
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(seed=4) and a.replace(seed=4).seed == 4
    assert a.replace() == a
    with pytest.raises(ValueError, match="top_p"):
        a.replace(top_p=2.0)
    assert len({a, b, a.replace(seed=4)}) == 2


def test_submit_takes_params_or_keywords_never_both():
    model = model_for(rows=2)
    try:
        with mf.DecodePipeline(model, 2) as pipe:
            with pytest.raises(TypeError, match="not both"):
                pipe.submit([1], mf.SamplingParams(), max_new_tokens=2, temperature=0.5)
            with pytest.raises(TypeError, match="SamplingParams"):
                pipe.submit([1], {"temperature": 0.5}, max_new_tokens=2)
            with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
                pipe.submit([1], max_new_tokens=2, temprature=0.5)
            # What depends on the pipeline is checked by submit, for params as for keywords.
            for how in ({"params": mf.SamplingParams(logit_bias={VOCAB: 1.0})},
                        {"logit_bias": {VOCAB: 1.0}}):
                with pytest.raises(ValueError, match=f"logit_bias id {VOCAB} is outside"):
                    pipe.submit([1], max_new_tokens=2, **how)
            for how in ({"params": mf.SamplingParams(min_tokens=3)}, {"min_tokens": 3}):
                with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_new_tokens = 2\]"):
                    pipe.submit([1], max_new_tokens=2, **how)
            assert pipe.run() == []
    finally:
        model.close()


CASES = [
    dict(),
    dict(temperature=0.8, top_p=0.9, seed=5),
    dict(temperature=1.2, top_k=7, min_p=0.05, seed=2 ** 63 + 1),
    dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={3: 2.0}, min_tokens=2),
    dict(temperature=0.6, frequency_penalty=0.7, seed=9, logprobs=True, top_logprobs=3),
]


def test_a_request_with_params_decodes_as_one_with_the_same_keywords():
    ps = prompts(len(CASES), seed=4)

    def run(with_params):
        model = model_for(rows=4)
        try:
            with mf.DecodePipeline(model, 4, depth=2) as pipe:
                reqs = []
                for prompt, kw in zip(ps, CASES):
                    if with_params:
                        params = mf.SamplingParams(**kw)
                        reqs.append(pipe.submit(prompt, params, max_new_tokens=9, stop_ids=(5,)))
                        assert reqs[-1].params is params
                    else:
                        reqs.append(pipe.submit(prompt, max_new_tokens=9, stop_ids=(5,), **kw))
                        assert reqs[-1].params == mf.SamplingParams(**kw)
                pipe.run()
            return [(r.tokens, r.finish_reason, r.logprobs, r.top_logprobs) for r in reqs]
        finally:
            model.close()

    by_params, by_keywords = run(True), run(False)
    assert by_params == by_keywords
    assert any(len(t) for t, *_ in by_params)
    assert by_params[4][2] is not None and len(by_params[4][2]) == len(by_params[4][0])


def test_request_reads_its_params():
    model = model_for(rows=2)
    try:
        with mf.DecodePipeline(model, 2) as pipe:
            params = mf.SamplingParams(temperature=0.5, top_k=4, repetition_penalty=1.2,
                                       logit_bias={7: 1.5}, min_tokens=1)
            req = pipe.submit([1, 2], params, max_new_tokens=3)
            assert (req.temperature, req.top_k, req.repetition_penalty, req.min_tokens) == (
                params.temperature, 4, params.repetition_penalty, 1)
            assert req.logit_bias == {7: 1.5} and req.sampled
            pipe.run()
    finally:
        model.close()
