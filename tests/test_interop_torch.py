"""Interop with torch (docs/interop.md): torch tensors as device memory and as views of the
package's buffers, torch dtypes, and a transformers Llama served through the feed
(examples/hf_llama.py) giving exactly ``generate(do_sample=False)``'s tokens. Skipped cleanly
without torch or transformers (the ``torch`` extra installs both)."""

from __future__ import annotations

import gc
import pathlib
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import metrale_feed as mf  # noqa: E402
from metrale_feed import NO_TOKEN, DeviceBuffer, FeedError, PinnedBuffer, Stream  # noqa: E402
from metrale_feed.testing.oracle import reference_argmax  # noqa: E402

from helpers.modules import load_file  # noqa: E402

host_only = pytest.mark.skipif(mf.backend() == "cuda", reason="CPU tensors are device memory only on the host backend")
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"


def _example():
    pytest.importorskip("transformers")
    return load_file("hf_llama", EXAMPLE)


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the real model ----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_through_the_feed_equals_generate(dtype, one_thread):
    hf = _example()
    model = hf.small_llama(getattr(torch, dtype))
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 5, 5, 5, 5, 5], [42, 17], [7]]
    free = [hf.hf_greedy(model, p, 1, (NO_TOKEN, NO_TOKEN))[0] for p in prompts]
    # Bans that matter: rows 1 and 3 ban the token they would pick first, row 4 bans two ids.
    bans = [(NO_TOKEN, NO_TOKEN), (free[1], NO_TOKEN), (NO_TOKEN, NO_TOKEN), (NO_TOKEN, free[3]),
            (free[4], (free[4] + 1) % 256)]
    expect = [hf.hf_greedy(model, p, 20, b) for p, b in zip(prompts, bans)]
    assert expect[1][0] != free[1] and expect[3][0] != free[3]
    got = hf.greedy(model, prompts, 20, bans, router="async")
    assert got["tokens"] == expect
    assert got["stats"]["ahead_launches"] > 0  # the steps really ran ahead of the reads
    sync = hf.greedy(model, prompts, 20, bans, router="sync")
    assert sync["tokens"] == expect


