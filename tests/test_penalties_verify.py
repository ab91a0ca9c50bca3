"""Penalties over a verify's logit rows (docs/speculative.md, "Penalties"): position j of a row is
judged as if the drafts before it had been generated. The host and simt backends (the .cu kernels
on the CPU) against a numpy oracle of vLLM's rules applied to each position alone (the committed
tokens plus the walked drafts as its generated ids), against each other bit for bit, and against
the plain ops run one draft at a time; the update of a verify's cells against a rebuild from the
emitted ids."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.penalties import PenaltyState

from helpers.penalty_oracle import penalize, round_to
from test_penalties import as_dtype_bits, awkward_logits, random_request, same

NO = mf.NO_TOKEN


def walked(drafts, j):
    """The drafts position j counts: the first j, stopping at a NO_TOKEN (the verify's rule,
    written out here)."""
    out = []
    for d in drafts[:j]:
        if d == NO:
            break
        out.append(d)
    return out


def oracle(logits, reqs, slots, drafts, k, dtype="float32", lo=0, hi=None):
    """Each logit row r * (k + 1) + j: vLLM's rules over its request, the walked drafts counted as
    generated ids after the committed ones."""
    rows = len(slots)
    want = np.array(logits, np.float32, copy=True)
    for r in range(rows):
        if slots[r] == NO:
            continue
        req = dict(reqs[r])
        for j in range(k + 1):
            req["generated"] = list(reqs[r]["generated"]) + walked(drafts[r * k:(r + 1) * k], j)
            with np.errstate(invalid="ignore"):
                want[r * (k + 1) + j] = penalize(logits[r * (k + 1) + j], dtype=dtype, **req)
    return want[:, lo:hi]


def apply_verify(dev, state, logits, slots, drafts, k, dtype="float32", *, start=0, stride=None,
                 launch=False):
    n, vocab = logits.shape
    stride = stride or vocab
    padded = np.full((n, stride), 7.0, np.float32)
    padded[:, :vocab] = logits
    host = as_dtype_bits(padded, dtype)
    buf = dev.upload(host)
    dbuf = dev.upload(np.asarray(drafts, np.uint32))
    if launch:  # the pipeline's path: coerced once, then a step's drafts
        state.prepare(slots, vocab=vocab, dtype=dtype, row_stride=stride, start=start,
                      k=k).apply(buf, 0, dbuf)
    else:
        state.apply(buf, slots, vocab=vocab, dtype=dtype, row_stride=stride, start=start, k=k,
                    drafts=dbuf)
    out = dev.download(buf, host.dtype).reshape(n, stride)
    buf.close(), dbuf.close()
    assert (out[:, vocab:].astype(np.float32) == 7.0).all(), "wrote past the row's columns"
    return out[:, :vocab].astype(np.float32)


def adversarial_drafts(rng, reqs, k, vocab):
    """Per row: drafts that repeat earlier drafts, name the table's ids, the stop ids (while
    min_tokens bans them), ids nobody has seen, and a row whose drafts end early."""
    out = []
    for r, req in enumerate(reqs):
        pool = ([int(rng.integers(0, vocab))] + list(req["stop_ids"]) + list(req["generated"][:3])
                + list(req["prompt"][:3]))
        row = [int(rng.choice(pool)) for _ in range(k)]
        if k > 2:
            row[2] = row[0]  # a draft equal to an earlier draft
        if r == 2 and k > 1:
            row[1:] = [NO] * (k - 1)  # drafts ending early
        out.extend(row)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("k", [1, 4])
def test_each_position_is_the_oracle_with_the_drafts_before_it(backend, dev, dtype, k):
    rng = np.random.default_rng(40 + k)
    rows, vocab = 5, 300
    reqs = [random_request(rng, vocab, gen_len=int(rng.integers(0, 6))) for _ in range(rows)]
    for req in reqs:  # the ban lifts inside the verify: committed + j reaches min_tokens
        req["min_tokens"] = len(req["generated"]) + int(rng.integers(0, k + 2))
    slots = [3, NO, 0, 4, 1]
    drafts = adversarial_drafts(rng, reqs, k, vocab)
    logits = round_to(awkward_logits(rng, rows * (k + 1), vocab), dtype)
    with PenaltyState(6, capacity=128) as state:
        for r, slot in enumerate(slots):
            if slot != NO:
                state.set(slot, **reqs[r])
        got = apply_verify(dev, state, logits, slots, drafts, k, dtype, stride=vocab + 5)
        before = {s: state.read(s) for s in slots if s != NO}
    same(got, oracle(logits, reqs, slots, drafts, k, dtype))
    # the walk counts nothing into the slots: their state is the committed tokens' alone
    for r, slot in enumerate(slots):
        if slot != NO:
            assert before[slot]["generated"] == len(reqs[r]["generated"])


def test_a_repeated_draft_counts_twice_for_frequency_and_once_for_presence(backend, dev):
    logits = np.zeros((4, 6), np.float32)
    logits[:, 2] = 10.0
    logits[:, 4] = 1.0
    req = dict(prompt=[1], generated=[], repetition_penalty=2.0, presence_penalty=0.5,
               frequency_penalty=1.0, min_tokens=2, stop_ids=[4])
    with PenaltyState(1, capacity=8) as state:
        state.set(0, **req)
        got = apply_verify(dev, state, logits, [0], [2, 2, 5], 3)
    # position 0: nothing generated; 1: one 2; 2: two 2s; 3: two 2s and a 5
    assert got[:, 2].tolist() == [10.0, 5.0 - 1.0 - 0.5, 5.0 - 2.0 - 0.5, 5.0 - 2.0 - 0.5]
    assert got[:, 4].tolist() == [-np.inf, -np.inf, 1.0, 1.0]  # min_tokens 2 reached at j = 2
    assert got[:, 5].tolist() == [0.0, 0.0, 0.0, -1.5]  # 0 / 2 = 0, - 1 - 0.5
    assert got[:, 1].tolist() == [0.0] * 4  # the prompt's id: 0 either way


@pytest.mark.parametrize("world", [2, 3])
def test_a_shard_applies_its_own_columns(backend, dev, world):
    rng = np.random.default_rng(world + 7)
    rows, vocab, k = 3, 250, 3
    reqs = [random_request(rng, vocab) for _ in range(rows)]
    drafts = adversarial_drafts(rng, reqs, k, vocab)
    logits = awkward_logits(rng, rows * (k + 1), vocab)
    want = oracle(logits, reqs, list(range(rows)), drafts, k)
    bounds = [min(vocab, w * -(-vocab // world)) for w in range(world + 1)]
    with PenaltyState(rows, capacity=128) as state:
        for r in range(rows):
            state.set(r, **reqs[r])
        for lo, hi in zip(bounds, bounds[1:]):
            got = apply_verify(dev, state, logits[:, lo:hi], list(range(rows)), drafts, k,
                               start=lo, launch=lo > 0)
            same(got, want[:, lo:hi])


@pytest.mark.parametrize("capacity", [3, 4, 64])
def test_the_walk_is_the_plain_ops_one_draft_at_a_time(path, dev, capacity):
    """Position j equals the plain apply after the plain update counted drafts 0 .. j-1 into a
    copy of the slot, a full table (which drops a new id) included; both host paths."""
    walk_against_plain_ops(dev, capacity)


@pytest.mark.parametrize("capacity", [3, 64])
def test_the_kernels_walk_is_the_plain_ops_one_draft_at_a_time(backend, dev, capacity):
    walk_against_plain_ops(dev, capacity)


def walk_against_plain_ops(dev, capacity):
    rng = np.random.default_rng(capacity)
    vocab, k = 40, 5
    req = dict(prompt=[1, 2], generated=[3], repetition_penalty=1.5, presence_penalty=0.25,
               frequency_penalty=0.75, logit_bias={7: 2.0}, min_tokens=3, stop_ids=[9])
    drafts = [9, 11, 9, 12, 13]
    logits = (rng.normal(size=(k + 1, vocab)) * 3).astype(np.float32)
    ids = mf.DeviceBuffer(4)
    with PenaltyState(1, capacity=capacity) as state:
        state.set(0, **req)
        got = apply_verify(dev, state, logits, [0], drafts, k)
        for j in range(k + 1):
            state.set(0, **req)
            for d in drafts[:j]:
                dev.write(ids, np.array([d], np.uint32))
                state.update(ids, [0])
            buf = dev.upload(logits[j:j + 1])
            state.apply(buf, [0], vocab=vocab, dtype="float32")
            same(got[j], dev.download(buf, np.float32))
            buf.close()
    ids.close()


def test_simt_gives_the_host_bits(simt, dev):
    """The .cu kernel (simt) against the host backend's twin on one random verify, every dtype."""
    rng = np.random.default_rng(77)
    rows, vocab, k = 6, 500, 4
    reqs = [random_request(rng, vocab, gen_len=int(rng.integers(0, 8))) for _ in range(rows)]
    drafts = adversarial_drafts(rng, reqs, k, vocab)
    results = {}
    for name in ("simt", "host"):
        mf.set_backend(name)
        for dtype in ("float32", "bfloat16"):
            logits = round_to(awkward_logits(np.random.default_rng(1), rows * (k + 1), vocab), dtype)
            with PenaltyState(rows, capacity=64) as state:
                for r in range(rows):
                    state.set(r, **reqs[r])
                results[name, dtype] = apply_verify(dev, state, logits, list(range(rows)), drafts, k,
                                                    dtype)
    mf.set_backend("simt")
    for dtype in ("float32", "bfloat16"):
        assert results["simt", dtype].view(np.uint32).tolist() == \
            results["host", dtype].view(np.uint32).tolist()


