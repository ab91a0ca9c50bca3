"""The reference model: its forward is the logits function of docs/router.md, bit for bit, read
back through the paged KV cache; prefill, decode and KV bookkeeping."""

import random

import numpy as np
import pytest

import metrale_feed
from metrale_feed.kv import BlockPool, KvPoolExhausted, SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_logits, host_next_token


def fnv_fmix_logits_python(history, vocab):
    """The formula of docs/router.md in plain Python integers: the independent statement."""
    h = 0x811C9DC5
    for t in history:
        h = ((h ^ t) * 0x01000193) % 2**32
    out = []
    for v in range(vocab):
        x = (h + v * 0x9E3779B9) % 2**32
        x ^= x >> 16
        x = (x * 0x85EBCA6B) % 2**32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) % 2**32
        x ^= x >> 16
        out.append(np.float32(x >> 8) / np.float32(2**24))
    return np.array(out, np.float32)


def test_host_logits_match_the_formula():
    history = [5, 1, 99, 0, 12345]
    assert np.array_equal(host_logits(history, 300), fnv_fmix_logits_python(history, 300))


def read_logits(model, rows, dtype, width=None):
    itemsize = 4 if dtype == "float32" else 2
    raw = bytearray(rows * (model.feed_vocab if width is None else width) * itemsize)
    metrale_feed.copy_d2h_async(model.logits.ptr, raw, 0)
    metrale_feed.stream_synchronize(0)
    if dtype == "float32":
        return np.frombuffer(raw, np.float32).reshape(rows, -1)
    if dtype == "float16":
        return np.frombuffer(raw, np.float16).reshape(rows, -1)
    import ml_dtypes

    return np.frombuffer(raw, ml_dtypes.bfloat16).reshape(rows, -1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_forward_writes_kv_and_computes_bit_exact_logits(host, no_leaks, dtype):
    vocab, rng = 777, random.Random(3)
    with ReferenceModel(vocab, block_size=4, num_blocks=64, max_rows=8, logits_dtype=dtype) as model:
        seqs = [SequenceState(i) for i in range(3)]
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 6, 13)]
        for seq, prompt in zip(seqs, prompts):
            model.prefill(seq, prompt[:-1])
            assert seq.tokens == prompt[:-1] and seq.seq_len == len(prompt) - 1
        model.decode_batch([p[-1] for p in prompts], seqs)
        for seq, prompt in zip(seqs, prompts):
            assert seq.tokens == prompt and seq.seq_len == len(prompt)
            assert len(seq.block_table) == (len(prompt) + 3) // 4
        got = read_logits(model, 3, dtype)
        for row, prompt in enumerate(prompts):
            expected = host_logits(prompt, vocab, dtype)
            assert np.array_equal(got[row].view(np.uint8), expected.view(np.uint8)), dtype
        for seq in seqs:
            model.release_sequence(seq)
        assert model.pool.free_count == 64


