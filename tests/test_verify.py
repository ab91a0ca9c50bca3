"""verify_to_feed (speculative decoding's check) against references written from the rules:
greedy rows against numpy's argmax per logit row and prefix acceptance; sampled rows against an
exact numpy oracle (tests/helpers/spec_oracle.py, itself checked against sample_to_feed) and, per
position, against sample_to_feed's distribution (chi-square); bad input refused before anything
is queued; the call never waits for the work it queues."""

import math
import time

import numpy as np
import pytest

import metrale_feed as mf
from helpers import spec_oracle as so
from helpers.accuracy import assert_close
from helpers.calls import split
from helpers.chisq import chi2, chi2_critical
from metrale_feed import NO_TOKEN
from metrale_feed.testing.oracle import reference_allowed, reference_argmax, reference_logprobs, reference_survivors

DTYPES = ["float32", "float16", "bfloat16"]


def np_dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def verify(dev, logits, drafts, k, *, params=None, masks=None, bitmask=None, vocab=None, stride=None,
           logprobs=False, device_drafts=False, device_params=False, device_masks=False, draft_probs=None,
           advance=None):
    """Runs verify_to_feed on copies of the inputs; returns the (rows, k + 2) cells read back
    through dst (and the logprobs)."""
    drafts = np.ascontiguousarray(drafts, np.uint32).reshape(-1, k)
    rows = drafts.shape[0]
    vocab = vocab or logits.shape[1]
    held = [dev.upload(logits)]
    cells = mf.DeviceBuffer(rows * (k + 2) * 4)
    held.append(cells)
    kw = dict(k=k, vocab=vocab, dtype=np.dtype(logits.dtype).name, row_stride=stride, rows=rows)
    if bitmask is not None:
        held.append(dev.upload(bitmask))
        kw["bitmask"] = held[-1]
    if masks is not None:
        if device_masks:
            held.append(dev.upload(np.asarray(masks, np.uint32)))
            masks = held[-1]
        kw["masks"] = masks
    if params is not None:
        if device_params:
            held.append(dev.upload(params))
            params = held[-1]
        kw["params"] = params
    if device_drafts:
        held.append(dev.upload(drafts))
        drafts = held[-1]
    if draft_probs is not None:
        held.append(dev.upload(np.ascontiguousarray(draft_probs, np.float32)))
        kw["draft_probs"] = held[-1]
    if advance is not None:
        held.append(dev.upload(np.ascontiguousarray(advance, np.uint32)))
        kw["advance"] = held[-1]
    lp_host = None
    if logprobs:
        held.append(mf.DeviceBuffer(rows * (k + 1) * 4))
        lp_host = np.full(rows * (k + 1), 7.0, np.float32)
        kw["logprobs"], kw["logprobs_dst"] = held[-1], lp_host
    dst = np.zeros((rows, k + 2), np.uint32)
    with mf.Event() as done:
        assert mf.verify_to_feed(held[0], drafts, cells, dst, done, **kw) == rows
        done.synchronize()
    for b in held:
        b.close()
    return (dst, lp_host) if logprobs else dst


def random_rule(rng, rows, vocab, masks_on, bitmask_on):
    masks = None
    if masks_on:
        masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
        masks[rng.random((rows, 2)) < 0.3] = NO_TOKEN
    bitmask = None
    if bitmask_on:
        words = (vocab + 31) // 32
        bits = rng.random((rows, words * 32)) < 0.7
        bits[:, 0] = True  # not every row empty
        packed = np.packbits(bits.reshape(rows, words, 32), axis=-1, bitorder="little")  # bit v % 32 of word v // 32
        bitmask = np.ascontiguousarray(packed).view("<u4").reshape(rows, words).view(np.int32)
    return masks, bitmask


def drafts_near(rng, best, k, vocab, hit=0.75):
    """Drafts that often equal ``best`` (rows, k + 1), ended early by NO_TOKEN now and then."""
    rows = best.shape[0]
    drafts = np.where(rng.random((rows, k)) < hit, best[:, :k], rng.integers(0, vocab, (rows, k)))
    drafts = drafts.astype(np.uint32)
    for r in range(rows):
        if rng.random() < 0.3:
            drafts[r, rng.integers(0, k + 1):] = NO_TOKEN
    return drafts