def test_update_counts_the_emitted_ids_of_the_cells(backend, dev):
    rng = np.random.default_rng(3)
    k, steps = 3, 25
    slots = [1, NO, 0]
    prompts = [[1, 2, 2], [5], [4]]
    emitted = [[] for _ in slots]
    cells = mf.DeviceBuffer(len(slots) * (k + 2) * 4)
    with PenaltyState(2, capacity=64) as state:
        for r, slot in enumerate(slots):
            if slot != NO:
                state.set(slot, prompt=prompts[r], frequency_penalty=1.0)
        launch = state.prepare(slots, vocab=16, dtype="float32", k=k)
        for step in range(steps):
            words = []
            for r in range(len(slots)):
                n = int(rng.integers(1, k + 2))
                ids = rng.integers(0, 12, n).tolist()
                if step % 7 == 3 and r == 0:
                    n, ids = k + 2, []  # n out of range: counts nothing
                elif step % 5 == 1:
                    ids[-1] = NO  # a row with no candidate there: counts nothing
                row = [n] + ids + [NO] * (k + 1 - len(ids))
                words += row
                if slots[r] != NO and 1 <= n <= k + 1:
                    emitted[r] += [t for t in ids if t != NO]
            dev.write(cells, np.array(words, np.uint32))
            if step % 2:
                launch.update(cells, 0)
            else:
                state.update(cells, slots, k=k)
        counted = {r: state.read(slots[r]) for r in (0, 2)}
        for r in (0, 2):  # the same request rebuilt from its prompt and emitted ids
            state.set(slots[r], prompt=prompts[r], generated=emitted[r], frequency_penalty=1.0)
            rebuilt = state.read(slots[r])
            assert counted[r]["generated"] == rebuilt["generated"] == len(emitted[r])
            assert counted[r]["table"] == rebuilt["table"]
    cells.close()


