"""Bitmasks and device-resident inputs: argmax_to_feed(bitmask=, masks=<device>) and
resolve_feed(sources=<device>) against the numpy oracle, on both host argmax paths."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_argmax

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def run_argmax(dev, logits, masks=None, bitmask=None, device_masks=False):
    rows, vocab = logits.shape
    buf = dev.upload(logits)
    cells = mf.DeviceBuffer(rows * 4)
    dst = np.full(rows, 7, np.uint32)
    held = [buf, cells]
    if bitmask is not None:
        bitmask = dev.upload(bitmask)
        held.append(bitmask)
    if device_masks:
        masks = dev.upload(np.asarray(masks, np.uint32))
        held.append(masks)
    with mf.Event() as done:
        mf.argmax_to_feed(buf, masks, cells, dst, done, rows=rows, vocab=vocab,
                          dtype=logits.dtype.name, bitmask=bitmask)
        done.synchronize()
    for b in held:
        b.close()
    return dst


def random_bitmask(rng, rows, vocab, density):
    bits = rng.random((rows, vocab)) < density
    words = np.zeros((rows, (vocab + 31) // 32), np.uint32)
    for v in range(vocab):
        words[:, v // 32] |= bits[:, v].astype(np.uint32) << np.uint32(v % 32)
    return words.view(np.int32)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 64, 100, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_bitmask_matches_the_oracle(path, no_leaks, dev, dtype, vocab, density):
    rng = np.random.default_rng(vocab * 31 + int(density * 100) + len(dtype))
    rows = 12
    pool = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 1.0, np.inf, np.nan], np.float32)
    logits = pool[rng.integers(0, len(pool), (rows, vocab))].astype(DTYPES[dtype])
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[::3] = mf.NO_TOKEN
    bitmask = random_bitmask(rng, rows, vocab, density)
    got = run_argmax(dev, logits, masks, bitmask)
    want = reference_argmax(logits, masks, bitmask)
    assert np.array_equal(got, want), (path, got, want)
    if density == 0.0:
        assert (got == mf.NO_TOKEN).all()


def test_device_masks_equal_host_masks(path, dev):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((9, 77)).astype(np.float32)
    masks = np.argsort(-logits, axis=1)[:, :2].astype(np.uint32)  # ban each row's two best
    masks[0] = mf.NO_TOKEN
    want = reference_argmax(logits, masks)
    assert np.array_equal(run_argmax(dev, logits, masks, device_masks=True), want)
    assert np.array_equal(run_argmax(dev, logits, masks), want)


def test_device_masks_are_read_when_the_kernel_runs(host, dev):
    """Values written into device masks after the call (in stream order, before the kernel runs)
    are the ones the kernel uses; host masks changed after the call are not."""
    rows, vocab = 2, 50
    logits = np.random.default_rng(5).standard_normal((rows, vocab)).astype(np.float32)
    best = logits.argmax(axis=1)
    buf, cells = dev.upload(logits), mf.DeviceBuffer(rows * 4)
    dmasks = dev.upload(np.full((rows, 2), mf.NO_TOKEN, np.uint32))
    banned = np.stack([best, np.full(rows, mf.NO_TOKEN)], 1).astype(np.uint32)
    dst = np.zeros(rows, np.uint32)
    with mf.Stream() as s, mf.Event() as done:
        mf.argmax_to_feed(buf, dmasks, cells, dst, done, s, rows=rows, vocab=vocab, dtype="float32")
        done.synchronize()
        assert np.array_equal(dst, best)
        mf.configure_host(lag_us=20000)  # the copy is still queued when the argmax call returns
        mf.copy_h2d_async(dmasks, banned, s)   # queued before the next argmax: it must see it
        mf.argmax_to_feed(buf, dmasks, cells, dst, done, s, rows=rows, vocab=vocab, dtype="float32")
        mf.configure_host()
        done.synchronize()
        assert np.array_equal(dst, reference_argmax(logits, banned))
        host_masks = banned.copy()
        mf.configure_host(lag_us=20000)
        mf.argmax_to_feed(buf, host_masks, cells, dst, done, s, vocab=vocab, dtype="float32")
        host_masks[:] = mf.NO_TOKEN  # too late: host masks were read at the call
        mf.configure_host()
        done.synchronize()
        assert np.array_equal(dst, reference_argmax(logits, banned))
    for b in (buf, cells, dmasks):
        b.close()


def test_device_sources_are_read_when_the_kernel_runs(host, dev):
    cells = dev.upload(np.array([10, 11, 12], np.uint32))
    out = mf.DeviceBuffer(16)
    src = dev.upload(np.zeros(4, np.uint32))
    words = np.array([2, mf.FeedSource.host(99), 0, 7], np.uint32)  # 7: beyond prev_rows
    with mf.Stream() as s:
        mf.copy_h2d_async(src, words, s)
        mf.resolve_feed(src, cells, out, s, prev_rows=3)
        s.synchronize()
        assert dev.download(out, "uint32").tolist() == [12, 99, 10, mf.NO_TOKEN]
        mf.resolve_feed(src, cells, out, s, prev_rows=3, rows=2)
        s.synchronize()
    with pytest.raises(ValueError):
        mf.resolve_feed(words, cells, out, prev_rows=3)  # host sources are checked: 7 >= 3
    for b in (cells, out, src):
        b.close()


def test_bad_bitmasks_and_masks_are_refused(host, dev):
    rows, vocab = 3, 70
    logits = dev.upload(np.zeros((rows, vocab), np.float32))
    cells = mf.DeviceBuffer(rows * 4)
    dst = np.full(rows, 5, np.uint32)
    small = mf.DeviceBuffer(rows * 3 * 4 - 4)  # one word short of [3, 3]
    with pytest.raises((ValueError, mf.FeedError)):
        mf.argmax_to_feed(logits, None, cells, dst, None, rows=rows, vocab=vocab, dtype="float32",
                          bitmask=small)
    with pytest.raises(TypeError):  # a CPU array stands for device memory here, but of int32 words
        mf.argmax_to_feed(logits, None, cells, dst, None, rows=rows, vocab=vocab, dtype="float32",
                          bitmask=np.zeros((rows, 3), np.float32))
    with pytest.raises(ValueError):  # too few words for rows x ceil(vocab / 32)
        mf.argmax_to_feed(logits, None, cells, dst, None, rows=rows, vocab=vocab, dtype="float32",
                          bitmask=np.zeros((rows, 1), np.int32))
    with pytest.raises(mf.FeedError):  # an int the host backend never allocated
        mf.argmax_to_feed(logits, None, cells, dst, None, rows=rows, vocab=vocab, dtype="float32",
                          bitmask=0x1000)
    ones = dev.upload(np.full((rows, 3), -1, np.int32))
    mf.argmax_to_feed(logits, None, cells, None, None, rows=rows, vocab=vocab, dtype="float32",
                      bitmask=ones.ptr)  # an int pointer to this package's device memory
    short_masks = mf.DeviceBuffer(rows * 8 - 4)
    with pytest.raises((ValueError, mf.FeedError)):
        mf.argmax_to_feed(logits, short_masks, cells, dst, None, rows=rows, vocab=vocab, dtype="float32")
    with pytest.raises(ValueError):
        mf.argmax_to_feed(logits, short_masks, cells, dst, None, vocab=vocab, dtype="float32")  # rows?
    mf.stream_synchronize(0)
    assert (dst == 5).all()  # nothing ran
    for b in (logits, cells, small, short_masks, ones):
        b.close()


def test_a_cpu_int32_bitmask_stands_for_device_memory_on_the_host_backend(host, dev):
    # xgrammar fills a CPU int32 tensor; on the host backend it is device memory, read at run time.
    rng = np.random.default_rng(7)
    rows, vocab = 4, 100
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    words = rng.integers(-2**31, 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    want = mf.reference_argmax(logits, None, bitmask=words).tolist()
    cells = mf.DeviceBuffer(rows * 4)
    dst = mf.PinnedBuffer(rows * 4)
    with mf.Event() as done:
        mf.argmax_to_feed(dev.upload(logits), None, cells, dst, done, rows=rows, vocab=vocab,
                          dtype="float32", bitmask=words)
        done.synchronize()
    assert np.frombuffer(dst, np.uint32).tolist() == want
    cells.close()
    dst.close()