def greedy_oracle(best, drafts, k):
    """Cells from the argmax ids of each logit row (rows, k + 1): prefix acceptance."""
    rows = best.shape[0]
    cells = np.full((rows, k + 2), NO_TOKEN, np.uint32)
    for r in range(rows):
        ids = []
        for j in range(k + 1):
            x = drafts[r, j] if j < k else NO_TOKEN
            if x != NO_TOKEN and x == best[r, j]:
                ids.append(x)
                continue
            ids.append(best[r, j])
            break
        cells[r, 0] = len(ids)
        cells[r, 1 : 1 + len(ids)] = ids
    return cells


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_matches_argmax_prefix_acceptance(backend, dev, dtype):
    rng = np.random.default_rng(11)
    pool = np.array([-np.inf, -2.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.nan], np.float32)
    for trial in range(12):
        k, rows, vocab = int(rng.integers(1, 9)), int(rng.integers(1, 12)), int(rng.integers(2, 150))
        lrows = rows * (k + 1)
        stride = vocab + int(rng.integers(0, 3)) * 8 if trial % 2 else vocab
        if trial % 3 == 0:  # ties, infinities and NaN
            values = pool[rng.integers(0, len(pool), (lrows, stride))]
        else:
            values = rng.standard_normal((lrows, stride)).astype(np.float32)
        logits = values.astype(np_dtype(dtype))
        masks, bitmask = random_rule(rng, lrows, vocab, trial % 2 == 0, trial % 4 < 2)
        best = reference_argmax(logits[:, :vocab], masks, bitmask).reshape(rows, k + 1)
        drafts = drafts_near(rng, best, k, vocab)
        got = verify(dev, logits, drafts, k, masks=masks, bitmask=bitmask, vocab=vocab, stride=stride)
        assert np.array_equal(got, greedy_oracle(best, drafts, k)), f"trial {trial}"
        # Temperature 0 is the same rule.
        params = mf.sampling_params(rows, temperature=0.0, top_k=2, seed=5)
        again = verify(dev, logits, drafts, k, params=params, masks=masks, bitmask=bitmask, vocab=vocab,
                       stride=stride)
        assert np.array_equal(again, got)