def test_bad_verify_calls_queue_nothing(host, dev):
    k = 2
    logits = dev.upload(np.zeros((2 * (k + 1), 8), np.float32))
    drafts = dev.upload(np.zeros(2 * k, np.uint32))
    short = dev.upload(np.zeros(2 * k - 1, np.uint32))
    cells = dev.upload(np.zeros(2 * (k + 2), np.uint32))
    with PenaltyState(2, capacity=4) as state:
        state.set(0, prompt=[1], frequency_penalty=1.0)
        before = dev.download(logits, np.float32).tolist()
        kw = dict(vocab=8, dtype="float32")
        with pytest.raises(ValueError, match="drafts are given exactly when k > 0"):
            state.apply(logits, [0, 1], k=k, **kw)
        with pytest.raises(ValueError, match="drafts need k > 0"):
            state.apply(logits, [0, 1], drafts=drafts, **kw)
        with pytest.raises(ValueError, match="past the end"):
            state.apply(logits, [0, 1], k=k, drafts=short, **kw)
        with pytest.raises(TypeError, match="device memory"):
            state.apply(logits, [0, 1], k=k, drafts=[0, 0, 0, 0], **kw)
        with pytest.raises(ValueError, match="k"):
            state.apply(logits, [0, 1], k=mf.MAX_DRAFTS + 1, drafts=drafts, **kw)
        with pytest.raises(ValueError, match="logit rows"):
            state.apply(logits, list(range(2)) + [NO] * 1500, k=2, drafts=drafts.ptr, **kw)
        with pytest.raises(ValueError, match="past the end|logits"):  # 3 rows of 3: 9 logit rows
            state.apply(logits, [0, 1, NO], k=k, drafts=drafts, **kw)
        with pytest.raises(ValueError, match="overlap"):  # the logits written over the drafts
            state.apply(logits, [0], k=1, drafts=logits.ptr + 4 * 8, **kw)
        with pytest.raises(ValueError, match="past the end"):  # cells: k + 2 words a row
            state.update(short, [0, 1], k=k)
        launch = state.prepare([0, 1], k=k, **kw)
        with pytest.raises(ValueError, match="drafts are given exactly"):
            launch.apply(logits, 0)
        out = mf.DeviceBuffer(4 * 2 * (k + 1))
        with pytest.raises(ValueError, match="k 0"):  # a pick's penalties are a plain step's
            mf.argmax_to_feed(logits, None, out, None, None, rows=2, vocab=8, dtype="float32",
                              penalties=launch)
        out.close()
        assert dev.download(logits, np.float32).tolist() == before
        assert state.read(0)["generated"] == 0
    for buf in (logits, drafts, short, cells):
        buf.close()
