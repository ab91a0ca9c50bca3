"""The simt backend gives, bit for bit, what the host backend gives: ids, draws, logprobs and
partial blocks, for the same inputs. The host backend computes with its own C++ twins of the
kernels; simt runs the CUDA sources. Few SMs in the launch planning make few-row calls split their
rows, so the split path and its last-block combine run too, in every block order and with blocks
on several threads at once."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.testing.oracle import reference_argmax

from helpers.backends import on
from helpers.calls import pick, split, upload_slice
from helpers.records import SELECT_ROW

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
N = mf.NO_TOKEN

# The executor's settings a case runs under: the default plan, a 2-SM plan (few rows split), and
# the split plan with blocks in reverse, in a random order, and on four threads at once.
SETTINGS = {
    "default": {},
    "split": dict(sm_count=2),
    "split-reversed": dict(sm_count=2, order="reversed"),
    "split-random": dict(sm_count=3, order="random", seed=11),
    "split-parallel": dict(sm_count=2, threads=4, order="random", seed=5),
}


def same_bits(a, b):
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def both(fn, settings="default"):
    """(host result, simt result) of fn(), each a tuple of arrays; asserts they are equal bytes."""
    h = on("host", fn)
    s = on("simt", fn, **SETTINGS[settings])
    for i, (x, y) in enumerate(zip(h, s)):
        if not same_bits(x, y):
            x, y = np.asarray(x), np.asarray(y)
            bad = np.flatnonzero(x.reshape(-1).view(np.uint8) != y.reshape(-1).view(np.uint8))
            raise AssertionError(f"output {i} differs between host and simt ({settings}) at bytes "
                                 f"{bad[:8].tolist()}: host {x.reshape(-1)[:8]} simt {y.reshape(-1)[:8]}")
    return h


def logits_for(rng, rows, vocab, dtype, special=True):
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if special and vocab > 4:
        x[0, rng.integers(0, vocab, 3)] = -np.inf
        if rows > 1:
            x[1, rng.integers(0, vocab, 2)] = np.nan
        if rows > 2:
            x[2, :] = x[2, 0]  # a row of ties: the lowest id wins
    return x.astype(DTYPES[dtype])


def masks_for(rng, rows, vocab):
    m = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    m[::3] = N
    return m


def bitmask_for(rng, rows, vocab):
    words = (vocab + 31) // 32
    b = rng.integers(-2**31, 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    b[0] = -1
    return b


@pytest.mark.parametrize("settings", sorted(SETTINGS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 17), (7, 1000), (2, 20000), (5, 40000)])
def test_argmax_and_its_logprobs(host, dev, settings, dtype, rows, vocab):
    rng = np.random.default_rng(rows * 1000 + vocab + len(dtype))
    logits = logits_for(rng, rows, vocab, dtype)
    masks = masks_for(rng, rows, vocab)
    ids, lp = both(lambda: pick(dev, logits, masks), settings)
    assert np.array_equal(ids, reference_argmax(logits, masks))


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
@pytest.mark.parametrize("pad", [0, 3])
def test_argmax_with_a_bitmask_and_a_padded_stride(host, dev, settings, pad):
    rng = np.random.default_rng(pad)
    rows, vocab = 4, 9000
    logits = logits_for(rng, rows, vocab + pad, "float32")
    masks, bits = masks_for(rng, rows, vocab), bitmask_for(rng, rows, vocab)
    ids, lp = both(lambda: pick(dev, logits, masks, bits, row_stride=(vocab + pad, vocab)), settings)
    assert np.array_equal(ids, reference_argmax(logits[:, :vocab], masks, bits))


FILTERS = {
    "temperature": dict(temperature=[0.0, 0.5, 1.0, 2.0, 1e-3, 1.3]),
    "top_k": dict(temperature=0.9, top_k=[1, 5, 50, 0, 2, 1000]),
    "top_p": dict(temperature=1.1, top_p=[0.9, 0.3, 1.0, 1e-6, 0.999, 0.5]),
    "min_p": dict(temperature=0.7, min_p=[0.1, 0.0, 0.5, 0.01, 0.9, 0.2]),
    "all": dict(temperature=0.8, top_k=[40, 3, 0, 7, 100, 1], top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("filters", sorted(FILTERS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("vocab", [50, 3000])
def test_sampling_draws_and_logprobs(host, dev, filters, dtype, vocab):
    rng = np.random.default_rng(vocab + len(filters) + len(dtype))
    rows = 6
    logits = logits_for(rng, rows, vocab, dtype)
    masks, bits = masks_for(rng, rows, vocab), bitmask_for(rng, rows, vocab)
    params = mf.sampling_params(rows, seed=list(range(7, 7 + rows)), position=[3, 1, 4, 1, 5, 9],
                                **FILTERS[filters])
    draws = []
    for seed in range(4):  # other seeds, other draws: the comparison is not of a constant
        params["seed"] += 101 * seed
        ids, _ = both(lambda: pick(dev, logits, masks, bits, params=params))
        draws.append(ids)
    if filters != "temperature" or vocab > 100:
        assert len({d.tobytes() for d in draws}) > 1


@pytest.mark.parametrize("bitmask", [False, True])
def test_top_p_on_flat_rows(host, dev, bitmask):
    """top_p without top_k on rows flat enough and long enough for the host's one-pass path (the
    masses and the race together, a cut from a sample checked exactly): the draws of the kernels,
    over a length that is not a multiple of 8, with the top masked in one row."""
    rng = np.random.default_rng(45 + bitmask)
    rows, vocab = 4, 9001
    logits = logits_for(rng, rows, vocab, "float32")
    masks = masks_for(rng, rows, vocab)
    masks[3, 0] = np.argmax(logits[3])
    bits = bitmask_for(rng, rows, vocab) if bitmask else None
    params = mf.sampling_params(rows, temperature=[1.0, 0.7, 1.6, 1.0], top_p=[0.9, 0.5, 0.99, 0.2],
                                min_p=[0.0, 0.0, 0.01, 0.0], seed=list(range(3, 3 + rows)), position=[5, 8, 1, 0])
    for seed in range(3):
        params["seed"] += 977 * seed
        both(lambda: pick(dev, logits, masks, bits, params=params))


@pytest.mark.parametrize("settings", ["default", "split"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("offsets", [(0, 1000, 2000, 3001), (0, 0, 3001), (0, 1500, 3001)])
def test_partial_blocks_and_their_combine(host, dev, settings, sampled, offsets):
    rng = np.random.default_rng(len(offsets) + sampled)
    rows, vocab = 5, offsets[-1]
    logits = logits_for(rng, rows, vocab, "float32")
    masks = masks_for(rng, rows, vocab)
    params = mf.sampling_params(rows, temperature=[0.0, 0.7, 1.0, 1.5, 0.2], seed=3, position=2) if sampled else None

    def run():
        ids, lp, fault = split(dev, logits, list(offsets), masks=masks, params=params)
        word = np.frombuffer(bytes(fault), np.uint32).copy()
        fault.close()
        return ids, lp, word

    ids, lp, word = both(run, settings)
    assert word[0] == 0
    if not sampled:
        assert np.array_equal(ids, reference_argmax(logits, masks))


@pytest.mark.parametrize("settings", ["default", "split"])
@pytest.mark.parametrize("offsets", [(0, 1000, 2000, 3001), (0, 0, 3001)])
def test_a_split_greedy_verify_combine(host, dev, settings, offsets):
    # MF_COMBINE_VERIFY's kernel (mf_verify_combined_row): cells and logprobs, fault word included.
    rng = np.random.default_rng(len(offsets))
    k, rows, vocab = 3, 4, offsets[-1]
    logits = logits_for(rng, rows * (k + 1), vocab, "float32")
    masks = masks_for(rng, rows * (k + 1), vocab)
    best = reference_argmax(logits, masks).reshape(rows, k + 1)
    drafts = best[:, :k].astype(np.uint32)
    drafts[1, 1] = (drafts[1, 1] + 1) % vocab  # one row rejects at its second draft
    drafts[2, 0] = N                           # one row has no drafts

    def run():
        cells, lp, fault = split(dev, logits, list(offsets), masks=masks, drafts=drafts, k=k)
        word = np.frombuffer(bytes(fault), np.uint32).copy()
        fault.close()
        return cells, lp, word

    cells, lp, word = both(run, settings)
    assert word[0] == 0
    assert cells.reshape(rows, k + 2)[:, 0].tolist() == [k + 1, 2, 1, k + 1]


@pytest.mark.parametrize("on_device", [False, True])
def test_resolve_feed(host, dev, on_device):
    rng = np.random.default_rng(4)
    n, prev_rows = 3000, 300
    prev = rng.integers(0, 5000, prev_rows).astype(np.uint32)
    # Device-resident sources are bounded by the kernel: a from_row past prev_rows gives NO_TOKEN.
    rows_from = rng.integers(0, prev_rows + (100 if on_device else 0), n)
    sources = np.where(rng.random(n) < 0.5, rows_from, rng.integers(0, 9000, n) | (1 << 31)).astype(np.uint32)

    def run():
        cells, out = dev.upload(prev), mf.DeviceBuffer(4 * n)
        src = dev.upload(sources) if on_device else sources
        mf.resolve_feed(src, cells, out, prev_rows=prev_rows, rows=n)
        mf.stream_synchronize(0)
        got = dev.download(out, "uint32")
        for b in (cells, out) + ((src,) if on_device else ()):
            b.close()
        return (got,)

    (got,) = both(run)
    from_prev = prev[np.minimum(sources, prev_rows - 1)]
    want = np.where(sources >> 31, sources & 0x7FFFFFFF, np.where(sources < prev_rows, from_prev, N))
    assert np.array_equal(got, want.astype(np.uint32))


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_sampled_with_a_device_advance_and_logprobs(host, dev, settings, dtype):
    """verify_to_feed's cells and logprobs, sampled and greedy rows with filters, masks and a
    device ``advance`` moving the sampled positions: the same bytes from the CUDA source on simt
    as from the host backend's twin."""
    from test_verify import drafts_near, filtered_params, verify

    rng = np.random.default_rng(29)
    k, rows, vocab = 3, 10, 300
    logits = logits_for(rng, rows * (k + 1), vocab, dtype)
    params = filtered_params(rng, rows)
    best = reference_argmax(logits.astype(np.float32)).reshape(rows, k + 1)
    drafts = drafts_near(rng, best, k, vocab, hit=0.7)
    masks = masks_for(rng, rows * (k + 1), vocab)
    advance = rng.integers(0, k + 2, rows).astype(np.uint32)

    def run():
        return verify(dev, logits, drafts, k, params=params, masks=masks, advance=advance,
                      logprobs=True)

    cells, _ = both(run, settings)
    assert (cells[:, 0] >= 1).all() and (cells[:, 0] <= k + 1).all()  # every row emitted


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_top_logprobs_combine(host, dev, settings, dtype):
    # MF_TOP_PARTIAL's kernel and mf_top_combine_kernel: the records, the chosen logprobs and the
    # fault word, with an empty slice and ids in it, NO_TOKEN and past the vocabulary.
    from helpers.calls import split_top

    rng = np.random.default_rng(7)
    rows, vocab, n = 5, 3001, 6
    logits = logits_for(rng, rows, vocab, dtype)
    given = np.array([0, 3000, N, vocab + 1, 1999], np.uint32)

    def run():
        recs, chosen, fault = split_top(dev, logits, [0, 1000, 1000, vocab], n, ids=given)
        word = np.frombuffer(bytes(fault), np.uint32).copy()
        fault.close()
        return recs, chosen, word

    recs, chosen, word = both(run, settings)
    assert word[0] == 0
    assert np.isnan(chosen[[2, 3]]).all() and not np.isnan(chosen[[0, 1, 4]]).any()


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
def test_the_split_filters_decisions(host, dev, settings):
    # mf_select_decide_kernel: every slice's final select state and plan (what the decisions
    # wrote, through a top_k radix select, then a top_p one), its fault word and the draws.
    from helpers.calls import split_filtered

    rng = np.random.default_rng(9)
    rows, vocab = 5, 2600
    logits = logits_for(rng, rows, vocab, "float32")
    params = mf.sampling_params(rows, temperature=rng.uniform(0.6, 1.4, rows), seed=np.arange(rows),
                                top_k=[1500, 0, 1100, 2000, 0], top_p=[0.9, 0.7, 1.0, 0.5, 0.95],
                                min_p=[0.0, 0.01, 0.0, 0.0, 0.02])

    def run():
        states = []
        ids, fault, words = split_filtered(dev, logits, [0, 900, 900, vocab], params, states=states)
        word = np.frombuffer(bytes(fault), np.uint32).copy()
        fault.close()
        return ids, word, np.array(words, np.uint32), np.frombuffer(b"".join(states), np.uint8)

    ids, word, words, states = both(run, settings)
    assert word[0] == 0 and not words.any()
    assert not (ids == N).any()