SPLIT_OFFSETS = (lambda v: [0, v], lambda v: [0, v // 2, v], lambda v: [0, 1, v // 3, v // 3, v])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_split_greedy_verify_combines_to_the_unsharded_cells(backend, dev, dtype):
    """The combine of a sharded greedy verify (MF_COMBINE_VERIFY) over hand-made slices, empty
    ones included: the unsharded call's cells; each emitted id's logprob is the split argmax's at
    its position (so within the contract of the unsharded one), NaN past n."""
    rng = np.random.default_rng(23)
    pool = np.array([-np.inf, -2.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.nan], np.float32)
    for trial in range(9):
        k, rows, vocab = int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(3, 150))
        lrows = rows * (k + 1)
        values = (pool[rng.integers(0, len(pool), (lrows, vocab))] if trial % 3 == 0
                  else rng.standard_normal((lrows, vocab)).astype(np.float32))
        logits = values.astype(np_dtype(dtype))
        masks, bitmask = random_rule(rng, lrows, vocab, trial % 2 == 0, trial % 4 < 2)
        best = reference_argmax(logits, masks, bitmask).reshape(rows, k + 1)
        drafts = drafts_near(rng, best, k, vocab)
        want, want_lp = verify(dev, logits, drafts, k, masks=masks, bitmask=bitmask, logprobs=True)
        offsets = SPLIT_OFFSETS[trial % 3](vocab)
        cells, lp, fault = split(dev, logits, offsets, masks, bitmask, drafts=drafts, k=k)
        mf._core._check_partials_fault(fault)
        assert np.array_equal(cells.reshape(rows, k + 2), want), f"trial {trial}"
        ids, lp_argmax, _ = split(dev, logits, offsets, masks, bitmask)
        lp, lp_argmax, want_lp = (x.reshape(rows, k + 1) for x in (lp, lp_argmax, want_lp))
        for r in range(rows):
            n = int(want[r, 0])
            assert np.array_equal(ids[r * (k + 1): r * (k + 1) + n], want[r, 1: 1 + n])
            assert np.array_equal(lp[r, :n], lp_argmax[r, :n], equal_nan=True), (trial, r)
            assert np.isnan(lp[r, n:]).all()
            assert_close(lp[r, :n], want_lp[r, :n])


def test_a_split_verify_whose_slices_disagree_is_a_fault_with_no_token_rows(host, dev):
    k, rows, vocab = 2, 3, 40
    logits = np.random.default_rng(4).standard_normal((rows * (k + 1), vocab)).astype(np.float32)
    drafts = np.zeros((rows, k), np.uint32)
    cells, lp, fault = split(dev, logits, [0, 20, vocab], drafts=drafts, k=k,
                             tamper=lambda w: dict(call=12) if w else {})
    with pytest.raises(mf.FeedError, match="call"):
        mf._core._check_partials_fault(fault)
    cells = cells.reshape(rows, k + 2)
    assert (cells[:, 0] == 1).all() and (cells[:, 1:] == NO_TOKEN).all(), cells
    assert np.isnan(lp).all()


VERIFY_COMBINE_BAD = {
    "k without drafts": (dict(k=2), ValueError, "together"),
    "rows not a multiple of k + 1": (dict(k=2, rows=4), ValueError, "multiple"),
    "k past MAX_DRAFTS": (dict(k=mf.MAX_DRAFTS + 1), ValueError, "k"),
    "sampled partials": (dict(params=True), ValueError, "argmax"),
    "cells too small": (dict(cells=8), ValueError, "capacity"),
    "drafts too short": (dict(drafts=4), ValueError, "drafts"),
}


@pytest.mark.parametrize("case", list(VERIFY_COMBINE_BAD))
def test_a_verify_combine_refuses_bad_input_before_queueing(host, dev, no_leaks, case):
    change, error, match = VERIFY_COMBINE_BAD[case]
    k, rows, vocab = 2, 6, 10  # 2 verified rows
    parts = mf.DeviceBuffer(mf._core._partial_bytes(rows))
    cells = mf.DeviceBuffer(change.get("cells", rows // (k + 1) * (k + 2) * 4))
    drafts = mf.DeviceBuffer(change.get("drafts", rows // (k + 1) * k * 4))
    fault = mf.PinnedBuffer(4)
    kw = dict(rows=change.get("rows", rows), vocab=vocab, call=1, fault_dst=fault, k=change.get("k", k),
              drafts=None if "k" in change and len(change) == 1 and change["k"] == 2 else drafts)
    if change.get("params"):
        kw["params"] = mf.sampling_params(rows, temperature=1.0)
    sentinel = np.full(cells.nbytes // 4, 0xABCD, np.uint32)
    dev.write(cells, sentinel)
    with pytest.raises(error, match=match):
        mf._core._combine_partials(parts, 1, cells, None, None, **kw)
    mf.stream_synchronize(0)
    assert np.array_equal(dev.download(cells, np.uint32), sentinel), "the combine ran"
    for b in (parts, cells, drafts, fault):
        b.close()


def test_acceptance_none_and_all(backend, dev):
    rng = np.random.default_rng(12)
    k, rows, vocab = 4, 5, 64
    logits = rng.standard_normal((rows * (k + 1), vocab)).astype(np.float32)
    best = reference_argmax(logits).reshape(rows, k + 1)
    all_in = verify(dev, logits, best[:, :k], k)
    assert np.array_equal(all_in[:, 0], np.full(rows, k + 1))
    assert np.array_equal(all_in[:, 1:], best)  # every draft, then the bonus from position k
    wrong = (best[:, :k] + 1) % vocab
    none_in = verify(dev, logits, wrong, k)
    assert np.array_equal(none_in[:, 0], np.ones(rows))
    assert np.array_equal(none_in[:, 1], best[:, 0])
    assert (none_in[:, 2:] == NO_TOKEN).all()
    no_drafts = verify(dev, logits, np.full((rows, k), NO_TOKEN, np.uint32), k)
    assert np.array_equal(no_drafts, none_in)  # no draft: position 0's id alone
    # Sampled, with one candidate per logit row: p(x) is 1 for that id and 0 for any other.
    only = np.full_like(logits, -np.inf)
    only[np.arange(len(only)), best.reshape(-1)] = 0.0
    params = mf.sampling_params(rows, temperature=1.0, seed=np.arange(rows))
    assert np.array_equal(verify(dev, only, best[:, :k], k, params=params), all_in)
    assert np.array_equal(verify(dev, only, wrong, k, params=params), none_in)


def filtered_params(rng, rows):
    return mf.sampling_params(
        rows, temperature=np.where(rng.random(rows) < 0.85, rng.uniform(0.3, 2.0, rows), 0.0),
        top_k=np.where(rng.random(rows) < 0.4, rng.integers(1, 12, rows), 0),
        top_p=np.where(rng.random(rows) < 0.4, rng.uniform(0.3, 1.0, rows), 1.0),
        min_p=np.where(rng.random(rows) < 0.3, rng.uniform(0.0, 0.3, rows), 0.0),
        seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**32, rows))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_matches_the_exact_oracle(backend, dev, dtype):
    rng = np.random.default_rng(13)
    accepted = 0
    for trial in range(10):
        k, rows, vocab = int(rng.integers(1, 9)), int(rng.integers(1, 14)), int(rng.integers(2, 200))
        lrows = rows * (k + 1)
        logits = (rng.standard_normal((lrows, vocab)) * 3).astype(np_dtype(dtype))
        masks, bitmask = random_rule(rng, lrows, vocab, trial % 2 == 0, trial % 3 == 0)
        allowed = reference_allowed(masks, bitmask, lrows, vocab)
        params = filtered_params(rng, rows)
        best = np.array([so.masked_argmax(logits[i], allowed[i]) for i in range(lrows)]).reshape(rows, k + 1)
        drafts = drafts_near(rng, best, k, vocab, hit=0.8)
        got = verify(dev, logits, drafts, k, params=params, masks=masks, bitmask=bitmask)
        assert np.array_equal(got, so.verify_rows(logits, allowed, drafts, k, params)), f"trial {trial}"
        accepted += int(got[:, 0].sum()) - rows
    assert accepted > 50  # the drafts were accepted often enough for the check to mean something


def test_the_oracle_is_sample_to_feed(backend, dev):
    """spec_oracle's draw is sample_to_feed's id, bit for bit, so it may judge the verifier."""
    rng = np.random.default_rng(14)
    rows, vocab = 48, 300
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    params = filtered_params(rng, rows)
    cells = mf.DeviceBuffer(rows * 4)
    buf = dev.upload(logits)
    dst = np.zeros(rows, np.uint32)
    with mf.Event() as done:
        mf.sample_to_feed(buf, params, cells, dst, done, rows=rows, vocab=vocab, dtype="float32")
        done.synchronize()
    buf.close()
    cells.close()
    assert np.array_equal(dst, so.sample_ids(logits, np.ones((rows, vocab), bool), params))
    allowed = np.ones(vocab, bool)
    for r in range(rows):
        if so.greedy(params[r]):
            assert so.masked_argmax(logits[r], allowed) == reference_argmax(logits[r : r + 1])[0]


def sample_at(dev, logits, params):
    rows, vocab = logits.shape
    buf, cells = dev.upload(logits), mf.DeviceBuffer(rows * 4)
    dst = np.zeros(rows, np.uint32)
    with mf.Event() as done:
        mf.sample_to_feed(buf, params, cells, dst, done, rows=rows, vocab=vocab, dtype=logits.dtype.name)
        done.synchronize()
    buf.close()
    cells.close()
    return dst


def test_emitted_id_is_sample_to_feeds_unless_it_was_the_rejected_draft(backend, dev):
    """The last emitted id of a row (a bonus, or the draw after a rejection) at position j is
    sample_to_feed's id at position + j over that logit row, unless that id is the rejected draft."""
    rng = np.random.default_rng(15)
    k, rows, vocab = 3, 200, 40
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 1.5).astype(np.float32)
    params = mf.sampling_params(rows, temperature=0.8, top_k=np.where(np.arange(rows) % 2, 10, 0),
                                seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 1000, rows))
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab, hit=0.6)
    got = verify(dev, logits, drafts, k, params=params)
    per_row = np.repeat(params, k + 1)
    per_row["position"] += np.tile(np.arange(k + 1, dtype=np.uint32), rows)
    sampled = sample_at(dev, logits, per_row).reshape(rows, k + 1)
    checked = 0
    for r in range(rows):
        n = int(got[r, 0])
        j = n - 1
        d = int(np.argmax(drafts[r] == NO_TOKEN)) if (drafts[r] == NO_TOKEN).any() else k
        assert np.array_equal(got[r, 1:n], drafts[r, :j])  # accepted drafts are emitted as they are
        if j == d or sampled[r, j] != drafts[r, j]:
            assert got[r, n] == sampled[r, j], f"row {r}"
            checked += 1
        else:
            assert got[r, n] != drafts[r, j]  # a rejected draft is never emitted
    assert checked > rows // 2


@pytest.mark.parametrize("filters", [dict(), dict(top_k=4), dict(top_p=0.8)])
def test_each_position_emits_the_target_distribution(backend, dev, filters):
    """Over many seeds: position 0's emitted id, and position 1's given that draft 0 was accepted,
    follow sample_to_feed's distribution there (reference_survivors, float64 from the
    definitions); draft 0 is accepted with probability p_0(x_0)."""
    rng = np.random.default_rng(16)
    k, vocab, temperature = 2, 6, 0.9
    base = np.array([[1.0, 0.6, 0.2, -0.4, 0.9, -1.0], [0.3, 1.2, -0.5, 0.8, 0.0, 0.4],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    rows = mf.MAX_ROWS // (k + 1)
    logits = np.tile(base, (rows, 1))
    drafts = np.tile(np.array([[4, 3]], np.uint32), (rows, 1))  # not the most likely ids
    counts = [np.zeros(vocab, np.int64), np.zeros(vocab, np.int64)]
    accepted = 0
    for call in range(3):
        params = mf.sampling_params(rows, temperature=temperature, seed=rng.integers(0, 2**63, rows),
                                    position=rng.integers(0, 2**32, rows), **filters)
        got = verify(dev, logits, drafts, k, params=params)
        np.add.at(counts[0], got[:, 1], 1)
        second = got[got[:, 0] >= 2]
        accepted += len(second)
        np.add.at(counts[1], second[:, 2], 1)
    probs = []
    for j in range(2):
        ids, p = reference_survivors(base[j], np.ones(vocab, bool), temperature, **filters)
        full = np.zeros(vocab)
        full[ids] = p
        probs.append(full)
        stat, df = chi2(counts[j], full)
        assert stat < chi2_critical(max(df, 1)), f"position {j}: chi2 {stat:.1f} on {df} df, {counts[j]}"
    n = 3 * rows
    p0 = probs[0][4]
    assert abs(accepted - n * p0) < 4 * math.sqrt(n * p0 * (1 - p0)) + 1


def test_logprobs_of_each_emitted_id(backend, dev):
    rng = np.random.default_rng(17)
    k, rows, vocab = 3, 9, 80
    lrows = rows * (k + 1)
    logits = rng.standard_normal((lrows, vocab)).astype(np.float32)
    params = mf.sampling_params(rows, temperature=np.where(np.arange(rows) % 2, 0.7, 0.0), seed=3)
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab)
    cells, lp = verify(dev, logits, drafts, k, params=params, logprobs=True)
    lp = lp.reshape(rows, k + 1)
    for r in range(rows):
        n = int(cells[r, 0])
        ids = cells[r, 1 : 1 + n]
        want = reference_logprobs(logits[r * (k + 1) : r * (k + 1) + n], ids)
        assert np.allclose(lp[r, :n], want, atol=2e-5, rtol=0), f"row {r}"
        assert np.isnan(lp[r, n:]).all()


def test_device_inputs_read_when_it_runs(backend, dev):
    rng = np.random.default_rng(18)
    k, rows, vocab = 4, 10, 50
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np.float32)
    masks, _ = random_rule(rng, lrows, vocab, True, False)
    params = filtered_params(rng, rows)
    best = reference_argmax(logits, masks).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab, hit=0.9)
    want = verify(dev, logits, drafts, k, params=params, masks=masks)
    got = verify(dev, logits, drafts, k, params=params, masks=masks, device_drafts=True, device_params=True,
                 device_masks=True)
    assert np.array_equal(got, want)
    # A device draft id at or beyond vocab cannot be checked before launch: it is never accepted.
    far = best[:, :k].astype(np.uint32).copy()
    far[:, 1] = vocab + 5
    got = verify(dev, logits, far, k, masks=None, device_drafts=True)
    plain = reference_argmax(logits).reshape(rows, k + 1)
    assert np.array_equal(got, greedy_oracle(plain, far, k))
    assert (got[:, 0] <= 2).all()


def test_advance_moves_each_rows_positions_when_it_runs(backend, dev):
    """``advance`` (device, a word a row) is added to each row's position when the kernel runs
    (mod 2**32): the cells are those of the params moved by it on the host, with host or device
    params, and the exact oracle's; greedy rows are unaffected. Refused without params or when
    it holds fewer words than rows."""
    rng = np.random.default_rng(23)
    k, rows, vocab = 3, 12, 40
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np.float32)
    params = filtered_params(rng, rows)
    params["position"][0] = 2**32 - 2  # the counter wraps, as position + j does
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab, hit=0.8)
    advance = rng.integers(0, k + 2, rows).astype(np.uint32)
    advance[0] = 5
    moved = params.copy()
    moved["position"] = (params["position"].astype(np.uint64) + advance) & 0xFFFFFFFF
    want = verify(dev, logits, drafts, k, params=moved)
    allowed = reference_allowed(None, None, lrows, vocab)
    assert np.array_equal(want, so.verify_rows(logits, allowed, drafts, k, moved))
    assert np.array_equal(verify(dev, logits, drafts, k, params=params, advance=advance), want)
    assert np.array_equal(verify(dev, logits, drafts, k, params=params, advance=advance, device_params=True), want)
    unmoved = verify(dev, logits, drafts, k, params=params)
    sampled = (params["temperature"] > 0) & (advance > 0)
    assert not np.array_equal(unmoved[sampled], want[sampled])  # the advance changed the draws
    assert np.array_equal(unmoved[~sampled], want[~sampled])
    with pytest.raises(ValueError, match="advance needs params"):
        verify(dev, logits, drafts, k, advance=advance)
    with pytest.raises(ValueError, match="advance"):
        verify(dev, logits, drafts, k, params=params, advance=advance[:rows - 1])


