"""A verify that carries its step's penalties (``verify_to_feed(penalties=)``, docs/speculative.md,
"Penalties"): the same logits, cells, logprobs and counts, bit for bit, as the three calls it
replaces (``PenaltyLaunch.apply`` with the drafts, ``verify_to_feed``, ``PenaltyLaunch.update``),
on the host backend (its fused pass, both argmax paths) and on simt (the .cu kernels one after
another); the greedy cells and the logits against a numpy oracle of vLLM's rules with the
verify rule written out; bad calls refused before anything is queued."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.penalties import PenaltyState

from helpers.penalty_oracle import round_to
from test_penalties import as_dtype_bits, awkward_logits, random_request
from test_penalties_verify import adversarial_drafts, oracle

NO = mf.NO_TOKEN


def run_verify(dev, reqs, slots, logits, drafts, k, *, fused, dtype="float32", params=None,
               logprobs=False, masks=None, bitmask=None):
    """One verify with penalties, fused or as three calls, on fresh tables; returns the cells,
    the logprobs' bits, the logits after (float32 bits) and each slot's record and table."""
    rows = len(slots)
    vocab = logits.shape[1]
    host = as_dtype_bits(logits, dtype)
    buf, dbuf = dev.upload(host), dev.upload(np.asarray(drafts, np.uint32))
    cells = mf.DeviceBuffer(rows * (k + 2) * 4)
    lp = mf.DeviceBuffer(rows * (k + 1) * 4) if logprobs else None
    out = {}
    with PenaltyState(max(s for s in slots if s != NO) + 1, capacity=96) as state:
        for r, slot in enumerate(slots):
            if slot != NO:
                state.set(slot, **reqs[r])
        launch = state.prepare(slots, vocab=vocab, dtype=dtype, k=k)
        kw = dict(k=k, rows=rows, vocab=vocab, dtype=dtype, params=params, logprobs=lp, masks=masks,
                  bitmask=bitmask)
        if fused:
            mf.verify_to_feed(buf, dbuf, cells, None, None, penalties=launch, **kw)
        else:
            launch.apply(buf, 0, dbuf)
            mf.verify_to_feed(buf, dbuf, cells, None, None, **kw)
            launch.update(cells, 0)
        mf.stream_synchronize()
        out["cells"] = dev.download(cells, np.uint32).reshape(rows, k + 2)
        out["logits"] = dev.download(buf, host.dtype).reshape(len(logits), vocab).astype(np.float32)
        out["logprobs"] = dev.download(lp, np.uint32) if logprobs else None
        out["slots"] = {s: state.read(s) for s in slots if s != NO}
    for b in (buf, dbuf, cells, lp):
        if b is not None:
            b.close()
    return out


def assert_same(a, b):
    assert a["cells"].tolist() == b["cells"].tolist()
    assert a["logits"].view(np.uint32).tolist() == b["logits"].view(np.uint32).tolist()
    if a["logprobs"] is not None:
        assert a["logprobs"].tolist() == b["logprobs"].tolist()
    assert a["slots"] == b["slots"]


def deep_drafts(rng, reqs, slots, logits, k, dtype):
    """Drafts that are each row's penalised argmax (the oracle, first maximum) at their position,
    given the drafts before it, until a row's own cut-off: rows that go every depth, rows that
    stop early, and a row whose drafts end (NO_TOKEN)."""
    rows = len(slots)
    drafts = np.array(adversarial_drafts(rng, reqs, k, logits.shape[1]), np.int64).reshape(rows, k)
    cut = rng.integers(0, k + 1, rows)
    cut[0] = k  # every draft accepted, the bonus decided too
    for j in range(k):
        want = oracle(logits, reqs, slots, drafts.reshape(-1).tolist(), k, dtype)
        for r in range(rows):
            if j < cut[r] and drafts[r, j] != NO:
                drafts[r, j] = int(np.argmax(want[r * (k + 1) + j]))
    return drafts.reshape(-1).astype(np.uint32).tolist()


def greedy_cells(want, drafts, k):
    """The verify rule over the oracle's penalised rows: accept drafts while each equals its
    position's argmax (first maximum), then emit the position's own argmax."""
    rows = len(drafts) // k
    out = []
    for r in range(rows):
        ids = []
        for j in range(k + 1):
            best = int(np.argmax(want[r * (k + 1) + j]))
            draft = drafts[r * k + j] if j < k else NO
            if draft == NO or draft != best:
                ids.append(best)
                break
            ids.append(draft)
        out.append([len(ids)] + ids + [NO] * (k + 1 - len(ids)))
    return out


def tempting(logits, reqs, slots, k):
    """The logits with every id a row's penalties touch raised to the top of its rows, so the
    penalties decide the picks (drawn at random, the greatest logit is seldom a penalised id)."""
    out = np.array(logits, np.float32, copy=True)
    for r, req in enumerate(reqs):
        if slots[r] != NO:
            ids = set(req["prompt"]) | set(req["generated"]) | set(req["logit_bias"]) | set(req["stop_ids"])
            out[r * (k + 1):(r + 1) * (k + 1), sorted(ids)] += np.float32(8.0)
    return out


def requests(rng, rows, vocab, k):
    reqs = [random_request(rng, vocab, gen_len=int(rng.integers(0, 8))) for _ in range(rows)]
    for req in reqs:  # the min_tokens ban lifts inside the verify for some rows
        req["min_tokens"] = len(req["generated"]) + int(rng.integers(0, k + 2))
    return reqs


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_greedy_verify_is_the_oracle(backend, dev, k, dtype):
    """Cells and logits against the numpy oracle, drafts that go deep into the rows."""
    rng = np.random.default_rng(100 + k)
    rows, vocab = 6, 400
    slots = [2, NO, 0, 5, 1, 3]
    reqs = requests(rng, rows, vocab, k)
    raw = (rng.normal(size=(rows * (k + 1), vocab)) * 3).astype(np.float32)
    logits = round_to(tempting(raw, reqs, slots, k), dtype)
    drafts = deep_drafts(rng, reqs, slots, logits, k, dtype)
    want = oracle(logits, reqs, slots, drafts, k, dtype)
    got = run_verify(dev, reqs, slots, logits, drafts, k, fused=True, dtype=dtype)
    assert got["cells"].tolist() == greedy_cells(want, drafts, k)
    assert got["logits"].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert got["cells"][0, 0] == k + 1  # row 0 accepted every draft


@pytest.mark.parametrize("sampled", [False, True])
def test_fused_verify_is_the_three_calls_on_both_host_paths(path, dev, sampled):
    """The host's fused pass against its own three calls: every bit of the cells, the logprobs,
    the logits (rows past a rejection included) and the tables, awkward logits (NaN, infinities,
    signed zeros, ties), greedy and sampled rows."""
    compare_fused_with_three_calls(dev, sampled)


@pytest.mark.parametrize("sampled", [False, True])
def test_simt_fused_verify_is_the_three_calls(simt, dev, sampled):
    compare_fused_with_three_calls(dev, sampled)


def compare_fused_with_three_calls(dev, sampled):
    rng = np.random.default_rng(7 + sampled)
    rows, vocab, k = 7, 300, 4
    slots = [4, 0, NO, 6, 1, 2, 3]
    reqs = requests(rng, rows, vocab, k)
    logits = tempting(awkward_logits(rng, rows * (k + 1), vocab), reqs, slots, k)
    drafts = deep_drafts(rng, reqs, slots, np.nan_to_num(logits, nan=0.0), k, "float32")
    params = None
    if sampled:  # greedy rows beside sampled ones
        params = mf.sampling_params(rows, temperature=0.9, top_k=50, seed=11)
        params["temperature"][[1, 4]] = 0.0
        params["position"] = np.arange(rows) * 3
    runs = [run_verify(dev, reqs, slots, logits, drafts, k, fused=f, params=params, logprobs=True)
            for f in (True, False)]
    assert_same(*runs)
    assert (runs[0]["cells"][:, 0] > 1).sum() >= 2  # rows that accepted drafts


def spread_requests(rng, rows, vocab, k):
    """Requests whose ids lie all over a wide row (the host's greedy float32 rows take their
    penalties chunk by chunk in the argmax's pass), repeats among them, walked drafts joining."""
    pool = rng.choice(vocab, 80, replace=False)
    reqs = []
    for _ in range(rows):
        req = random_request(rng, vocab)
        req["prompt"] = rng.choice(pool, 20).tolist()
        req["generated"] = rng.choice(pool, int(rng.integers(0, 12))).tolist()
        req["logit_bias"] = {int(t): float(rng.normal() * 3) for t in rng.choice(vocab, 30, replace=False)}
        req["stop_ids"] = rng.choice(vocab, 4, replace=False).tolist()
        req["min_tokens"] = len(req["generated"]) + int(rng.integers(0, k + 2))
        reqs.append(req)
    return reqs


def wide_logits(rng, reqs, slots, k, vocab):
    """Logits where the penalties decide: rows whose touched ids are raised to the top (the raw
    best is a touched id the apply changes), rows whose biases alone lift an id over an untouched
    best, exact ties across chunks and inside one (first maximum: the lower id), NaN and -inf at
    touched ids."""
    rows = len(slots)
    out = awkward_logits(rng, rows * (k + 1), vocab) / np.float32(4)  # ties, signed zeros, NaN
    for r, req in enumerate(reqs):
        lr = slice(r * (k + 1), (r + 1) * (k + 1))
        touched = sorted(set(req["prompt"]) | set(req["generated"]) | set(req["logit_bias"])
                         | set(req["stop_ids"]))
        if r % 2 == 0:
            out[lr, touched] += np.float32(8.0)
        else:  # an untouched id at 10.0 against biased ids that reach it exactly, or pass it
            free = [t for t in range(vocab) if t not in set(touched)]
            lo_id, hi_id = free[len(free) // 3], free[-5]
            out[lr, lo_id] = out[lr, hi_id] = np.float32(10.0)
            for t, b in list(req["logit_bias"].items())[:6]:
                if t not in req["prompt"] and t not in req["generated"] and t not in req["stop_ids"]:
                    req["logit_bias"][t] = 2.0 if r % 4 == 1 else 3.0
                    out[lr, t] = np.float32(8.0)  # 8 + 2 == 10: a tie; 8 + 3 passes
        out[lr.start, touched[1]] = np.nan
        out[lr.start + 1, touched[-1]] = -np.inf
    return out


@pytest.mark.parametrize("k", [2, 4])
def test_wide_fused_verify_is_the_three_calls_on_both_host_paths(path, dev, k):
    """Rows of several chunks: the fused greedy pass against the three calls, every bit (cells,
    logits past a rejection, logprobs, tables), with masks and a bitmask that forbid some of the
    ids the penalties lift; and against the numpy oracle without them."""
    rng = np.random.default_rng(60 + k)
    rows, vocab = 6, 5 * 4096 + 77
    slots = [3, 0, NO, 5, 1, 2]
    reqs = spread_requests(rng, rows, vocab, k)
    logits = wide_logits(rng, reqs, slots, k, vocab)
    drafts = deep_drafts(rng, reqs, slots, np.nan_to_num(logits, nan=-1e30), k, "float32")
    runs = [run_verify(dev, reqs, slots, logits, drafts, k, fused=f, logprobs=True) for f in (True, False)]
    assert_same(*runs)
    want = oracle(logits, reqs, slots, drafts, k)
    assert np.array_equal(runs[0]["logits"], want, equal_nan=True)  # the oracle drops zeros' signs
    # NaN below every number (argmax_rule.h), where numpy's argmax takes it first
    assert runs[0]["cells"].tolist() == greedy_cells(np.nan_to_num(want, nan=-np.inf), drafts, k)
    assert (runs[0]["cells"][:, 0] > 1).sum() >= 3  # rows that accepted drafts
    # Masks and a bitmask over each logit row's best ids, so the next best decide.
    words = (vocab + 31) // 32
    bits = np.full((rows * (k + 1), words), 0xFFFFFFFF, np.uint32)
    masks = []
    for lr in range(rows * (k + 1)):
        order = np.argsort(-np.nan_to_num(want[lr], nan=-np.inf), kind="stable")
        masks.append((int(order[0]), int(order[2])))
        bits[lr, order[1] // 32] &= ~np.uint32(1 << int(order[1] % 32))
    bitmask = dev.upload(bits)
    try:
        runs = [run_verify(dev, reqs, slots, logits, drafts, k, fused=f, logprobs=True, masks=masks,
                           bitmask=bitmask) for f in (True, False)]
    finally:
        bitmask.close()
    assert_same(*runs)


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=0.7), dict(presence_penalty=-1.25)])
def test_fused_verify_a_walked_draft_that_joins_the_table_wins(path, dev, penalty):
    """A draft no count holds yet, walked to the next position, where its penalty lifts it over
    an untouched id that was the best: the verify takes it there, and again at the bonus."""
    k, vocab = 2, 2 * 4096 + 5
    d, x = 6000, 3000
    req = dict(prompt=[5, 4500], generated=[9], **penalty)
    logits = np.zeros((k + 1, vocab), np.float32)
    logits[0, d] = 20.0
    logits[1:, x] = 9.0
    logits[1:, d] = 8.5  # 8.5 / 0.7 and 8.5 + 1.25 pass 9.0
    runs = [run_verify(dev, [req], [0], logits, [d, d], k, fused=f) for f in (True, False)]
    assert_same(*runs)
    assert runs[0]["cells"].tolist() == [[3, d, d, d]]


