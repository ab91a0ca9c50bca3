"""Penalties, logit_bias and min_tokens on the device (docs/penalties.md): the host backend and
the simt backend (the .cu kernels on the CPU) against a numpy oracle of vLLM's rules, bit for bit,
and the device counts that the update op keeps against the ones a rebuild writes."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _checks
from metrale_feed.penalties import MAX_LOGIT_BIAS, PenaltyState, SLOT_DTYPE

from helpers.penalty_oracle import penalize, round_to

NO = mf.NO_TOKEN


def as_dtype_bits(values, dtype):
    if dtype == "float32":
        return np.asarray(values, np.float32)
    import ml_dtypes

    return np.asarray(values, np.float32).astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)


def same(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"differ at {np.flatnonzero(bad)[:10]}: {got[bad][:10]} vs {want[bad][:10]}"


def random_request(rng, vocab, prompt_len=20, gen_len=30):
    prompt = rng.integers(0, min(vocab, 40), prompt_len).tolist()  # small range: repeats
    generated = rng.integers(0, min(vocab, 60), gen_len).tolist()
    bias = {int(t): float(rng.normal() * 3) for t in rng.choice(vocab, 5, replace=False)}
    return dict(prompt=prompt, generated=generated,
                repetition_penalty=float(rng.choice([1.0, 1.3, 0.7, 2.0])),
                presence_penalty=float(rng.choice([0.0, 0.5, -1.25])),
                frequency_penalty=float(rng.choice([0.0, 0.3, -0.7, 2.0])),
                logit_bias=bias, min_tokens=int(rng.choice([0, gen_len, gen_len + 5])),
                stop_ids=rng.choice(vocab, 3, replace=False).tolist())


def awkward_logits(rng, rows, vocab):
    l = (rng.normal(size=(rows, vocab)) * 4).astype(np.float32)
    l[:, ::7] = np.round(l[:, ::7])  # ties
    l[:, 1] = 0.0
    l[:, 2] = -0.0
    l[:, 3] = -np.inf
    if vocab > 5:
        l[0, 5] = np.nan
    return l


def run_apply(dev, state, logits, slots, dtype, *, start=0, row_stride=None):
    rows, vocab = logits.shape
    stride = row_stride or vocab
    padded = np.full((rows, stride), 7.0, np.float32)
    padded[:, :vocab] = logits
    host = as_dtype_bits(padded, dtype)
    buf = dev.upload(host)
    state.apply(buf, slots, vocab=vocab, dtype=dtype, row_stride=stride, start=start)
    out = dev.download(buf, host.dtype).reshape(rows, stride)
    buf.close()
    assert (out[:, vocab:].astype(np.float32) == 7.0).all(), "wrote past the row's columns"
    return out[:, :vocab].astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_apply_matches_the_vllm_oracle(backend, dev, dtype):
    rng = np.random.default_rng(5)
    rows, vocab = 6, 300
    logits = round_to(awkward_logits(rng, rows, vocab), dtype)
    reqs = [random_request(rng, vocab) for _ in range(rows)]
    slots = [4, NO, 0, 2, 5, 1]  # rows name slots in any order; one row has none
    with PenaltyState(8, capacity=128) as state:
        for r, slot in enumerate(slots):
            if slot != NO:
                state.set(slot, **reqs[r])
        got = run_apply(dev, state, logits, slots, dtype, row_stride=vocab + 3)
    for r, slot in enumerate(slots):
        want = logits[r] if slot == NO else penalize(logits[r], dtype=dtype, **reqs[r])
        same(got[r], want)


def test_stage_order_and_edge_cases(backend, dev):
    # id 0: biased and in the prompt (bias first, then the division); id 1: negative logit,
    # generated twice (multiplied, then frequency twice, presence once); id 2: a stop id with a
    # bias (min_tokens wins: -inf, and the repetition keeps it -inf); id 3: biased only.
    logits = np.array([[1.0, -2.0, 5.0, 0.25, 3.0]], np.float32)
    req = dict(prompt=[0, 0, 0], generated=[1, 1], repetition_penalty=2.0, presence_penalty=0.5,
               frequency_penalty=0.25, logit_bias={0: 3.0, 2: 10.0, 3: -1.0}, min_tokens=3,
               stop_ids=[2])
    with PenaltyState(1, capacity=8) as state:
        state.set(0, **req)
        got = run_apply(dev, state, logits, [0], "float32")
    assert got[0].tolist() == [2.0, -4.0 - 0.5 - 0.5, -np.inf, -0.75, 3.0]
    same(got[0], penalize(logits[0], **req))


def test_neutral_values_change_no_bit(backend, dev):
    rng = np.random.default_rng(1)
    logits = awkward_logits(rng, 2, 64)
    logits.view(np.uint32)[:, 6] = 0x7F800001  # a signalling NaN: an operation would quiet it
    with PenaltyState(2, capacity=64) as state:
        state.set(0, prompt=range(64), generated=list(range(64)) * 2)
        state.set(1, prompt=[], generated=[], logit_bias={5: 0.0}, min_tokens=0, stop_ids=[7])
        got = run_apply(dev, state, logits, [0, 1], "float32")
    assert got.view(np.uint32).tolist() == logits.view(np.uint32).tolist()


def test_a_nan_logit_keeps_its_bits(backend, dev):
    # The GPU turns any NaN an operation gives into its canonical NaN, the CPU keeps (and
    # quiets) the payload: a NaN the rules would touch is left as it is, on every backend.
    rng = np.random.default_rng(4)
    logits = awkward_logits(rng, 1, 40)
    nans = {8: 0x7F800001, 9: 0x7FC12345, 10: 0xFFC00000, 11: 0x7FBFFFFF}
    for col, bits in nans.items():
        logits.view(np.uint32)[0, col] = bits
    req = dict(prompt=[8, 9, 20], generated=[10, 10, 21], repetition_penalty=2.0,
               presence_penalty=0.5, frequency_penalty=0.25, logit_bias={11: 1.5, 22: -2.0})
    with PenaltyState(1, capacity=16) as state:
        state.set(0, **req)
        got = run_apply(dev, state, logits, [0], "float32")
    assert {c: int(got.view(np.uint32)[0, c]) for c in nans} == nans
    same(got[0], penalize(logits[0], **req))
    assert got[0, 20] != logits[0, 20] and got[0, 22] != logits[0, 22]  # the others did change


@pytest.mark.parametrize("world", [2, 3])
def test_a_shard_applies_its_own_slice(backend, dev, world):
    rng = np.random.default_rng(world)
    rows, vocab = 3, 250
    logits = awkward_logits(rng, rows, vocab)
    reqs = [random_request(rng, vocab) for _ in range(rows)]
    want = np.stack([penalize(logits[r], **reqs[r]) for r in range(rows)])
    bounds = [min(vocab, w * -(-vocab // world)) for w in range(world + 1)]
    with PenaltyState(rows, capacity=128) as state:
        for r in range(rows):
            state.set(r, **reqs[r])
        for lo, hi in zip(bounds, bounds[1:]):
            got = run_apply(dev, state, logits[:, lo:hi], list(range(rows)), "float32", start=lo)
            same(got, want[:, lo:hi])


@pytest.mark.parametrize("lo, hi", [(0, 900), (200, 900), (200, 700)])
def test_both_host_paths_give_the_oracle_bits(path, dev, lo, hi):
    """The host applies float32 stages 1 and 3 eight ids at a time where the CPU can: that path
    and the portable one against the oracle, bit for bit, on what a lane could get wrong, placed
    on penalised ids (biased ones, table ones, both) in the slice: NaN payloads, infinities, signed
    zeros, subnormals, results past the largest float32 (saturated), counts with and without the
    prompt's bit; and ids outside a shard's slice [lo, hi), below and above it, more biases and
    entries than a multiple of eight."""
    rng = np.random.default_rng(12)
    rows, vocab = 3, 900
    logits = (rng.normal(size=(rows, vocab)) * 4).astype(np.float32)
    big = np.finfo(np.float32).max
    awkward = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39,
                        big, -big, 1e38, -1e38, 3e38, -3e38], np.float32)
    reqs = []
    for r in range(rows):
        ids = lo + rng.permutation(hi - lo)  # every id named below is in the slice
        outside = [i for i in range(vocab) if not lo <= i < hi]
        prompt, generated = ids[:60], np.repeat(ids[40:120], rng.integers(1, 4, 80))
        biased = ids[100:141]  # 20 of them in the table too
        for chosen in (prompt[:16], generated[-16:], biased[:16], biased[-16:]):
            logits[r, chosen] = awkward
        logits.view(np.uint32)[r, biased[16:18]] = [0x7FC12345, 0x7F800001]  # payloads, biased
        logits.view(np.uint32)[r, prompt[20:22]] = [0xFFC0BEEF, 0x7F800001]  # and in the table
        bias = {int(t): float(b) for t, b in zip(biased, rng.normal(size=41) * [1e38, 5, 2][r])}
        bias.update({int(biased[10]): 3e38, int(biased[11]): -3e38})  # on 1e38 and -1e38: saturate
        if outside:  # ids of the other slices, in both lists
            bias.update({int(t): 1.0 for t in rng.choice(outside, 9, replace=False)})
            prompt = np.concatenate([prompt, rng.choice(outside, 11, replace=False)])
        reqs.append(dict(prompt=prompt.tolist(), generated=generated.tolist(),
                         repetition_penalty=[0.5, 1.7, 1e-30][r], presence_penalty=[-0.5, 1.25, 2.0][r],
                         frequency_penalty=[0.75, -2.0, 1e-3][r], logit_bias=bias,
                         min_tokens=[0, 10**6, 0][r], stop_ids=ids[200:203].tolist()))
    with np.errstate(invalid="ignore"):  # the oracle's arithmetic on the NaNs
        want = np.stack([penalize(logits[r], **reqs[r]) for r in range(rows)])
    assert (np.abs(want[np.isfinite(logits)]) == big).sum() > 3  # some results saturated
    with PenaltyState(rows, capacity=512) as state:
        for r in range(rows):
            state.set(r, **reqs[r])
        got = run_apply(dev, state, logits[:, lo:hi], [0, 1, 2], "float32", start=lo)
    nan = np.isnan(logits[:, lo:hi])
    assert got.view(np.uint32)[nan].tolist() == logits[:, lo:hi].view(np.uint32)[nan].tolist()
    same(got, want[:, lo:hi])


def test_update_counts_what_a_rebuild_writes(backend, dev):
    rng = np.random.default_rng(9)
    vocab, steps = 50, 40
    prompts = [[1, 2, 2, 3], [4], [7, 7]]
    slots = [2, 0, NO]
    generated = [[] for _ in prompts]
    ids_buf = mf.DeviceBuffer(3 * 4)
    with PenaltyState(3, capacity=64) as state:
        for r, slot in enumerate(slots):
            if slot != NO:
                state.set(slot, prompt=prompts[r], frequency_penalty=1.0)
        for _ in range(steps):
            ids = rng.integers(0, 12, 3).astype(np.uint32)
            if rng.random() < 0.2:
                ids[0] = NO  # a row with no candidate counts nothing
            dev.write(ids_buf, ids)
            state.update(ids_buf, slots)
            for r, t in enumerate(ids.tolist()):
                if slots[r] != NO and t != NO:
                    generated[r].append(t)
        counted = {r: state.read(slots[r]) for r in (0, 1)}
        for r in (0, 1):  # the same request rebuilt from its prompt and tokens: the same counts
            state.set(slots[r], prompt=prompts[r], generated=generated[r], frequency_penalty=1.0)
            rebuilt = state.read(slots[r])
            assert counted[r]["generated"] == rebuilt["generated"] == len(generated[r])
            assert counted[r]["table"] == rebuilt["table"]
        assert state.read(1)["entries"] == 0  # nobody's slot: never counted
        # and the penalties the counts give are the oracle's
        logits = awkward_logits(rng, 3, vocab)
        got = run_apply(dev, state, logits, slots, "float32")
    ids_buf.close()
    for r in (0, 1):
        same(got[r], penalize(logits[r], prompts[r], generated[r], frequency_penalty=1.0))
    same(got[2], logits[2])


def test_min_tokens_lifts_once_enough_tokens_were_counted(backend, dev):
    logits = np.array([[0.0, 1.0, 2.0]], np.float32)
    ids_buf = dev.upload(np.array([0], np.uint32))
    with PenaltyState(1, capacity=4) as state:
        state.set(0, prompt=[], min_tokens=2, stop_ids=[2])
        seen = []
        for _ in range(3):
            seen.append(run_apply(dev, state, logits, [0], "float32")[0, 2])
            state.update(ids_buf, [0])
    ids_buf.close()
    assert seen == [-np.inf, -np.inf, 2.0]


def test_full_table_drops_new_ids_and_stays_in_bounds(backend, dev):
    ids_buf = mf.DeviceBuffer(4)
    with PenaltyState(2, capacity=2) as state:
        state.set(0, prompt=[5])
        state.set(1, prompt=[9, 8])
        for t in (5, 6, 7, 6):
            dev.write(ids_buf, np.array([t], np.uint32))
            state.update(ids_buf, [0])
        got = state.read(0)
        neighbour = state.read(1)
    ids_buf.close()
    assert got["table"] == {5: mf.penalties._PROMPT | 1, 6: 2} and got["generated"] == 4
    assert neighbour["table"] == {9: mf.penalties._PROMPT, 8: mf.penalties._PROMPT}


def test_bad_calls_queue_nothing(host, dev):
    logits = dev.upload(np.zeros((2, 8), np.float32))
    with PenaltyState(2, capacity=4) as state:
        with pytest.raises(ValueError, match="slot 2"):
            state.apply(logits, [0, 2], vocab=8, dtype="float32")
        with pytest.raises(ValueError, match="two rows"):
            state.apply(logits, [1, 1], vocab=8, dtype="float32")
        with pytest.raises(ValueError, match="run past|vocabulary"):
            state.apply(logits, [0, 1], vocab=8, dtype="float32", start=mf.MAX_VOCAB - 4)
        with pytest.raises(ValueError, match="row_stride"):
            state.apply(logits, [0, 1], vocab=8, dtype="float32", row_stride=4)
        with pytest.raises(ValueError, match="past the end|logits"):
            state.apply(logits, [0, 1], vocab=8, dtype="float32", row_stride=9)
        with pytest.raises(ValueError, match="do not fit"):
            state.set(0, prompt=[1, 2, 3], generated=[4, 5])
        with pytest.raises(ValueError, match="slot"):
            state.set(2, prompt=[1])
        with pytest.raises(mf.FeedError, match="taken"):
            state.acquire(), state.acquire(), state.acquire()
    logits.close()


def test_the_checker_takes_vllm_ranges():
    ok = _checks.penalties(1.5, -2, 2, {3: 1, 1: -0.5}, 2, 10, 4)
    assert ok == (1.5, -2.0, 2.0, ((1, -0.5), (3, 1.0)), 2)
    bad = [((0.0, 0, 0, None, 0), ValueError), ((float("inf"), 0, 0, None, 0), ValueError),
           ((1.0, 2.5, 0, None, 0), ValueError), ((1.0, 0, -3, None, 0), ValueError),
           ((1.0, 0, 0, {10: 1.0}, 0), ValueError), ((1.0, 0, 0, {1: float("nan")}, 0), ValueError),
           ((1.0, 0, 0, [(1, 2.0)], 0), TypeError), ((1.0, 0, 0, None, 5), ValueError),
           ((1.0, 0, 0, None, -1), ValueError), (("1", 0, 0, None, 0), TypeError),
           ((1.0, True, 0, None, 0), TypeError), ((1.0, 0, 0, {1: "x"}, 0), TypeError)]
    for args, error in bad:
        with pytest.raises(error):
            _checks.penalties(*args, 10, 4)
    with pytest.raises(ValueError, match="at most 300"):
        _checks.penalties(1.0, 0, 0, {i: 1.0 for i in range(301)}, 0, 1000, 4)


def test_limits_have_one_source():
    assert _checks.MAX_LOGIT_BIAS == MAX_LOGIT_BIAS == 300
    assert SLOT_DTYPE.itemsize == 32


def test_set_checked_writes_what_set_writes(host):
    """The pipeline's trusted write (values ``submit`` checked once) and the checking ``set``
    give a slot the same record and table."""
    kw = dict(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=-0.5,
              logit_bias={9: 1.0, 3: -2.0}, min_tokens=2)
    prompt, generated, stops = [4, 4, 9, 1], [9, 2, 2, 7], [3, 11]
    checked = _checks.penalties(kw["repetition_penalty"], kw["presence_penalty"],
                                kw["frequency_penalty"], kw["logit_bias"], kw["min_tokens"],
                                50, 10)
    with PenaltyState(2, capacity=16) as state:
        state.set(0, prompt=prompt, generated=generated, stop_ids=stops, vocab=50, **kw)
        state.set_checked(1, prompt, generated, checked, frozenset(stops))
        a, b = state.read(0), state.read(1)
    assert a == b and a["entries"] == 5 and a["stops"] == 2 and a["biases"] == 2


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_a_refused_set_leaves_all_or_nothing(host, dev, fail_at):
    """A set whose Nth copy is refused raises, and the slot then applies either its old penalties
    or none (what ``clear`` leaves), never the old record over the new ids and biases; a set
    after it writes the whole request."""
    rng = np.random.default_rng(11)
    vocab = 64
    logits = round_to(awkward_logits(rng, 1, vocab), "float32")
    old, new = random_request(rng, vocab), random_request(rng, vocab)
    with PenaltyState(2, capacity=128) as state:
        state.set(1, **old)
        mf.stream_synchronize(0)
        mf.configure_host(fail_copy_at=fail_at)
        try:
            state.set(1, **new)
            refused = False
        except mf.FeedError:
            refused = True
        finally:
            mf.configure_host()
        got = run_apply(dev, state, logits, [1], "float32")[0]
        outcomes = {"new": penalize(logits[0], **new)}
        if refused:
            outcomes = {"old": penalize(logits[0], **old), "none": logits[0]}
        assert any(np.array_equal(got, want, equal_nan=True) for want in outcomes.values()), (
            f"copy {fail_at} refused: the slot applies neither of {sorted(outcomes)}")
        state.set(1, **new)
        same(run_apply(dev, state, logits, [1], "float32")[0], penalize(logits[0], **new))
