"""The decisions between a split row's filter stages (``_core._select_decide``, select_rule.h: a
kernel on simt and cuda, a loop on the host backend's worker), through the whole protocol in one
process (helpers.calls.split_filtered: every slice's stages, the exchanges as copies, every
slice's own decisions): the unsharded ``sample_to_feed``'s ids for every split, with top_k through
candidate lists and through radix selects, top_p alone, min_p, and all of them; a call whose
slices disagree is refused alike by every slice; and the checks of the op's arguments."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

from helpers.calls import pick, split_filtered

ml_dtypes = pytest.importorskip("ml_dtypes")

SPLITS = (lambda v: [0, v], lambda v: [0, v // 2, v], lambda v: [0, 1, v // 3, v // 3, v],
          lambda v: [0, 600, 1900, v])
FILTERS = {  # name: per-row sampling params (rows of one call mix them)
    "top_k lists": dict(top_k=[5, 1, 40, 3, 200, 2]),
    "top_k radix": dict(top_k=[1500, 2000, 1100, 1025, 1900, 1300]),
    "top_p alone": dict(top_p=[0.9, 0.5, 0.99, 0.3, 1e-6, 0.75]),
    "top_k radix + top_p": dict(top_k=[1500, 1200, 0, 1700, 1030, 0], top_p=[0.8, 0.95, 0.6, 1.0, 0.5, 0.9]),
    "everything": dict(top_k=[0, 7, 1500, 0, 30, 2000], top_p=[0.9, 1.0, 0.7, 0.5, 0.8, 0.95],
                       min_p=[0.05, 0.0, 0.01, 0.2, 0.0, 0.001]),
}


def logits_for(rng, rows, vocab, dtype):
    x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    x[0, 100:130] = 3.5                # a run of ties at the top, across a slice boundary
    x[1, rng.integers(0, vocab, 50)] = -np.inf
    x[2, rng.integers(0, vocab, 50)] = np.nan
    x[3] = np.round(x[3])             # many ties at every key
    return x.astype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_the_protocol_draws_the_unsharded_ids(backend, dev, dtype, name):
    rng = np.random.default_rng(len(name))
    rows, vocab = 6, 2500
    logits = logits_for(rng, rows, vocab, dtype)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.6, 1.4, rows), seed=np.arange(rows) + 7,
                                position=5, **FILTERS[name])
    params["temperature"][5] = 0.0  # a greedy row in the call
    want, _ = pick(dev, logits, params=params, with_logprobs=False)
    for trial, offsets in enumerate(SPLITS):
        got, fault, words = split_filtered(dev, logits, offsets(vocab), params)
        _core._check_partials_fault(fault)
        assert words == [0] * len(words)
        assert np.array_equal(got, want), (name, trial, got, want)


def split_with_a_later_call(dev, logits, offsets, params, **kw):
    """split_filtered with the TOP header of every slice after the first carrying the next call's
    word (as a rank one call ahead would)."""
    from helpers import calls

    real = calls.split_filtered.__globals__["_core"]._select_partial

    def tampered(logits, params, partials, select, stage, *a, **kw):
        if stage == "top" and kw["start"] > 0:
            kw = dict(kw, call=kw["call"] + 1)
        return real(logits, params, partials, select, stage, *a, **kw)

    calls.split_filtered.__globals__["_core"]._select_partial = tampered
    try:
        return split_filtered(dev, logits, offsets, params, **kw)
    finally:
        calls.split_filtered.__globals__["_core"]._select_partial = real


def test_slices_that_disagree_are_refused_by_every_slice(host, dev):
    """A slice whose params differ (so its call word differs): every slice's first decision sees
    the header's call and refuses (its fault word); the combine's rows are NO_TOKEN."""
    rng = np.random.default_rng(2)
    rows, vocab = 4, 1000
    logits = logits_for(rng, rows, vocab, "float32")
    params = mf.sampling_params(rows, temperature=1.0, top_k=1500, top_p=0.9)
    got, fault, words = split_with_a_later_call(dev, logits, [0, 500, vocab], params)
    assert words[0] == words[1] and words[0] & 0xFF == 3 and words[0] >> 8 == 1, words  # the call, slice 1
    assert (got == mf.NO_TOKEN).all(), got


def test_fixed_rounds_carry_the_first_decisions_refusal_to_the_combine(backend, dev):
    """Fixed rounds (FilterRounds; what NCCL needs): every exchange runs after a refused first
    decision, and the later stages still write blocks whose headers agree, so only the combine's
    ``refused`` word keeps their race winners out: every row NO_TOKEN, the decision's fault raised.
    With slices that agree, the same protocol draws the unsharded ids."""
    rng = np.random.default_rng(5)
    rows, vocab = 4, 1000
    logits = logits_for(rng, rows, vocab, "float32")
    params = mf.sampling_params(rows, temperature=1.0, top_k=[3, 0, 40, 0], top_p=0.9, min_p=[0, 0.1, 0, 0],
                                seed=np.arange(rows))
    want, _ = pick(dev, logits, params=params, with_logprobs=False)
    got, fault, words = split_filtered(dev, logits, [0, 400, vocab], params, skip=False)
    _core._check_partials_fault(fault)
    assert np.array_equal(got, want), (got, want)
    got, fault, words = split_with_a_later_call(dev, logits, [0, 400, vocab], params, skip=False)
    assert (got == mf.NO_TOKEN).all(), got
    with pytest.raises(mf.FeedError, match="another call"):
        _core._check_partials_fault(fault)
    assert bytes(fault)[:4] == np.uint32(words[0]).tobytes() and words[0] & 0xFF == 3, (bytes(fault), words)


@pytest.mark.parametrize("top_p", [True, False])
def test_fixed_rounds_read_device_params_and_refuse_rows_they_do_not_serve(backend, dev, top_p):
    """Device params (a captured call's): the stages, decisions and the combine read them when they
    run, and give the unsharded ids for the rows fixed rounds serve. A row they do not serve (a
    top_k above their cap; top_p alone without their top_p select) is every slice's TOP decision
    fault, MF_FAULT_ROUNDS with the row, and the combine's: every row NO_TOKEN, never a draw
    without its filter."""
    rng = np.random.default_rng(6)
    rows, vocab = 5, 1500
    logits = logits_for(rng, rows, vocab, "float32")
    rounds = mf.FilterRounds(top_k=32, top_p=top_p)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.6, 1.4, rows), seed=np.arange(rows) + 3,
                                top_k=[5, 32, 0, 1, 0], top_p=[0.9, 1.0, 0.8 if top_p else 1.0, 0.5, 1.0],
                                min_p=[0.0, 0.05, 0.0, 0.0, 0.1])
    want, _ = pick(dev, logits, params=params, with_logprobs=False)
    for offsets in ([0, 700, vocab], [0, 1, 900, vocab]):
        got, fault, words = split_filtered(dev, logits, offsets, params, skip=False, rounds=rounds, device=True)
        _core._check_partials_fault(fault)
        assert words == [0] * len(words) and np.array_equal(got, want), (offsets, words, got, want)
    bad = params.copy()
    if top_p:
        bad["top_k"][3] = 33      # above the cap
    else:
        bad["top_k"][3], bad["top_p"][3] = 0, 0.5  # top_p alone
    got, fault, words = split_filtered(dev, logits, [0, 700, vocab], bad, skip=False, rounds=rounds, device=True)
    assert words == [9 | 3 << 8] * 2, words  # MF_FAULT_ROUNDS, row 3, on every slice
    assert (got == mf.NO_TOKEN).all(), got
    with pytest.raises(mf.FeedError, match="fixed rounds do not serve"):
        _core._check_partials_fault(fault)


@pytest.mark.parametrize("device", [False, True])
def test_slices_that_sample_a_row_with_other_params_are_refused_by_every_slice(backend, dev, device):
    """Each TOP record carries a digest of its row's params, so the first decision of every slice
    sees a row whose params differ between slices (device params too, which the call word cannot
    digest): MF_FAULT_PARAMS with the row on every slice, every row NO_TOKEN, whichever slice
    differs and however little (one seed bit, or a filter one slice's rounds would not serve)."""
    rng = np.random.default_rng(8)
    rows, vocab = 4, 1200
    logits = logits_for(rng, rows, vocab, "float32")
    params = mf.sampling_params(rows, temperature=1.0, top_k=[4, 0, 8, 0], top_p=[1.0, 0.9, 0.5, 1.0],
                                seed=np.arange(rows) + 11)
    rounds = mf.FilterRounds(top_k=8, top_p=True)
    for row, field, value in ((2, "seed", params["seed"][2] ^ 1), (1, "top_k", 9), (3, "temperature", 0.0)):
        other = params.copy()
        other[field][row] = value
        got, fault, words = split_filtered(dev, logits, [0, 500, 900, vocab], params, skip=False, rounds=rounds,
                                           device=device, slice_params=[params, params, other])
        assert words == [10 | row << 8] * 3, (field, words)  # MF_FAULT_PARAMS, that row, every slice
        assert (got == mf.NO_TOKEN).all(), got
        with pytest.raises(mf.FeedError, match=f"row {row} with other params"):
            _core._check_partials_fault(fault)


def decide_args(rows=2, **change):
    """Buffers for 2 slices of 2 rows, and the arguments of a TOP decision over them, changed."""
    world, block = 2, _core._partial_bytes(rows)
    bufs = dict(gathered=mf.DeviceBuffer(block * world), params=mf.DeviceBuffer(rows * 32),
                select=mf.DeviceBuffer(rows * _core.SELECT_ROW_BYTES),
                plan=mf.DeviceBuffer(rows * _core.SELECT_PLAN_BYTES), fault=mf.DeviceBuffer(4))
    args = dict(block_bytes=block, world=world, rank=0, rows=rows, step="top", vocab=100, call=1)
    args.update(change)
    return bufs, args


BAD = {
    "unknown step": (dict(step="middle"), ValueError, "step"),
    "rank past the world": (dict(rank=2), ValueError, "rank"),
    "a block too small": (dict(block_bytes=32), ValueError, "block_bytes"),
    "a block not of whole records": (dict(block_bytes=_core._partial_bytes(2) + 8), ValueError, "block_bytes"),
    "a round without its select": (dict(step="round"), ValueError, "select"),
    "a round past the last": (dict(step="round", sel="k", round=4, block_bytes=_core.PARTIAL_HEADER_BYTES + 2 * 2048),
                              ValueError, "round"),
    "an unknown select": (dict(next="q"), ValueError, "next"),
    "vocab 0 at the top": (dict(vocab=0), ValueError, "vocab"),
    "the gathered blocks past their buffer": (dict(world=3), ValueError, "gathered"),
    "state over the plan": (dict(alias=True), ValueError, "overlap"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_decisions_are_refused_before_queueing(host, no_leaks, case):
    change, error, match = BAD[case]
    alias = change.pop("alias", False)
    bufs, args = decide_args(**change)
    try:
        before = bytes(memoryview(bytearray(_core.SELECT_PLAN_BYTES * 2)))
        with pytest.raises((error, mf.FeedError), match=match):
            _core._select_decide(bufs["gathered"], args.pop("block_bytes"), args.pop("world"), args.pop("rank"),
                                 args.pop("rows"), bufs["params"], bufs["select"],
                                 bufs["select"] if alias else bufs["plan"], bufs["fault"], **args)
        mf.stream_synchronize()
        plan = np.zeros(_core.SELECT_PLAN_BYTES * 2, np.uint8)
        mf.copy_d2h_async(bufs["plan"], plan)
        mf.stream_synchronize()
        assert plan.tobytes() == before  # nothing ran
    finally:
        for b in bufs.values():
            b.close()