def test_fused_verify_a_banned_stop_ties_a_row_of_nothing_above_minus_inf(path, dev):
    """A row of NaN then -inf: the first -inf is the raw best; min_tokens bans a stop id among the
    NaN, which becomes -inf too, the same key at a lower id: the verify takes the stop id."""
    k, vocab = 1, 4096 + 50
    logits = np.full((k + 1, vocab), -np.inf, np.float32)
    logits[:, :10] = np.nan
    req = dict(prompt=[20], generated=[], stop_ids=[7], min_tokens=5)
    runs = [run_verify(dev, [req], [0], logits, [7], k, fused=f) for f in (True, False)]
    assert_same(*runs)
    assert runs[0]["cells"].tolist() == [[2, 7, 7]]


def test_host_fused_verify_gives_the_simt_bits(simt, dev):
    """The host's fused pass against the .cu kernels (simt) run as the three calls, float32 (the
    host's eight-id path) and float16 (its scalar rule)."""
    rng = np.random.default_rng(31)
    rows, vocab, k = 5, 350, 3
    slots = [0, 1, 2, NO, 4]
    reqs = requests(rng, rows, vocab, k)
    results = {}
    for name in ("host", "simt"):
        mf.set_backend(name)
        for dtype in ("float32", "float16"):
            logits = round_to(tempting(awkward_logits(np.random.default_rng(2), rows * (k + 1), vocab),
                                       reqs, slots, k), dtype)
            drafts = deep_drafts(np.random.default_rng(3), reqs, slots, np.nan_to_num(logits, nan=0.0),
                                 k, dtype)
            results[name, dtype] = run_verify(dev, reqs, slots, logits, drafts, k, fused=True,
                                              dtype=dtype, logprobs=True)
    for dtype in ("float32", "float16"):
        assert_same(results["host", dtype], results["simt", dtype])