def test_resolve_verified_gives_last_id_and_advance(backend, dev):
    rng = np.random.default_rng(19)
    k, rows, vocab = 3, 12, 30
    logits = rng.standard_normal((rows * (k + 1), vocab)).astype(np.float32)
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab)
    buf = dev.upload(logits)
    cells = mf.DeviceBuffer(rows * (k + 2) * 4)
    out_ids, out_adv = mf.DeviceBuffer(rows * 4), mf.DeviceBuffer(rows * 4)
    dst = np.zeros((rows, k + 2), np.uint32)
    mf.verify_to_feed(buf, drafts, cells, dst, None, k=k, vocab=vocab, dtype="float32")
    mf.resolve_verified(cells, out_ids, out_adv)  # rows and k from the verify call
    ids, adv = dev.download(out_ids, np.uint32), dev.download(out_adv, np.uint32)
    want = greedy_oracle(best, drafts, k)
    assert np.array_equal(dst, want)
    assert np.array_equal(adv, want[:, 0])
    assert np.array_equal(ids, want[np.arange(rows), want[:, 0]])
    mf.resolve_verified(cells, None, out_adv, rows=2, k=k)  # either output alone
    with pytest.raises(ValueError, match="out_ids or out_advance"):
        mf.resolve_verified(cells, None, None)
    for b in (buf, cells, out_ids, out_adv):
        b.close()


