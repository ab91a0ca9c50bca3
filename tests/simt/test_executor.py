"""The simt executor itself: it catches what breaks CUDA's rules (a barrier not every live thread
reaches, a shuffle whose mask names a lane that never arrives), it computes right when the rules
hold, and its settings are checked."""

import re

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

BROKEN = {
    # kernel: the words its fault must hold
    "split_barrier": "different __syncthreads",
    "barrier_in_branch": "is not reached by every live thread",
    "mask_names_exited": "which has exited",
    "reads_outside_mask": "does not name",
    "different_shuffles": "different shuffles",
}


def test_the_self_test_kernels_are_all_here():
    caught, names = _core._simt_selftest("")
    assert caught == 0 and set(names.split()) == set(BROKEN) | {"correct"}


@pytest.mark.parametrize("kernel", sorted(BROKEN))
def test_a_broken_rule_is_a_fault_naming_the_kernel_and_the_line(kernel):
    caught, message = _core._simt_selftest(kernel)
    assert caught == 1, f"the executor let {kernel} pass: {message!r}"
    assert f"kernel {kernel} " in message and BROKEN[kernel] in message
    assert re.search(r"selftest\.cpp:\d+", message), message  # the line of the barrier or shuffle


def test_the_same_kernel_written_right_runs_and_sums():
    assert _core._simt_selftest("correct") == (0, "")


def test_an_unknown_self_test_is_refused():
    caught, message = _core._simt_selftest("nope")
    assert caught == -1 and "no self-test kernel named nope" in message


@pytest.mark.parametrize("bad", [dict(sm_count=0), dict(sm_count=1025), dict(threads=0), dict(threads=65),
                                 dict(order="sideways"), dict(seed=-1), dict(sm_count=True),
                                 dict(sm_count=2.0)])
def test_bad_settings_are_refused(bad):
    before = mf.simt_config()
    with pytest.raises(ValueError):
        mf.configure_simt(**bad)
    after = mf.simt_config()
    assert {k: v for k, v in after.items() if k != "counters"} == \
        {k: v for k, v in before.items() if k != "counters"}


def test_settings_round_trip_and_reset():
    try:
        mf.configure_simt(sm_count=3, order="random", seed=99, threads=4)
        c = mf.simt_config()
        assert (c["sm_count"], c["order"], c["seed"], c["threads"]) == (3, "random", 99, 4)
    finally:
        mf.configure_simt()
    c = mf.simt_config()
    assert (c["sm_count"], c["order"], c["seed"], c["threads"]) == (132, "in-order", 0, 1)


def test_counters_count_a_launch_and_its_blocks(simt, dev):
    rows, vocab = 5, 700
    logits = np.random.default_rng(1).standard_normal((rows, vocab)).astype(np.float32)
    buf, cells = dev.upload(logits), mf.DeviceBuffer(4 * rows)
    ids = np.zeros(rows, np.uint32)
    before = mf.simt_config()["counters"]
    with mf.Event() as done:
        mf.argmax_to_feed(buf, None, cells, ids, done, rows=rows, vocab=vocab, dtype="float32")
        done.synchronize()
    after = mf.simt_config()["counters"]
    assert np.array_equal(ids, logits.argmax(1))
    assert after["launches"] == before["launches"] + 1
    assert after["blocks"] == before["blocks"] + rows  # 700 ids are too few to split a row
    assert after["shuffles"] > before["shuffles"] and after["barriers"] > before["barriers"]