@pytest.mark.parametrize("k", [2, 4])
def test_wide_host_fused_verify_gives_the_simt_bits(simt, dev, k):
    """Rows of several chunks: the host's greedy pass against the .cu kernels (simt) run as the
    three calls."""
    rows, vocab = 6, 5 * 4096 + 77
    rng = np.random.default_rng(60 + k)  # the rows of the test above
    slots = [3, 0, NO, 5, 1, 2]
    reqs = spread_requests(rng, rows, vocab, k)
    logits = wide_logits(rng, reqs, slots, k, vocab)
    drafts = deep_drafts(rng, reqs, slots, np.nan_to_num(logits, nan=-1e30), k, "float32")
    results = {}
    for name in ("host", "simt"):
        mf.set_backend(name)
        results[name] = run_verify(dev, reqs, slots, logits, drafts, k, fused=True, logprobs=True)
    assert_same(results["host"], results["simt"])
    assert (results["host"]["cells"][:, 0] > 1).sum() >= 2


def test_bad_fused_verify_calls_queue_nothing(host, dev):
    k = 2
    logits = dev.upload(np.zeros((2 * (k + 1), 8), np.float32))
    drafts = dev.upload(np.zeros(2 * k, np.uint32))
    cells = mf.DeviceBuffer(2 * (k + 2) * 4)
    kw = dict(k=k, rows=2, vocab=8, dtype="float32")
    with PenaltyState(2, capacity=4) as state:
        state.set(0, prompt=[1], frequency_penalty=1.0, logit_bias={3: 1.0})
        before = dev.download(logits, np.float32).tolist()
        with pytest.raises(ValueError, match="k = 2"):  # a plain step's launch
            mf.verify_to_feed(logits, drafts, cells, None, None, penalties=state.prepare(
                [0, 1], vocab=8, dtype="float32"), **kw)
        with pytest.raises(ValueError, match="k = 2"):
            mf.verify_to_feed(logits, drafts, cells, None, None, penalties=state.prepare(
                [0, 1], vocab=8, dtype="float32", k=1), **kw)
        launch = state.prepare([0, 1], vocab=8, dtype="float32", k=k)
        with pytest.raises(ValueError, match="rows"):
            mf.verify_to_feed(logits, drafts, cells, None, None, penalties=state.prepare(
                [0], vocab=8, dtype="float32", k=k), **kw)
        with pytest.raises(ValueError, match="device drafts"):
            mf.verify_to_feed(logits, [0] * (2 * k), cells, None, None, penalties=launch, **kw)
        with pytest.raises(TypeError, match="PenaltyLaunch"):
            mf.verify_to_feed(logits, drafts, cells, None, None, penalties=state, **kw)
        with pytest.raises(ValueError, match="overlap"):  # the cells written over the table
            mf.verify_to_feed(logits, drafts, state.table.ptr, None, None, penalties=launch, **kw)
        assert dev.download(logits, np.float32).tolist() == before
        assert state.read(0)["generated"] == 0
    for buf in (logits, drafts, cells):
        buf.close()