def test_resolve_verified_defaults_follow_the_last_write(backend, dev):
    """The default rows and k are those of the last launch into the cells: an argmax written over
    them since leaves none (not the verify's stale shape), and a freed buffer's shape is
    forgotten, so a new allocation at its address inherits nothing."""
    core = mf._core
    rng = np.random.default_rng(23)
    k, rows, vocab = 2, 4, 16
    logits = rng.standard_normal((rows * (k + 1), vocab)).astype(np.float32)
    drafts = drafts_near(rng, reference_argmax(logits).reshape(rows, k + 1), k, vocab)
    buf = dev.upload(logits)
    out = mf.DeviceBuffer(rows * 4)
    before = core._cell_rows_len()
    cells = mf.DeviceBuffer(rows * (k + 2) * 4)
    mf.verify_to_feed(buf, drafts, cells, None, None, k=k, vocab=vocab, dtype="float32")
    assert core._cell_rows_len() == before + 1
    mf.resolve_verified(cells, None, out)  # the verify's shape
    mf.argmax_to_feed(buf, None, cells, None, None, rows=rows, vocab=vocab, dtype="float32")
    with pytest.raises(ValueError, match="no verify_to_feed has written these cells"):
        mf.resolve_verified(cells, None, out)
    mf.verify_to_feed(buf, drafts, cells, None, None, k=k, vocab=vocab, dtype="float32")
    with pytest.raises(ValueError, match="prev_rows is required"):
        mf.resolve_feed([mf.FeedSource.feed(0)], cells, out)  # a verify's cells are no argmax's
    mf.stream_synchronize(0)
    cells.close()
    assert core._cell_rows_len() == before
    for b in (buf, out):
        b.close()