# Prompts of 1 to 22 ids, several repeating ids (the repetition penalty has prompt ids to act
# on) and n-grams; the random model soon repeats itself too, so the n-gram drafter proposes
# drafts that get accepted. Blocks of 4 positions: every request crosses blocks, and the verify
# steps' rejected positions free some.
LLAMA_PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7], [5, 5, 5, 5, 5], [42, 17, 42, 17, 42],
                [7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
LLAMA_NEW = 24


@pytest.fixture(scope="module")
def llama32(one_thread):
    """The example, its float32 model, and generate's greedy tokens of LLAMA_PROMPTS (float32:
    transformers' processors run on float32 logits, so the feed's must be float32 too)."""
    hf = _example()
    model = hf.small_llama(torch.float32)
    return hf, model, [hf.hf_greedy(model, p, LLAMA_NEW) for p in LLAMA_PROMPTS]


# 64 blocks hold every request; 20 do not, so requests are preempted and resume by recompute.
POOLS = [64, 20]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("blocks", POOLS)
def test_llama_speculative_ngram_equals_generate(llama32, depth, k, blocks):
    hf, model, expect = llama32
    got = hf.pipeline_greedy(model, LLAMA_PROMPTS, LLAMA_NEW, depth=depth, speculative="ngram",
                             k=k, block_size=4, num_blocks=blocks)
    assert got["tokens"] == expect
    stats = got["stats"]
    assert stats["accepted"] > 0  # not vacuous: later positions of the verify step decided ids
    assert stats["drafted"] == k * (stats["emitted"] - stats["accepted"])  # k a row a step
    assert stats["emitted"] - stats["spec_discarded"] == len(LLAMA_PROMPTS) * LLAMA_NEW
    assert stats["spec_blocks_returned"] > 0  # rejected positions' blocks went back
    assert (stats["preemptions"] > 0) == (blocks < 64)
    if depth == 2:
        assert stats["host_syncs"] == stats["steps"] and stats["ahead_launches"] > 0


def _generate_drafter(k, sequences):
    """A drafter that proposes what generate gives next (each prompt followed by its greedy
    tokens), so every draft is accepted and each step commits ``k + 1`` ids a row."""
    from metrale_feed.sched.speculative import HostDrafter

    class GenerateDrafter(HostDrafter):
        def ahead_of(self, history, n):
            h = list(history)
            seq = next(s for s in sequences if s[:len(h)] == h)
            return seq[len(h):len(h) + n]

        def draft(self, history, k, seed, mask):
            return self.ahead_of(history, k)

        def after(self, history, drafts, seed, mask):  # the step in flight accepts them all
            return list(history) + self.ahead_of(history, self.k + 1)

    return GenerateDrafter(k)


@pytest.mark.parametrize("depth", [1, 2])
def test_llama_speculative_stops_inside_accepted_runs(llama32, depth):
    # Every draft accepted: step i commits generate's ids i*(k+1) .. i*(k+1)+k. Each request
    # stops at the first id of its tokens past the first step that is new and not last in its
    # run, so the ids after it in the run are discarded; its tokens are generate's up to the
    # stop (what generate gives with that id as its eos).
    hf, model, plain = llama32
    k = 3
    stops, expect, past = [], [], 0
    for tokens in plain:
        at = next(j for j in range(k + 1, len(tokens))
                  if tokens.index(tokens[j]) == j and j % (k + 1) != k)
        stops.append([tokens[at]])
        expect.append(tokens[:at + 1])
        past += k - at % (k + 1)
    drafter = _generate_drafter(k, [list(p) + t for p, t in zip(LLAMA_PROMPTS, plain)])
    feed = hf.HfLlamaFeed(model, max_rows=len(LLAMA_PROMPTS), block_size=4, num_blocks=64)
    try:
        with mf.DecodePipeline(feed, len(LLAMA_PROMPTS), depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=LLAMA_NEW, stop_ids=stop)
                    for p, stop in zip(LLAMA_PROMPTS, stops)]
            pipe.run()
            stats = pipe.stats.as_dict()
    finally:
        feed.close()
    assert [r.tokens for r in reqs] == expect
    assert all(r.finish_reason == "stop" for r in reqs)
    assert stats["accepted"] == stats["drafted"] > 0
    assert stats["spec_discarded"] == past


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("penalty", [1.3, 0.8])
@pytest.mark.parametrize("blocks", POOLS)
def test_llama_repetition_penalty_equals_generate(llama32, depth, penalty, blocks):
    hf, model, plain = llama32
    # A mixed batch: one row without the penalty, the others with it.
    penalties = [penalty] * len(LLAMA_PROMPTS)
    penalties[2] = 1.0
    expect = [hf.hf_greedy(model, p, LLAMA_NEW, repetition_penalty=rp)
              for p, rp in zip(LLAMA_PROMPTS, penalties)]
    assert expect[2] == plain[2]
    assert all(e != q for e, q, rp in zip(expect, plain, penalties) if rp != 1.0)  # it bites
    got = hf.pipeline_greedy(model, LLAMA_PROMPTS, LLAMA_NEW, depth=depth,
                             repetition_penalty=penalties, block_size=4, num_blocks=blocks)
    assert got["tokens"] == expect
    # A preempted request's penalty state is rebuilt from its prompt and committed tokens.
    assert (got["stats"]["preemptions"] > 0) == (blocks < 64)
    if depth == 2:
        assert got["stats"]["host_syncs"] == got["stats"]["steps"]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("blocks", POOLS)
def test_llama_speculative_with_a_repetition_penalty_equals_generate(llama32, depth, k, blocks):
    """The n-gram drafter and the repetition penalty together (docs/speculative.md,
    "Penalties"): each verified position judged with the drafts before it, so the greedy tokens
    are generate(repetition_penalty=)'s, a mixed batch, preemption by recompute included."""
    hf, model, _ = llama32
    penalties = [1.3] * len(LLAMA_PROMPTS)
    penalties[2] = 1.0
    expect = [hf.hf_greedy(model, p, LLAMA_NEW, repetition_penalty=rp)
              for p, rp in zip(LLAMA_PROMPTS, penalties)]
    got = hf.pipeline_greedy(model, LLAMA_PROMPTS, LLAMA_NEW, depth=depth, speculative="ngram", k=k,
                             repetition_penalty=penalties, block_size=4, num_blocks=blocks)
    assert got["tokens"] == expect
    assert got["stats"]["accepted"] > 0  # drafts accepted: positions past the first were judged
    assert (got["stats"]["preemptions"] > 0) == (blocks < 64)
    if depth == 2:
        assert got["stats"]["host_syncs"] == got["stats"]["steps"]


