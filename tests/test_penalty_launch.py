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