def test_kv_is_read_back_through_the_block_table(host, no_leaks):
    """Blocks handed out out of order: the history must still come back in position order."""
    vocab = 500
    with ReferenceModel(vocab, block_size=2, num_blocks=16, max_rows=2) as model:
        a, b = SequenceState(0), SequenceState(1)
        model.prefill(a, [1, 2])         # a gets block 0
        model.prefill(b, [7, 8, 9])      # b gets blocks 1, 2
        model.prefill(a, [3, 4, 5])      # a gets blocks 3, 4
        assert a.block_table == [0, 3, 4]
        model.decode_batch([6, 10], [a, b])
        got = read_logits(model, 2, "float32")
        assert np.array_equal(got[0], host_logits([1, 2, 3, 4, 5, 6], vocab))
        assert np.array_equal(got[1], host_logits([7, 8, 9, 10], vocab))
        model.release_sequence(a)
        model.release_sequence(b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start, stop", [(300, 555), (0, 1), (776, 777), (0, 777)])
def test_a_sharded_model_computes_only_its_slice(host, no_leaks, dtype, start, stop):
    """As a column-parallel LM head: the logits a rank allocates and fills are its slice's
    columns, each the logit of its global id. (The shard's calls need a process group; the
    forward only reads the slice, so a stand-in suffices here; tests/tp runs the real one.)"""
    from types import SimpleNamespace

    vocab, width = 777, stop - start
    shard = SimpleNamespace(vocab=vocab, max_rows=8, start=start, stop=stop, width=stop - start)
    with ReferenceModel(vocab, block_size=4, num_blocks=64, max_rows=8, logits_dtype=dtype,
                        shard=shard) as model:
        assert model.logits.nbytes == 8 * width * (4 if dtype == "float32" else 2)
        seqs = [SequenceState(i) for i in range(3)]
        prompts = [[5], [1, 2, 3, 4, 5, 6], [9] * 11]
        for seq, prompt in zip(seqs, prompts):
            model.prefill(seq, prompt[:-1])
        assert model.decode_batch([p[-1] for p in prompts], seqs) == model.logits.ptr
        got = read_logits(model, 3, dtype, width)
        for row, prompt in enumerate(prompts):
            expected = host_logits(prompt, vocab, dtype)[start:stop]
            assert np.array_equal(got[row].view(np.uint8), expected.view(np.uint8)), row


def test_an_empty_slice_writes_the_kv_cache_only(host, no_leaks):
    from types import SimpleNamespace

    shard = SimpleNamespace(vocab=50, max_rows=2, start=50, stop=50, width=0)
    with ReferenceModel(50, block_size=2, num_blocks=8, max_rows=2, shard=shard) as model, \
            ReferenceModel(50, block_size=2, num_blocks=8, max_rows=2) as whole:
        for m in (model, whole):
            seq = SequenceState(0)
            m.prefill(seq, [4, 2])
            m.decode_batch([7], [seq])
        assert model.logits.nbytes == 1
        kv = [bytearray(8 * 2 * 4) for _ in range(2)]
        for m, raw in zip((model, whole), kv):
            metrale_feed.copy_d2h_async(m.kv, raw, 0)
        metrale_feed.stream_synchronize(0)
        assert kv[0] == kv[1] and np.frombuffer(kv[0], np.uint32)[:3].tolist() == [4, 2, 7]


def test_forward_columns_past_the_largest_vocabulary_are_refused(host, no_leaks):
    bufs = [metrale_feed.DeviceBuffer(n) for n in (4, 8, 4, 64, 16 * 4)]
    ids, meta, tables, kv, logits = bufs
    with pytest.raises(ValueError, match="start"):
        metrale_feed._core.reference_forward(ids, meta, tables, kv, 16, 4, 1, 16, "float32", logits,
                                             start=metrale_feed.MAX_VOCAB - 15)
    metrale_feed._core.reference_forward(ids, meta, tables, kv, 16, 4, 1, 16, "float32", logits,
                                         start=metrale_feed.MAX_VOCAB - 16)  # the last columns
    metrale_feed.stream_synchronize(0)
    for b in bufs:
        b.close()


def test_reserve_and_release_follow_design():
    model_pool = BlockPool(3)
    assert [model_pool.alloc() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KvPoolExhausted):
        model_pool.alloc()
    model_pool.free(1)
    with pytest.raises(metrale_feed.FeedError):
        model_pool.free(1)  # double free
    assert model_pool.free_count == 1


def test_reserve_decode_block_adds_only_at_block_boundaries(host, no_leaks):
    with ReferenceModel(50, block_size=4, num_blocks=8, max_rows=2) as model:
        seq = SequenceState(0)
        added = []
        for length in range(9):
            seq.seq_len = length
            added.append(model.reserve_decode_block(seq))
        assert added == [1, 0, 0, 0, 1, 0, 0, 0, 1]
        model.release_decode_blocks(seq, 2)
        assert len(seq.block_table) == 1 and model.pool.free_count == 7
        with pytest.raises(ValueError):
            model.release_decode_blocks(seq, 2)
        model.release_sequence(seq)


def test_kv_exhaustion_is_clear_and_leaks_nothing(host, no_leaks):
    with ReferenceModel(50, block_size=2, num_blocks=3, max_rows=4) as model:
        seqs = [SequenceState(i) for i in range(4)]
        for seq in seqs[:3]:
            model.prefill(seq, [1])
        with pytest.raises(KvPoolExhausted):
            model.prefill(seqs[3], [1, 2, 3])
        assert seqs[3].block_table == [] and seqs[3].seq_len == 0
        for seq in seqs[:3]:
            seq.seq_len = 2  # the next decode needs a new block for every row
        with pytest.raises(KvPoolExhausted):
            model.decode_batch([1, 2, 3], seqs[:3])
        assert model.pool.free_count == 0
        assert [len(s.block_table) for s in seqs[:3]] == [1, 1, 1]  # all or none
        for seq in seqs:
            model.release_sequence(seq)
        assert model.pool.free_count == 3


def test_host_next_token_masks_and_empty_rows():
    history = [4, 2]
    top = host_next_token(history, 100)
    assert top == int(np.argmax(host_logits(history, 100)))
    assert host_next_token(history, 100, mask=(top, 0xFFFFFFFF)) != top
    assert host_next_token([1], 2, mask=(0, 1)) == 0xFFFFFFFF
    assert host_next_token([1], 1, mask=(0, 0xFFFFFFFF)) == 0xFFFFFFFF


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numpy_only_rounding_matches_the_dtype(dtype):
    """host_next_token rounds without ml_dtypes; it must agree with the real dtype's rounding."""
    from metrale_feed.testing.reference import _widened_logits

    history = [7, 7, 1]
    expected = host_logits(history, 4000, dtype).astype(np.float32)
    assert np.array_equal(_widened_logits(history, 4000, dtype), expected)


def test_a_cache_past_uint32_slots_is_refused():
    with pytest.raises(ValueError, match="below 2\\*\\*32"):
        ReferenceModel(16, block_size=16, num_blocks=2**28)


def _native_sampled(prompt, max_new, vocab, dtype, mask, stops, sampling):
    """An independent statement of a sampled request alone: the sampler over the logits in the
    model's own dtype (``host_logits``, ``ml_dtypes`` for bfloat16), not widened to float32."""
    history, out = list(prompt), []
    itemsize = 4 if dtype == "float32" else 2
    with metrale_feed.DeviceBuffer(vocab * itemsize) as logits, \
            metrale_feed.DeviceBuffer(4) as cells, metrale_feed.Event() as done:
        while len(out) < max_new:
            row = np.ascontiguousarray(host_logits(history, vocab, dtype)).view(np.uint8)
            metrale_feed.copy_h2d_async(logits, row)
            params = metrale_feed.sampling_params(1, position=len(history), **sampling)
            dst = np.zeros(1, np.uint32)
            metrale_feed.sample_to_feed(logits, params, cells, dst, done,
                                        masks=np.array([mask], np.uint32), vocab=vocab,
                                        dtype=dtype)
            done.synchronize()
            out.append(int(dst[0]))
            history.append(out[-1])
            if out[-1] in stops:
                break
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_tokens_is_the_one_oracle_of_the_demo_and_the_tests(host, dtype):
    """``reference_tokens`` decodes one request alone: greedy is ``host_next_token`` step by
    step (a mask, a stop committed last), sampled is the sampler over the model's own dtype at
    position ``len(history)``; the demo's ``host_reference`` is that same oracle."""
    from metrale_feed.testing.reference import reference_tokens
    from metrale_feed.tools import demo

    vocab, none = 300, 0xFFFFFFFF
    rng = random.Random(11)
    for _ in range(6):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        mask = (host_next_token(prompt, vocab, dtype), rng.randrange(vocab))
        history, want = list(prompt), []
        for _ in range(7):
            want.append(host_next_token(history, vocab, dtype, mask))
            history.append(want[-1])
        assert reference_tokens(prompt, 7, vocab, dtype, mask=mask) == want
        stop = want[3]
        cut = want[: want.index(stop) + 1]
        assert reference_tokens(prompt, 7, vocab, dtype, mask=mask, stops={stop, vocab + 5}) == cut
        assert demo.host_reference(prompt, mask, stop, 7, vocab, dtype) == cut
        assert demo.host_reference(prompt, (none, none), none, 7, vocab, dtype) == \
            reference_tokens(prompt, 7, vocab, dtype)

        sampling = {"temperature": 1.3, "top_k": rng.choice([0, 40]), "top_p": 0.9,
                    "seed": rng.getrandbits(64)}
        drawn = _native_sampled(prompt, 7, vocab, dtype, mask, (), sampling)
        assert reference_tokens(prompt, 7, vocab, dtype, mask=mask, sampling=sampling) == drawn
        assert demo.host_reference(prompt, mask, drawn[2], 7, vocab, dtype, sampling) == \
            drawn[: drawn.index(drawn[2]) + 1]
        assert drawn != want  # the draw is not the argmax here: the sampled path was taken