@pytest.mark.parametrize("args", [["--speculative", "ngram", "--k", "4"],
                                  ["--speculative", "ngram", "--k", "2", "--depth", "1"],
                                  ["--repetition-penalty", "1.3"],
                                  ["--repetition-penalty", "0.8", "--depth", "1"],
                                  ["--speculative", "ngram", "--repetition-penalty", "1.3"]])
def test_the_example_runs_with_its_options(one_thread, capsys, args):
    hf = _example()
    threads = mf.host_kernel_threads()
    try:
        hf.main(args)  # sets one device thread and one torch thread, as a run alone would
    finally:
        mf.host_kernel_threads(threads)
        torch.set_num_threads(1)  # the module's setting, restored by one_thread at its end
    out = capsys.readouterr().out
    assert "tokens equal transformers' greedy generate for every prompt" in out
    assert "pipeline depth" in out
    assert ("drafts accepted" in out) == ("--speculative" in args)


def test_a_failing_forward_surfaces_at_the_read(one_thread):
    hf = _example()
    model = hf.small_llama(torch.float32)
    feed = hf.HfLlamaFeed(model, max_rows=1)
    io = mf.AsyncDeviceIo(feed, 1)
    try:
        seq = mf.SequenceState(0)
        feed.prefill(seq, [1, 2])
        mf.stream_synchronize(0)  # the prefill's forward has run before the model breaks

        def broken(*args, **kwargs):  # the torch forward fails on the stream's worker
            raise IndexError("index out of range in self")

        model.forward = broken
        ticket = io.launch_decode([3], [seq], None)  # queued: the call itself does not raise
        with pytest.raises(FeedError, match="host function") as info:
            io.await_result(ticket)
        assert isinstance(info.value.__cause__, IndexError)
    finally:
        io.teardown()
        feed.close()


# ---- tensors ----

def test_torch_dtypes_are_spelled_by_name():
    assert [mf.dtype(t).name for t in (torch.float32, torch.float16, torch.bfloat16, torch.int32)] == [
        "float32", "float16", "bfloat16", "int32"]
    m = mf.RuntimeFeedMixin()
    m.init_device_feed(vocab=8, logits_dtype=torch.bfloat16, max_rows=1)
    assert m.feed_logits_dtype == "bfloat16"
    m.close_device_feed()


@host_only
def test_torch_from_dlpack_of_a_view_is_zero_copy():
    buf = DeviceBuffer(2 * 8 * 2)
    t = torch.from_dlpack(buf.view("bfloat16", (2, 8)))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 8) and t.data_ptr() == buf.ptr
    t.fill_(1.5)
    back = bytearray(buf.nbytes)
    mf.copy_d2h_async(buf, back)
    mf.stream_synchronize()
    assert torch.frombuffer(back, dtype=torch.bfloat16).tolist() == [1.5] * 16
    p = PinnedBuffer(16)
    u = torch.from_dlpack(p)
    assert u.dtype == torch.uint8 and u.data_ptr() == p.ptr
    with pytest.raises(BufferError):
        buf.close()  # t still uses it
    del t, u
    gc.collect()
    buf.close()


@host_only
def test_zero_byte_copies_with_empty_torch_tensors():
    # An empty torch tensor exports a null data pointer: a zero-byte copy with it is a no-op,
    # as with an empty numpy array, and everything else is still checked.
    empty = torch.empty(0)
    assert empty.data_ptr() == 0
    with DeviceBuffer(8) as dev:
        mf.copy_h2d_async(empty, b"")
        mf.copy_d2h_async(empty, bytearray())
        mf.copy_d2d_async(empty, dev, 0)
        mf.copy_d2d_async(dev, torch.empty((3, 0), dtype=torch.uint8), 0)
        mf.stream_synchronize()
        with pytest.raises(FeedError, match="unknown or destroyed stream"):
            mf.copy_d2h_async(empty, bytearray(), 0x3039)
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_h2d_async(empty, b"\x00")