def key_f32(bits):
    """argmax_rule.h's mf_key_f32: the order of float32 bits as an unsigned key (NaN lowest)."""
    bits = np.asarray(bits, np.uint32).astype(np.int64)
    mag = bits & 0x7FFFFFFF
    key = np.where(bits >> 31, 0x80000000 - mag, 0x80000000 + mag)
    return np.where(mag > 0x7F800000, 0, np.where(mag == 0, 0x80000000, key)).astype(np.uint32)


def select_states(rng, logits, lo, hi, masks):
    """Each row's state between stages as the decisions could leave it: the whole row's zmax, a
    floor and a cut at the key of one of the slice's candidates (needing none, one, some or more
    than the key holds), a round's prefix and shift over another's, and mixes of the flags."""
    f = _core.SELECT_ROW_FLAGS
    rows = logits.shape[0]
    st = np.zeros(rows, SELECT_ROW)
    st["list_len"] = N
    bits = logits.view(np.uint32)
    for r in range(rows):
        ok = np.isfinite(logits[r]) & ~np.isin(np.arange(logits.shape[1]), masks[r])
        if not ok.any():
            continue
        st["top_bits"][r] = bits[r][ok][np.argmax(logits[r][ok])]  # the row's zmax, whichever slice
        mine = np.flatnonzero(ok[lo:hi]) + lo
        flags = f["top"] | [0, f["hist"], f["hist"] | f["mass"]][r % 3] | (f["cands"] if r % 2 else 0)
        if mine.size:
            one, other = rng.choice(mine, 2)
            if r % 4:
                flags |= f["cut"] | (f["cut_mass"] if r % 3 == 2 else 0)
                st["cut_key"][r] = key_f32(bits[r, one])
                st["cut_need"][r] = [0, 1, 3, 2**60][r % 4]
            if r % 5 == 1:
                st["floor"][r] = np.uint64((int(key_f32(bits[r, other])) << 32) | (~int(other - lo) & 0xFFFFFFFF))
            shift = [24, 16, 8, 0][r % 4]
            st["shift"][r] = shift
            st["prefix"][r] = int(key_f32(bits[r, other])) & ~((1 << (shift + 8)) - 1) & 0xFFFFFFFF
        st["flags"][r] = flags
    return st


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
@pytest.mark.parametrize("stage", ["top", "hist", "cands", "race"])
def test_each_select_stage_writes_the_hosts_block_and_state(host, dev, settings, stage):
    # mf_select_stage_kernel, one stage at a time, from states the decisions could leave: the
    # block (header, records, bins or lists) and every row's state written back, byte for byte.
    rng = np.random.default_rng(["top", "hist", "cands", "race"].index(stage))
    rows, vocab, lo, hi = 9, 1800, 500, 1500
    logits = logits_for(rng, rows, vocab, "float32")
    logits[3] = np.round(logits[3])      # runs of equal keys: cuts inside them
    logits[4, lo:hi] = np.nan            # a slice with no candidate
    masks = masks_for(rng, rows, vocab)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.5, 1.5, rows), seed=np.arange(rows) + 1,
                                position=3, top_k=[3, 0, 40, 700, 2, 1000, 0, 9, 5],
                                top_p=[0.9, 0.6, 1.0, 0.8, 1.0, 0.95, 0.5, 1.0, 0.7],
                                min_p=[0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.01, 0.0, 0.0])
    params["temperature"][7] = 0.0       # greedy: the argmax rule in the race, nothing elsewhere
    states = select_states(rng, logits, lo, hi, masks)
    cap = 64
    size = {"hist": 32 + 2048 * rows, "cands": 32 + 8 * cap * rows}.get(stage, 32 + 16 * rows)

    def run():
        held = []
        part = upload_slice(dev, logits, lo, hi, 3, held)
        block, state = dev.upload(np.full(size, 0xAB, np.uint8)), dev.upload(states)
        kw = dict(cands_cap=cap) if stage in ("cands", "race") else {}
        _core._select_partial(part, params, block, state, stage, start=lo, stop=hi, vocab=vocab,
                              dtype="float32", call=33, rows=rows, row_stride=hi - lo + 3,
                              masks=masks, logprobs=stage == "race", **kw)
        out = dev.download(block, np.uint8), dev.download(state, np.uint8)
        for b in held + [block, state]:
            b.close()
        return out

    block, state = both(run, settings)
    assert not (block[32:] == 0xAB).all()  # the stage wrote its rows


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
def test_grammar_mask_and_advance(host, dev, settings):
    """mf_grammar_mask_kernel and mf_grammar_advance_kernel write the host's words over any
    automaton, well-formed or not: random records whose edges run in any order, pass the edge
    array or name states past the table (the rule's answers, bounded, whatever the data say)."""
    rng = np.random.default_rng(9)
    vocab, num_states, num_edges, rows, k = 1001, 40, 600, 7, 3
    dead = _core.GRAMMAR_DEAD
    states = np.stack([rng.integers(0, num_edges + 20, num_states), rng.integers(0, 80, num_states),
                       np.where(rng.random(num_states) < 0.3, rng.integers(0, num_states + 3, num_states), dead),
                       np.zeros(num_states, np.int64)], axis=1).astype(np.uint32)
    tokens = rng.integers(0, vocab + 40, num_edges)
    tokens[: num_edges // 2].sort()  # half of them in order, as a builder writes them
    edges = np.stack([tokens, np.where(rng.random(num_edges) < 0.2, dead,
                                       rng.integers(0, num_states + 3, num_edges))], axis=1).astype(np.uint32)
    words = np.array([0, 5, 17, N, num_states, 33, 2], np.uint32)
    drafts = np.where(rng.random(rows * k) < 0.1, N, rng.integers(0, vocab + 5, rows * k)).astype(np.uint32)
    nwords = (vocab + 31) // 32
    bitmask_in = rng.integers(0, 2**32, rows * (k + 1) * nwords, dtype=np.uint64).astype(np.uint32)
    cells = rng.integers(0, vocab, rows * (k + 2)).astype(np.uint32)
    cells[:: k + 2] = [1, 2, k + 1, 0, k + 2, 3, 4]  # n in and out of [1, k + 1]

    def run():
        held = [dev.upload(a) for a in (states, edges, words, drafts, bitmask_in, cells)]
        s, e, w, d, b, c = held
        out = mf.DeviceBuffer(bitmask_in.nbytes)
        plain = mf.DeviceBuffer(rows * nwords * 4)
        auto = dict(num_states=num_states, num_edges=num_edges, vocab=vocab, rows=rows)
        _core._grammar_mask(s, e, w, out, k=k, drafts=d, bitmask_in=b, **auto)
        _core._grammar_mask(s, e, w, plain, **auto)
        _core._grammar_advance(s, e, c, w, k=k, **auto)
        after_verify = dev.download(w, "uint32")
        _core._grammar_advance(s, e, c, w, **auto)  # k = 0: the first rows' cells as ids
        got = (dev.download(out, "uint32"), dev.download(plain, "uint32"), after_verify, dev.download(w, "uint32"))
        for buf in held + [out, plain]:
            buf.close()
        return got

    masked, plain, after_verify, after_plain = both(run, settings)
    assert masked.any() and plain.any() and (after_verify != words).any()


@pytest.mark.parametrize("settings", ["default", "split-parallel"])
def test_grammar_in_a_pick(host, dev, settings):
    """argmax_to_feed, sample_to_feed and verify_to_feed with grammar=: the mask, the pick with
    it and the advance, queued by the one C call, give the host's cells, logprobs and state words
    (sampled rows with filters, the caller's bitmask ANDed in, a verify walking host drafts)."""
    from metrale_feed import TokenAutomaton

    rng = np.random.default_rng(12)
    vocab, rows, k = 300, 6, 2
    table = {s: {int(t): int(rng.integers(0, 9)) for t in rng.choice(vocab, int(rng.integers(2, 40)), replace=False)}
             for s in range(8)}
    table[8] = {t: (0 if t % 5 else 4) for t in range(vocab) if t % 13}  # most of the vocabulary
    table[9] = {}
    words = np.array([0, 8, N, 3, 9, 5], np.uint32)
    logits = logits_for(rng, rows * (k + 1), vocab, "float32", special=False)
    bitmask = rng.integers(0, 2**32, rows * (k + 1) * ((vocab + 31) // 32), dtype=np.uint64).astype(np.uint32)
    params = mf.sampling_params(rows, temperature=[0.0, 0.8, 1.2, 0.6, 1.0, 0.9], top_k=[0, 20, 0, 5, 0, 50],
                                top_p=[1.0, 0.9, 0.7, 1.0, 1.0, 0.8], seed=3, position=list(range(rows)))
    drafts = rng.integers(0, vocab, rows * k).astype(np.uint32)

    def run():
        with TokenAutomaton(table, initial=0, vocab=vocab) as auto:
            auto.to_device()
            held = [dev.upload(a) for a in (logits, bitmask, words)]
            lg, bm, st = held
            cells, lp = mf.DeviceBuffer(rows * (k + 2) * 4), mf.DeviceBuffer(rows * (k + 1) * 4)
            out = []
            for n, call in (
                (rows, lambda: mf.argmax_to_feed(lg, None, cells, None, None, rows=rows, vocab=vocab,
                                                 dtype="float32", bitmask=bm, logprobs=lp, grammar=(auto, st))),
                (rows, lambda: mf.sample_to_feed(lg, params, cells, None, None, vocab=vocab, dtype="float32",
                                                 bitmask=bm, logprobs=lp, grammar=(auto, st))),
                (rows * (k + 2), lambda: mf.verify_to_feed(lg, drafts, cells, None, None, k=k, vocab=vocab,
                                                           dtype="float32", bitmask=bm, params=params,
                                                           grammar=(auto, st))),
            ):
                call()
                out += [dev.download(cells, "uint32")[:n], dev.download(st, "uint32")]
            out.append(dev.download(lp, "float32"))
            for buf in held + [cells, lp]:
                buf.close()
            return tuple(out)

    got = both(run, settings)
    assert (got[1] != words).any() and (got[5] != got[3]).any()  # the states moved