def test_call_returns_before_the_work_runs(host, dev, no_leaks):
    """Never synchronises: under a 200 ms lag per queued operation the call returns at once, its
    event still pending, and host drafts/params may be overwritten straight away."""
    rng = np.random.default_rng(20)
    k, rows, vocab = 2, 6, 40
    logits = rng.standard_normal((rows * (k + 1), vocab)).astype(np.float32)
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = best[:, :k].astype(np.uint32).copy()
    want = greedy_oracle(best, drafts, k)
    buf = dev.upload(logits)
    cells = mf.DeviceBuffer(rows * (k + 2) * 4)
    out = mf.PinnedBuffer(rows * (k + 2) * 4)
    host.configure_host(lag_us=200_000)
    with mf.Stream() as s, mf.Event() as done:
        start = time.monotonic()
        mf.verify_to_feed(buf, drafts, cells, out, done, s, k=k, vocab=vocab, dtype="float32")
        returned = time.monotonic() - start
        assert not done.query()
        drafts[:] = (drafts + 1) % vocab  # a late read of the drafts would reject them all
        done.synchronize()
        waited = time.monotonic() - start
    assert waited > 0.2 and returned < waited / 2, (returned, waited)  # a sync would wait the lag
    assert np.array_equal(np.frombuffer(out, np.uint32).reshape(rows, k + 2), want)
    for b in (buf, cells, out):
        b.close()


