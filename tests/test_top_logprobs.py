"""The top-logprobs op (``_core.top_logprobs``, docs/kernels.md "Top logprobs"): each row's ``n``
most likely ids in the argmax order (ties by the smaller id, NaN below ``-inf``) and their logprobs,
against a float64 numpy oracle on every backend, simt bit for bit equal to host, and the checks of
its arguments."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.testing.oracle import reference_logprobs

from helpers.accuracy import assert_close

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
RECORD = np.dtype([("id", "<u4"), ("logprob", "<f4")])
N = mf.NO_TOKEN


def top(dev, logits, n, row_stride=None):
    """The op over a (rows, vocab) array (padded to ``row_stride`` columns when given)."""
    rows, vocab = logits.shape
    data = logits
    if row_stride is not None:
        data = np.zeros((rows, row_stride), logits.dtype)
        data[:, :vocab] = logits
    with dev.upload(data) as buf, mf.DeviceBuffer(max(1, rows * n * 8)) as out:
        got = _core.top_logprobs(buf, out, n=n, rows=rows, vocab=vocab, dtype=str(logits.dtype),
                                 row_stride=row_stride)
        assert got == rows
        return dev.download(out, RECORD, rows * n).reshape(rows, n)


def oracle(logits, n):
    """Ids by (value descending, id ascending) with NaN last, and reference_logprobs of each."""
    values = np.asarray(logits, np.float64)
    rows, vocab = values.shape
    ids = np.full((rows, n), N, np.uint32)
    for r in range(rows):
        key = np.where(np.isnan(values[r]), -np.inf, values[r])
        nan = np.isnan(values[r])
        order = sorted(range(vocab), key=lambda i: (nan[i], -key[i], i))
        ids[r, :min(n, vocab)] = order[:n]
    lp = np.stack([reference_logprobs(logits, ids[:, j]) for j in range(n)], 1)
    return ids, lp


def logits_for(rng, rows, vocab, dtype):
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if vocab > 8:
        x[0, rng.integers(0, vocab, 3)] = -np.inf
        if rows > 1:
            x[1, rng.integers(0, vocab, 4)] = np.nan
        if rows > 2:
            x[2, :] = x[2, 0]  # all tied: ids 0, 1, 2, ...
        if rows > 3:
            x[3, [5, 9, 2]] = x[3].max() + 1  # a three-way tie at the top: 2, 5, 9
    return x.astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows,vocab,n", [(1, 1, 1), (2, 3, 5), (5, 17, 20), (6, 1000, 7),
                                          (2, 40000, 20)])
def test_matches_numpy(backend, dev, dtype, rows, vocab, n):
    rng = np.random.default_rng(rows * 100 + vocab + n)
    logits = logits_for(rng, rows, vocab, dtype)
    got = top(dev, logits, n)
    ids, lp = oracle(logits, n)
    assert np.array_equal(got["id"], ids)
    assert_close(got["logprob"].ravel(), lp.ravel())
    if vocab < n:  # the rest of the row: no id, NaN
        assert (got["id"][:, vocab:] == N).all() and np.isnan(got["logprob"][:, vocab:]).all()


def test_ties_and_special_rows(backend, dev):
    nan, inf = np.nan, np.inf
    logits = np.array([
        [1.0, 3.0, 3.0, 2.0, 3.0],     # ties: 1, 2, 4, then 3
        [nan, 0.0, -inf, nan, 1.0],    # NaN ranks last, its logprob -inf
        [nan, nan, nan, nan, nan],     # no finite logit: NaN logprobs
        [0.0, inf, 1.0, 2.0, 3.0],     # +inf anywhere: NaN logprobs
        [-inf, -inf, 5.0, -inf, -inf],  # one id holds all the mass
    ], np.float32)
    got = top(dev, logits, 4)
    assert got["id"].tolist() == [[1, 2, 4, 3], [4, 1, 2, 0], [0, 1, 2, 3], [1, 4, 3, 2],
                                  [2, 0, 1, 3]]
    lp = got["logprob"]
    assert np.isneginf(lp[1, 2:]).all() and np.isnan(lp[2]).all() and np.isnan(lp[3]).all()
    assert lp[4, 0] == 0.0 and np.isneginf(lp[4, 1:]).all()
    assert_close(lp[0], oracle(logits, 4)[1][0])


def test_a_padded_row_stride(backend, dev):
    rng = np.random.default_rng(3)
    logits = logits_for(rng, 4, 300, "bfloat16")
    got = top(dev, logits, 6, row_stride=307)
    ids, lp = oracle(logits, 6)
    assert np.array_equal(got["id"], ids)
    assert_close(got["logprob"].ravel(), lp.ravel())


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows,vocab", [(3, 17), (7, 1000), (2, 40000)])
def test_simt_is_bit_identical_to_host(host, dev, dtype, rows, vocab):
    from simt.test_simt_exact import both

    rng = np.random.default_rng(rows + vocab)
    logits = logits_for(rng, rows, vocab, dtype)
    got = both(lambda: (top(dev, logits, 20),))
    assert np.array_equal(got[0]["id"], oracle(logits, 20)[0])


def test_a_tensor_of_logits(host, dev):
    torch = pytest.importorskip("torch")
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 3.0, 0.0]], dtype=torch.float32)
    with mf.DeviceBuffer(2 * 2 * 8) as out:
        assert _core.top_logprobs(logits, out, n=2) == 2
        got = dev.download(out, RECORD, 4).reshape(2, 2)
    assert got["id"].tolist() == [[1, 0], [0, 1]]
    assert_close(got["logprob"].ravel(), oracle(logits.numpy(), 2)[1].ravel())


def test_bad_arguments_are_refused(host, dev, no_leaks):
    with mf.DeviceBuffer(64) as logits, mf.DeviceBuffer(16) as out:
        ok = dict(rows=1, vocab=4, dtype="float32")
        for kw, error, match in [
                (dict(n=0), ValueError, "n"),
                (dict(n=21), ValueError, "n"),
                (dict(n=3), ValueError, "out"),  # 3 records need 24 bytes
                (dict(n=1, vocab=0), ValueError, "vocab"),
                (dict(n=1, rows=None), TypeError, "rows is required"),
                (dict(n=1, dtype="int8"), ValueError, "dtype"),
                (dict(n=1, row_stride=2), ValueError, "row_stride 2 is less than vocab"),
                (dict(n=1, rows=5), ValueError, "out: 5 rows"),
                (dict(n=1, rows=2, vocab=10), ValueError, "logits")]:  # 2 x 10 floats pass 64 bytes
            args = {**ok, **kw}
            with pytest.raises(error, match=match):
                _core.top_logprobs(logits, out, **args)
        with pytest.raises(ValueError, match="overlap"):
            _core.top_logprobs(logits, logits.ptr, n=1, **ok)
    from metrale_feed import _checks

    assert _core.MAX_TOP_LOGPROBS == _checks.MAX_TOP_LOGPROBS == 20


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_both_host_paths_on_ties_at_the_boundary(path, dev, dtype):
    """The host's vector prefilter (float32) keeps every value tied with the list's last, so ties
    are still decided by id, as the portable pass and numpy decide them; zeros of both signs are
    one value, NaN ranks last."""
    rng = np.random.default_rng(17)
    vocab = 3001
    logits = rng.integers(-3, 3, (6, vocab)).astype(np.float32)  # few values: ties everywhere
    logits[1] = -0.0
    logits[1, rng.integers(0, vocab, 40)] = 0.0
    logits[2, ::7] = np.nan
    logits[3, -5:] = np.inf
    logits[4] = -np.inf
    logits[4, [2999, 17, 3000]] = -1.0
    logits[5] = np.nan
    logits = logits.astype(DTYPES[dtype])
    got = top(dev, logits, 20)
    ids, lp = oracle(logits, 20)
    assert np.array_equal(got["id"], ids)
    assert_close(got["logprob"].ravel(), lp.ravel())


@pytest.mark.parametrize("n", [0, 3])
def test_the_logprobs_of_given_ids(backend, dev, n):
    """``ids=``: each row's given id's logprob (a token chosen from other logits), as the
    chosen-token rule has it; NO_TOKEN and an id past the row give NaN."""
    rng = np.random.default_rng(5)
    rows, vocab = 5, 700
    logits = logits_for(rng, rows, vocab, "float32")
    given = np.array([3, 699, N, 700, 12], np.uint32)
    with dev.upload(logits) as buf, dev.upload(given) as ids, mf.DeviceBuffer(rows * 4) as chosen, \
            mf.DeviceBuffer(max(1, rows * n * 8)) as out:
        _core.top_logprobs(buf, out if n else None, n=n, rows=rows, vocab=vocab, dtype="float32",
                           ids=ids, chosen=chosen)
        got = dev.download(chosen, np.float32)
        if n:
            assert np.array_equal(dev.download(out, RECORD, rows * n).reshape(rows, n)["id"],
                                  oracle(logits, n)[0])
    ref = reference_logprobs(logits, np.where(given < vocab, given, N))
    assert np.isnan(got[[2, 3]]).all()
    assert_close(got, ref)


def test_given_ids_match_argmax_logprobs_to_the_bit(host, dev):
    from helpers.calls import pick

    rng = np.random.default_rng(8)
    logits = logits_for(rng, 6, 5000, "bfloat16")
    chosen_ids, lp = pick(dev, logits)
    with dev.upload(logits) as buf, dev.upload(np.asarray(chosen_ids, np.uint32)) as ids, \
            mf.DeviceBuffer(6 * 4) as chosen:
        _core.top_logprobs(buf, None, n=0, rows=6, vocab=5000, dtype="bfloat16", ids=ids,
                           chosen=chosen)
        got = dev.download(chosen, np.float32)
    assert got.tobytes() == np.asarray(lp, np.float32).tobytes()


def test_ids_and_chosen_go_together(host):
    with mf.DeviceBuffer(64) as logits, mf.DeviceBuffer(16) as ids:
        with pytest.raises(ValueError, match="together"):
            _core.top_logprobs(logits, None, n=0, rows=1, vocab=4, dtype="float32", ids=ids)
        with pytest.raises(ValueError, match="n"):
            _core.top_logprobs(logits, None, n=0, rows=1, vocab=4, dtype="float32")
        with pytest.raises(ValueError, match="overlap"):
            _core.top_logprobs(logits, None, n=0, rows=1, vocab=4, dtype="float32", ids=ids,
                               chosen=ids)


# ---- a split vocabulary: each slice's block (MF_TOP_PARTIAL) and their combine ----

SPLITS = (lambda v: [0, v], lambda v: [0, v // 2, v], lambda v: [0, 1, v // 3, v // 3, v],
          lambda v: [0, v - 1, v, v])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_split_combines_to_the_unsharded_records(backend, dev, dtype):
    """Hand-made slices, empty ones included: the unsharded ids in its order (the oracle's),
    logprobs within the contract, the chosen ids' logprobs equal to the split argmax's to the bit
    (the same (m, s) and the same combine), NaN for NO_TOKEN and ids past the vocabulary."""
    from helpers.calls import split, split_top

    rng = np.random.default_rng(31)
    for trial, (rows, vocab, n) in enumerate([(6, 40, 3), (5, 17, 20), (4, 1000, 7), (3, 2, 5)]):
        logits = logits_for(rng, rows, vocab, dtype)
        offsets = SPLITS[trial % len(SPLITS)](vocab)
        want = top(dev, logits, n)
        ids, lp = oracle(logits, n)
        argmax_ids, argmax_lp, _ = split(dev, logits, offsets)
        given = argmax_ids.copy()
        given[0] = N
        if rows > 1:
            given[1] = vocab + 3
        for pad in (0, 2):
            recs, chosen, fault = split_top(dev, logits, offsets, n, ids=given, pad=pad)
            _core._check_partials_fault(fault)
            what = (trial, offsets, pad)
            assert np.array_equal(recs["id"], want["id"]) and np.array_equal(recs["id"], ids), what
            assert_close(recs["logprob"].ravel(), lp.ravel())
            assert_close(recs["logprob"].ravel(), want["logprob"].astype(np.float64).ravel())
            assert np.isnan(chosen[:2] if rows > 1 else chosen[:1]).all(), chosen
            keep = slice(2 if rows > 1 else 1, None)
            assert chosen[keep].tobytes() == argmax_lp[keep].tobytes(), (what, chosen, argmax_lp)
            # The top entry is the argmax: its logprob is the split argmax's to the bit.
            assert np.array_equal(recs["id"][:, 0], argmax_ids), what
            assert recs["logprob"][:, 0].tobytes() == argmax_lp.tobytes(), what


def test_a_split_of_chosen_ids_alone(backend, dev):
    """n 0 with ids: the chosen logprobs alone, no records."""
    from helpers.calls import split_top

    logits = logits_for(np.random.default_rng(3), 4, 300, "float32")
    given = np.array([0, 299, 150, 151], np.uint32)
    recs, chosen, fault = split_top(dev, logits, [0, 151, 300], 0, ids=given)
    _core._check_partials_fault(fault)
    assert recs.size == 0
    assert_close(chosen, reference_logprobs(logits, given))


@pytest.mark.parametrize("change,match", [
    (dict(call=9), "call"), (dict(rows=3), "row count"), (dict(n=2), "operation"),
    (dict(ids=None), "operation"), (dict(start=1), "tile")])
def test_slices_that_disagree_give_no_records_and_a_fault(host, dev, change, match):
    from helpers.calls import split_top

    rows, vocab, n = 4, 60, 3
    logits = logits_for(np.random.default_rng(2), rows, vocab, "float32")
    given = np.arange(rows, dtype=np.uint32)

    def tamper(w):
        if w != 1:
            return {}
        got = dict(change)
        if "start" in got:  # a hole in the tiling: the slice's own columns shifted by one
            got["vocab"] = 29
        return got

    recs, chosen, fault = split_top(dev, logits, [0, 30, vocab], n, ids=given, tamper=tamper)
    with pytest.raises(mf.FeedError, match=match):
        _core._check_partials_fault(fault, "every record got (NO_TOKEN, NaN)")
    assert (recs["id"] == N).all() and np.isnan(recs["logprob"]).all()
    assert np.isnan(chosen).all()


TOP_SPLIT_BAD = {
    "partial: a slice outside the vocabulary": ("partial", dict(start=50), ValueError, "inside"),
    "partial: a block too small": ("partial", dict(block=-16), ValueError, "partials"),
    "partial: n 0 without ids": ("partial", dict(n=0, ids=False), ValueError, "n"),
    "combine: slice_stride below a block": ("combine", dict(slice_stride=-1), ValueError, "slice_stride"),
    "combine: out too small": ("combine", dict(out=-8), ValueError, "out"),
    "combine: n 0 without chosen": ("combine", dict(n=0, chosen=False), ValueError, "n"),
    "combine: chosen over the partials": ("combine", dict(chosen="partials"), ValueError, "overlap"),
    "combine: world 0": ("combine", dict(world=0), ValueError, "world"),
}


@pytest.mark.parametrize("case", list(TOP_SPLIT_BAD))
def test_a_split_refuses_bad_input_before_queueing(host, dev, no_leaks, case):
    which, change, error, match = TOP_SPLIT_BAD[case]
    rows, vocab, n = 2, 40, 3
    block = _core._top_block_bytes(rows, n)
    with dev.upload(np.zeros((rows, 20), np.float32)) as sl, mf.DeviceBuffer(2 * block) as parts, \
            mf.DeviceBuffer(rows * n * 8) as out, mf.DeviceBuffer(rows * 4) as ids, \
            mf.DeviceBuffer(rows * 4) as chosen:
        before = dev.download(parts)
        fault = mf.PinnedBuffer(4)
        if which == "partial":
            kw = dict(n=change.get("n", n), start=change.get("start", 20), vocab_total=vocab, call=1,
                      rows=rows, vocab=20, dtype="float32", ids=None if change.get("ids") is False else ids)
            with pytest.raises(error, match=match):
                _core._top_partial(sl, parts if "block" not in change else
                                   mf.DeviceBuffer(block + change["block"]), **kw)
        else:
            nn = change.get("n", n)
            target = {"partials": parts.ptr + 8, False: None}.get(change.get("chosen"), chosen)
            kw = dict(rows=rows, n=nn, vocab=vocab, call=1, fault_dst=fault, chosen=target,
                      slice_stride=block // 16 + change.get("slice_stride", 0))
            with pytest.raises(error, match=match):
                _core._top_combine(parts, change.get("world", 2),
                                   out if "out" not in change else mf.DeviceBuffer(rows * n * 8 + change["out"])
                                   if nn else None, **kw)
        mf.stream_synchronize(0)
        assert dev.download(parts).tobytes() == before.tobytes()  # nothing ran
        fault.close()


def test_slices_asked_other_ids_give_nan_and_a_fault(backend, dev):
    """Every slice sends the id it was asked for: a row whose slices disagree gets a NaN chosen
    logprob (never another rank's answer) and the fault names the row; the rest are right."""
    from helpers.calls import split_top

    rows, vocab, n = 4, 300, 2
    logits = logits_for(np.random.default_rng(6), rows, vocab, "float32")
    given = np.array([3, 250, N, 7], np.uint32)
    other = given.copy()
    other[1] = 251  # slice 1 was asked another id in row 1 (held by slice 1 either way)
    with dev.upload(other) as theirs:
        recs, chosen, fault = split_top(dev, logits, [0, 150, vocab], n, ids=given,
                                        tamper=lambda w: dict(ids=theirs) if w == 1 else {})
        with pytest.raises(mf.FeedError, match="row 1"):
            _core._check_partials_fault(fault)
    assert np.isnan(chosen[[1, 2]]).all()
    assert_close(chosen[[0, 3]], reference_logprobs(logits[[0, 3]], given[[0, 3]]))
    assert np.array_equal(recs["id"], oracle(logits, n)[0])  # the lists do not depend on the ids