@host_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_of_torch_logits(dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-2, 3, (6, 40), generator=g).to(dtype)[:, :33]  # a row stride of 40
    masks = [(0, 1), (NO_TOKEN, NO_TOKEN), (5, NO_TOKEN), (NO_TOKEN, 32), (3, 4), (NO_TOKEN, 7)]
    cells = torch.zeros(6, dtype=torch.int32)
    dst = PinnedBuffer(24)
    mf.argmax_to_feed(logits, masks, cells, dst, None)
    mf.stream_synchronize()
    expect = reference_argmax(logits.float().contiguous().numpy(), np.array(masks, np.uint32))
    assert np.frombuffer(dst, np.uint32).tolist() == list(expect) == cells.tolist()


@host_only
def test_bad_torch_tensors_are_refused_before_queueing():
    cells = torch.zeros(2, dtype=torch.int32)
    e = mf.Event()
    bad = [
        (TypeError, "gradient|DLPack", dict(logits=torch.zeros(2, 8, requires_grad=True))),
        (TypeError, "float32, float16 or bfloat16", dict(logits=torch.zeros(2, 8, dtype=torch.float64))),
        (ValueError, "unit stride", dict(logits=torch.zeros(8, 2).t())),
        (TypeError, "uint32 ids", dict(cells=torch.zeros(2, dtype=torch.int64))),
        (ValueError, "capacity", dict(cells=torch.zeros(1, dtype=torch.int32))),
    ]
    for exc, match, over in bad:
        args = dict(logits=torch.zeros(2, 8), cells=cells)
        args.update(over)
        with pytest.raises(exc, match=match):
            mf.argmax_to_feed(args["logits"], None, args["cells"], None, e)
        assert e.query()


@host_only
def test_a_torch_tensor_lives_until_its_work_has_run():
    mf.configure_host(lag_us=30_000)
    try:
        logits = torch.zeros(1, 8)
        logits[0, 6] = 1
        alive = weakref.ref(logits)
        cells = torch.zeros(1, dtype=torch.int32)
        s = Stream()
        mf.argmax_to_feed(logits, None, cells, None, None, s)
        del logits
        gc.collect()
        assert alive() is not None
        s.synchronize()
        mf.live_objects()
        gc.collect()
        assert alive() is None and cells.tolist() == [6]
        s.close()
    finally:
        mf.configure_host()


# ---- cuda backend (torch.cuda tensors and streams, CuPy) ----

@pytest.mark.gpu
def test_torch_cuda_tensors_and_streams_zero_copy():
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        logits = torch.randn(4, 1000, device="cuda", dtype=torch.bfloat16)
        cells = torch.zeros(4, dtype=torch.int32, device="cuda")
    dst = PinnedBuffer(16)
    e = mf.Event()
    mf.argmax_to_feed(logits, None, cells, dst, e, ts)  # a torch stream via __cuda_stream__/cuda_stream
    e.synchronize()
    assert np.frombuffer(dst, np.uint32).tolist() == logits.float().argmax(1).tolist()
    buf = DeviceBuffer(4 * 8)
    t = torch.from_dlpack(buf.view("float32", (8,)))
    assert t.device.type == "cuda" and t.data_ptr() == buf.ptr
    assert buf.__dlpack_device__()[0] == 2 and PinnedBuffer(4).__dlpack_device__() == (3, 0)
    assert buf.__cuda_array_interface__["version"] == 3
    buf.__dlpack__(stream=-1)  # no synchronisation asked for, none done
    w = Stream.from_handle(ts)
    assert w.handle == ts.cuda_stream


@pytest.mark.gpu
def test_cupy_arrays_both_ways():
    cp = pytest.importorskip("cupy")
    logits = cp.random.standard_normal((3, 500), dtype=cp.float32)
    cells = cp.zeros(3, dtype=cp.uint32)
    mf.argmax_to_feed(logits, None, cells, None, None)
    mf.stream_synchronize()
    assert cells.get().tolist() == logits.argmax(axis=1).get().tolist()
    buf = DeviceBuffer(16)
    a = cp.asarray(buf.view("uint32"))  # the CUDA array interface
    assert a.data.ptr == buf.ptr
    b = cp.from_dlpack(buf.view("f32", (2, 2)))
    assert b.shape == (2, 2)
