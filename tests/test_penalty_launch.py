"""PenaltyState.prepare (a PenaltyLaunch, docs/penalties.md): a batch's two ops coerced once
queue what PenaltyState.apply and update queue with the same slots, and refuse what they refuse,
nothing queued."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.penalties import PenaltyState

NO = mf.NO_TOKEN


def request(rng, vocab):
    return dict(prompt=rng.integers(0, 40, 12).tolist(), generated=rng.integers(0, 60, 9).tolist(),
                repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.7,
                logit_bias={int(t): float(rng.normal() * 3) for t in rng.choice(vocab, 4, replace=False)},
                min_tokens=12, stop_ids=[5, 17])


def same_bits(got, want):
    assert got.tobytes() == want.tobytes()


def test_prepared_ops_queue_what_the_functions_queue(backend, dev):
    rng = np.random.default_rng(3)
    rows, vocab, stride = 5, 200, 203
    slots = [3, NO, 0, 4, 1]
    ids_buf = mf.DeviceBuffer(rows * 4)
    with PenaltyState(6, capacity=128) as a, PenaltyState(6, capacity=128) as b:
        for slot in slots:
            if slot != NO:
                req = request(rng, vocab)
                a.set(slot, **req)
                b.set(slot, **req)
        given = np.array(slots, np.uint32)
        launch = b.prepare(given, vocab=vocab, dtype="float32", row_stride=stride)
        given[0] = 2  # an unset slot: had the launch kept the caller's array, row 0 would change
        for _ in range(4):
            logits = (rng.normal(size=(rows, stride)) * 4).astype(np.float32)
            la, lb = dev.upload(logits), dev.upload(logits)
            assert a.apply(la, slots, vocab=vocab, dtype="float32", row_stride=stride) == rows
            assert launch.apply(lb) == rows
            want = dev.download(la, np.float32)
            same_bits(dev.download(lb, np.float32), want)
            assert not np.array_equal(want, logits.reshape(-1))  # the penalties did something
            la.close(), lb.close()
            dev.write(ids_buf, rng.integers(0, 50, rows).astype(np.uint32))
            assert a.update(ids_buf, slots) == launch.update(ids_buf, 0) == rows
        for slot in slots:
            if slot != NO:
                assert a.read(slot) == b.read(slot) and b.read(slot)["generated"] == 9 + 4
    ids_buf.close()


def test_a_tensor_takes_the_functions_path(host):
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(2, 30)) * 4).astype(np.float32)
    want, got = logits.copy(), logits.copy()
    with PenaltyState(2, capacity=32) as state:
        state.set(1, **request(rng, 30))
        state.apply(want, [1, NO])
        assert state.prepare([1, NO]).apply(got) == 2  # vocab and dtype from the tensor
        mf.stream_synchronize(0)
    same_bits(got, want)
    assert not np.array_equal(got, logits)


def test_prepared_refusals_queue_nothing(host, dev):
    logits = dev.upload(np.zeros((2, 8), np.float32))
    ids = mf.DeviceBuffer(4)
    with PenaltyState(2, capacity=4) as state:
        state.set(0, prompt=[1], logit_bias={1: 1.0})
        with pytest.raises(TypeError, match="device memory"):
            state.prepare(ids)
        with pytest.raises(TypeError, match="tensor"):
            _core.PenaltyLaunch([0], np.zeros(8, np.uint32), state.table, state.items)
        with pytest.raises(ValueError, match="at most"):
            state.prepare([NO] * (mf.MAX_ROWS + 1))
        for slots, match in (([0, 2], "slot 2"), ([0, 0], "two rows")):  # the C layer's checks
            with pytest.raises(ValueError, match=match):
                state.prepare(slots, vocab=8, dtype="float32").apply(logits)
        with pytest.raises(TypeError, match="vocab"):
            state.prepare([0, NO]).apply(logits)
        with pytest.raises(ValueError, match="ids: 8 bytes"):
            state.prepare([0, NO]).update(ids)
        launch = state.prepare([0], vocab=8, dtype="float32")
        assert (dev.download(logits, np.float32) == 0).all()
        assert state.read(0)["generated"] == 0
    with pytest.raises(mf.FeedError, match="closed"):  # the tables are resolved at each call
        launch.apply(logits)
    with pytest.raises(mf.FeedError, match="closed"):
        launch.update(ids)
    logits.close(), ids.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["argmax", "sample"])
def test_a_pick_with_penalties_queues_what_the_three_calls_queue(backend, dev, sampled, dtype):
    """argmax_to_feed/sample_to_feed(penalties=launch) against launch.apply, the same pick, and
    launch.update with its cells: the same logits, ids and counts, step after step (each step's
    counts change the next step's logits). The host runs the one call as one piece of work (each
    row's apply just before its pick, the counts after), its float32 apply eight ids at a time."""
    import ml_dtypes

    store = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    bits = np.uint32 if dtype == "float32" else np.uint16
    rng = np.random.default_rng(7)
    rows, vocab, stride = 5, 200, 203
    slots = [3, NO, 0, 4, 1]
    params = mf.sampling_params(rows, temperature=0.9, top_p=0.95, seed=np.arange(rows), position=0)
    with PenaltyState(6, capacity=128) as a, PenaltyState(6, capacity=128) as b, \
            mf.DeviceBuffer(rows * 4) as cells_a, mf.DeviceBuffer(rows * 4) as cells_b, \
            mf.PinnedBuffer(rows * 4) as dst_a, mf.PinnedBuffer(rows * 4) as dst_b, mf.Event() as done:
        for slot in slots:
            if slot != NO:
                req = request(rng, vocab)
                a.set(slot, **req)
                b.set(slot, **req)
        separate = a.prepare(slots, vocab=vocab, dtype=dtype, row_stride=stride)
        fused = b.prepare(slots)  # the pick gives the layout
        kw = dict(vocab=vocab, dtype=dtype, row_stride=stride)
        for step in range(4):
            logits = (rng.normal(size=(rows, stride)) * 4).astype(store)
            la, lb = dev.upload(logits), dev.upload(logits)
            if sampled:
                params["position"] = step
                separate.apply(la)
                mf.sample_to_feed(la, params, cells_a, dst_a, None, **kw)
                separate.update(cells_a)
                assert mf.sample_to_feed(lb, params, cells_b, dst_b, done, penalties=fused, **kw) == rows
            else:
                separate.apply(la)
                mf.argmax_to_feed(la, None, cells_a, dst_a, None, rows=rows, **kw)
                separate.update(cells_a)
                assert mf.argmax_to_feed(lb, None, cells_b, dst_b, done, rows=rows, penalties=fused,
                                         **kw) == rows
            done.synchronize()  # the event follows the update: the counts are final
            mf.stream_synchronize(0)
            assert bytes(dst_b) == bytes(dst_a)
            want = dev.download(la, bits)
            same_bits(dev.download(lb, bits), want)
            assert not np.array_equal(want, logits.view(bits).reshape(-1))  # the penalties did something
            for slot in slots:
                if slot != NO:
                    assert b.read(slot) == a.read(slot)
            la.close(), lb.close()
        assert b.read(0)["generated"] == 9 + 4


def test_a_pick_with_penalties_refused_queues_nothing(host, dev):
    logits = dev.upload(np.ones((2, 8), np.float32))
    cells, done = mf.DeviceBuffer(8), mf.Event()
    with PenaltyState(3, capacity=8) as state:
        state.set(0, prompt=[1], logit_bias={1: 1.0})
        kw = dict(rows=2, vocab=8, dtype="float32")
        cases = [
            (ValueError, "3 rows; the call picks 2", dict(penalties=state.prepare([0, NO, 1]))),
            (TypeError, "PenaltyLaunch", dict(penalties=object())),
            (ValueError, "unsharded", dict(penalties=state.prepare([0, NO]),
                                           shard=object())),  # refused before the shard is read
        ]
        readonly = np.ones((2, 8), np.float32)
        readonly.flags.writeable = False
        for exc, match, extra in cases:
            with pytest.raises(exc, match=match):
                mf.argmax_to_feed(logits, None, cells, None, done, **kw, **extra)
        with pytest.raises(ValueError, match="read-only"):
            mf.argmax_to_feed(readonly, None, cells, None, done, penalties=state.prepare([0, NO]))
        params = mf.sampling_params(2, temperature=1.0)
        with pytest.raises(ValueError, match="unsharded"):
            mf.sample_to_feed(logits, params, cells, None, done, penalties=state.prepare([0, NO]),
                              shard=object(), **kw)
        # One call writes the logits, cells, logprobs and tables: none may land on another's
        # input or output (the items and the cells, the logprobs and the items, ...).
        pen = state.prepare([0, NO])
        for what, over in (("cells", dict(cells=state.items)), ("logprobs", dict(logprobs=state.items)),
                           ("cells", dict(cells=state.state))):
            args = dict(cells=cells)
            args.update(over)
            with pytest.raises(ValueError, match="overlap"):
                mf.argmax_to_feed(logits, None, args.pop("cells"), None, done, penalties=pen, **kw,
                                  **args)
        assert done.query()  # nothing was recorded: nothing was queued
        assert (dev.download(logits, np.float32) == 1).all()
        assert state.read(0)["generated"] == 0
        launch = state.prepare([0, NO])
    with pytest.raises(mf.FeedError, match="closed"):  # the tables are resolved at each call
        mf.argmax_to_feed(logits, None, cells, None, done, penalties=launch, **kw)
    assert (dev.download(logits, np.float32) == 1).all()
    logits.close(), cells.close(), done.close()


def test_a_captured_pick_with_penalties_of_host_slots_is_refused(host):
    with PenaltyState(2, capacity=8) as state, mf.DeviceBuffer(2 * 8 * 4) as logits, \
            mf.DeviceBuffer(8) as cells, mf.Stream() as stream:
        state.set(0, prompt=[1], logit_bias={1: 1.0})
        launch = state.prepare([0, NO])
        with pytest.raises(mf.FeedError, match="host-resident slots"):
            with mf.graph_capture(stream):
                mf.argmax_to_feed(logits, None, cells, None, None, stream, rows=2, vocab=8,
                                  dtype="float32", penalties=launch)


def test_penalties_apply_reads_only_the_rows_of_its_slots(host):
    """A tensor with more rows than the slots (past MAX_ROWS, or overlapping past them) is fine:
    only the slots' rows are read and written."""
    with PenaltyState(1, capacity=8) as state:
        state.set(0, prompt=[1], logit_bias={2: 1.0})
        big = np.zeros((mf.MAX_ROWS + 1, 8), np.float32)
        state.apply(big, [0])
        overlapping = np.lib.stride_tricks.as_strided(np.zeros(16, np.float32), (3, 8), (4, 4))
        state.apply(overlapping, [0])
        mf.stream_synchronize(0)
    assert big[0, 2] == 1.0 and not big[1:].any()
    assert overlapping[0, 2] == 1.0