BAD = {
    "k zero": (dict(k=0), ValueError, "k"),
    "k too large": (dict(k=mf.MAX_DRAFTS + 1), ValueError, "k"),
    "drafts too short": (dict(drafts=[1, 2, 3]), ValueError, "drafts hold 3 ids"),
    "draft id past vocab": (dict(drafts=[1, 40, 2, 3, 4, 5]), ValueError, "not below vocab"),
    "cells too small": (dict(cells=8), ValueError, "capacity"),
    "dst too small": (dict(dst=12), ValueError, "dst holds"),
    "masks too few": (dict(masks=[(1, 2)] * 3), ValueError, "logit rows"),
    "mask id past vocab": (dict(masks=[(1, 99)] * 9), ValueError, "not below vocab"),
    "logprobs too small": (dict(logprobs=4), ValueError, "fewer than"),
    "bad temperature": (dict(params="nan"), ValueError, "temperature"),
    "too many logit rows": (dict(k=64, rows=64), ValueError, "logit rows"),
    "draft_probs too small": (dict(draft_probs=8), ValueError, "draft_probs holds"),
    "draft_probs on the host": (dict(draft_probs=np.zeros(6 * 20, np.float32)), TypeError, "device memory"),
    "shard not a VocabShard": (dict(shard=object()), TypeError, "VocabShard"),
    "drafts as floats": (dict(drafts=np.zeros(6, np.float32)), TypeError, "uint32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_before_anything_is_queued(host, dev, no_leaks, case):
    change, error, match = BAD[case]
    k, rows, vocab = 2, 3, 20
    logits = np.zeros((rows * (k + 1), vocab), np.float32)
    buf = dev.upload(logits)
    held = [buf]
    cells = mf.DeviceBuffer(change.get("cells", rows * (k + 2) * 4))
    held.append(cells)
    sentinel = np.full(cells.nbytes // 4, 0xABCD, np.uint32)
    dev.write(cells, sentinel)
    dst = np.full(change.get("dst", rows * (k + 2) * 4) // 4, 0xABCD, np.uint32)
    kw = dict(k=change.get("k", k), vocab=vocab, dtype="float32", rows=change.get("rows", rows))
    for name in ("masks", "shard"):
        if name in change:
            kw[name] = change[name]
    if isinstance(change.get("draft_probs"), int):
        held.append(mf.DeviceBuffer(change["draft_probs"]))
        kw["draft_probs"] = held[-1]
    elif "draft_probs" in change:
        kw["draft_probs"] = change["draft_probs"]
    if "logprobs" in change:
        held.append(mf.DeviceBuffer(change["logprobs"] * 4))
        kw["logprobs"] = held[-1]
    if "params" in change:
        params = mf.sampling_params(rows, temperature=1.0)
        params["temperature"][1] = np.nan
        kw["params"] = params
    drafts = change.get("drafts", np.arange(rows * k, dtype=np.uint32) % vocab)
    host.configure_host(lag_us=50_000)  # anything queued would still be pending at the check
    with mf.Event() as done:
        with pytest.raises(error, match=match):
            mf.verify_to_feed(buf, drafts, cells, dst, done, **kw)
    host.configure_host()
    mf.stream_synchronize(0)
    assert np.array_equal(dev.download(cells, np.uint32), sentinel), "the kernel ran"
    assert (dst == 0xABCD).all(), "a copy ran"
    for b in held:
        b.close()


def test_host_paths_agree(path, dev):
    """The portable and the vector host paths verify to the same cells (the exact oracle's)."""
    rng = np.random.default_rng(21)
    k, rows, vocab = 3, 16, 700
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np.float32)
    params = filtered_params(rng, rows)
    best = reference_argmax(logits).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab, hit=0.8)
    got = verify(dev, logits, drafts, k, params=params)
    assert np.array_equal(got, so.verify_rows(logits, np.ones((lrows, vocab), bool), drafts, k, params)), path


def test_graph_replays_read_new_device_drafts_and_params(backend, dev, no_leaks):
    """Captured with device drafts, params and masks: each replay verifies what they hold then."""
    rng = np.random.default_rng(22)
    k, rows, vocab = 2, 8, 60
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np.float32)
    masks, _ = random_rule(rng, lrows, vocab, True, False)
    allowed = reference_allowed(masks, None, lrows, vocab)
    best = reference_argmax(logits, masks).reshape(rows, k + 1)
    with dev.upload(logits) as buf, dev.upload(masks) as dmasks, mf.DeviceBuffer(rows * k * 4) as ddrafts, \
            mf.DeviceBuffer(rows * 32) as dparams, mf.DeviceBuffer(rows * (k + 2) * 4) as cells, \
            mf.PinnedBuffer(rows * (k + 2) * 4) as out, mf.Stream() as stream, mf.Event() as done:
        def queue():
            mf.verify_to_feed(buf, ddrafts, cells, out, done, stream, k=k, masks=dmasks, params=dparams,
                              rows=rows, vocab=vocab, dtype="float32")
        dev.write(ddrafts, best[:, :k].astype(np.uint32))
        dev.write(dparams, mf.sampling_params(rows))
        queue()  # a warm-up launch outside the capture
        done.synchronize()
        with mf.graph_capture(stream) as graph:
            queue()
        for step in range(4):
            drafts = drafts_near(rng, best, k, vocab, hit=0.8)
            params = filtered_params(rng, rows)
            dev.write(ddrafts, drafts)
            dev.write(dparams, params)
            graph.launch(stream)
            done.synchronize()
            got = np.frombuffer(out, np.uint32).reshape(rows, k + 2).copy()
            assert np.array_equal(got, so.verify_rows(logits, allowed, drafts, k, params)), step
        graph.close()
        stream.synchronize()


def draft_distributions(rng, n, vocab):
    """n drafter distributions over vocab: peaked, with zeros, and now and then a NaN or a negative
    value (both count as 0)."""
    q = rng.gamma(0.3, size=(n, vocab)).astype(np.float32)
    q[rng.random((n, vocab)) < 0.2] = 0.0
    q /= np.maximum(q.sum(axis=1, keepdims=True), 1e-30)
    q[rng.random((n, vocab)) < 0.01] = np.nan
    q[rng.random((n, vocab)) < 0.01] = -0.5
    return q.astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_draft_probs_match_the_exact_oracle(backend, dev, dtype):
    rng = np.random.default_rng(23)
    accepted = 0
    for trial in range(8):
        k, rows, vocab = int(rng.integers(1, 7)), int(rng.integers(1, 12)), int(rng.integers(2, 150))
        lrows = rows * (k + 1)
        logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np_dtype(dtype))
        masks, bitmask = random_rule(rng, lrows, vocab, trial % 2 == 1, trial % 3 == 0)
        allowed = reference_allowed(masks, bitmask, lrows, vocab)
        params = filtered_params(rng, rows)
        q = draft_distributions(rng, rows * k, vocab)
        best = np.array([so.masked_argmax(logits[i], allowed[i]) for i in range(lrows)]).reshape(rows, k + 1)
        drafts = drafts_near(rng, best, k, vocab, hit=0.8)
        got = verify(dev, logits, drafts, k, params=params, masks=masks, bitmask=bitmask, draft_probs=q)
        want = so.verify_rows(logits, allowed, drafts, k, params, draft_probs=q)
        assert np.array_equal(got, want), f"trial {trial}"
        accepted += int(got[:, 0].sum()) - rows
        # Greedy rows ignore draft_probs.
        zero = mf.sampling_params(rows, temperature=0.0)
        assert np.array_equal(verify(dev, logits, drafts, k, params=zero, masks=masks, bitmask=bitmask, draft_probs=q),
                              verify(dev, logits, drafts, k, masks=masks, bitmask=bitmask))
    assert accepted > 30


def test_drafts_from_q_emit_the_target_distribution(backend, dev):
    """Drafts drawn from the drafter's q: position 0's emitted id, and position 1's after draft 0
    was accepted, follow p whatever q is (chi-square); draft 0 is accepted with probability
    sum(min(p, q))."""
    rng = np.random.default_rng(24)
    k, vocab, temperature = 2, 6, 1.1
    base = np.array([[1.0, 0.6, 0.2, -0.4, 0.9, -1.0], [0.3, 1.2, -0.5, 0.8, 0.0, 0.4],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    q = np.array([[0.05, 0.05, 0.4, 0.3, 0.1, 0.1], [0.5, 0.1, 0.0, 0.1, 0.2, 0.1]], np.float32)
    rows = mf.MAX_ROWS // (k + 1)
    logits = np.tile(base, (rows, 1))
    probs = []
    for j in range(2):
        ids, p = reference_survivors(base[j], np.ones(vocab, bool), temperature)
        full = np.zeros(vocab)
        full[ids] = p
        probs.append(full)
    counts = [np.zeros(vocab, np.int64), np.zeros(vocab, np.int64)]
    accepted = 0
    for call in range(3):
        drafts = np.stack([rng.choice(vocab, rows, p=q[j] / q[j].sum()) for j in range(k)], axis=1)
        params = mf.sampling_params(rows, temperature=temperature, seed=rng.integers(0, 2**63, rows),
                                    position=rng.integers(0, 2**32, rows))
        got = verify(dev, logits, drafts.astype(np.uint32), k, params=params, draft_probs=np.tile(q, (rows, 1)))
        np.add.at(counts[0], got[:, 1], 1)
        second = got[got[:, 0] >= 2]
        accepted += len(second)
        np.add.at(counts[1], second[:, 2], 1)
    for j in range(2):
        stat, df = chi2(counts[j], probs[j])
        assert stat < chi2_critical(max(df, 1)), f"position {j}: chi2 {stat:.1f} on {df} df, {counts[j]}"
    n, rate = 3 * rows, float(np.minimum(probs[0], q[0]).sum())
    assert abs(accepted - n * rate) < 4 * math.sqrt(n * rate * (1 - rate)) + 1
