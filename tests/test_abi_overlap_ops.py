"""Every op refuses every output placed over any other range it touches (an input it reads, or
another output), through the C ABI's one overlap rule, before anything is queued (ValueError), on
host and simt. Each op's device arguments are laid out apart in one arena; the matrix then moves
each output onto each other argument in turn. Before, verify_to_feed took cells over its device
params (the draws then depended on block order) and resolve_verified wrote its counts over its
ids or its cells."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

SENTINEL = 0xAB
R, K, V, N = 2, 2, 8, 3  # rows, drafts per row, vocabulary, top logprobs per row
PARAMS = mf.SAMPLING_PARAMS_DTYPE.itemsize
SLOTS, TABLE_CAP, ITEM_CAP = 4, 8, 4


def verify(p, **kw):
    mf.verify_to_feed(p["logits"], p["drafts"], p["cells"], None, None, k=K, rows=R, vocab=V,
                      dtype="float32", masks=p["masks"], bitmask=p["bitmask"], params=p["params"],
                      draft_probs=p["draft_probs"], advance=p["advance"], logprobs=p["logprobs"])


def resolve_verified(p):
    mf.resolve_verified(p["cells"], p["out_ids"], p["out_advance"], rows=R, k=K)


def verify_logit_params(p):
    _core._verify_logit_params(p["params"], p["advance"], p["out"], rows=R, k=K)


def sample(p):
    mf.sample_to_feed(p["logits"], p["params"], p["cells"], None, None, rows=R, vocab=V, dtype="float32",
                      masks=p["masks"], bitmask=p["bitmask"], logprobs=p["logprobs"])


def resolve_feed(p):
    mf.resolve_feed(p["sources"], p["cells"], p["out"], prev_rows=R, rows=R)


def top_logprobs(p):
    _core.top_logprobs(p["logits"], p["out"], n=N, rows=R, vocab=V, dtype="float32", ids=p["ids"],
                       chosen=p["chosen"])


def penalties(update):
    # Host slots (read before the call returns): device slots would take their rows from the
    # arena's bytes left.
    def call(p):
        sizes = dict(slot_count=SLOTS, table_cap=TABLE_CAP, item_cap=ITEM_CAP)
        if update:
            _core.penalties_update(p["ids"], [0, 1], p["state"], p["table"], p["items"], **sizes)
        else:
            _core.penalties_apply(p["logits"], [0, 1], p["state"], p["table"], p["items"], vocab=V,
                                  dtype="float32", **sizes)
    return call


def reference(p):
    _core.reference_forward(p["input_ids"], p["meta"], p["tables"], p["kv"], 16, 4, R, V, "float32",
                            p["logits"], advance=p["advance"])


LR = R * (K + 1)  # a verify's logit rows
# op -> its device arguments: name -> (bytes, written, what the C ABI's message calls it).
OPS = {
    "verify_to_feed": (verify, {
        "logits": (LR * V * 4, False, "logits"), "drafts": (R * K * 4, False, "drafts"),
        "masks": (LR * 8, False, "masks"), "bitmask": (LR * 4, False, "bitmask"),
        "params": (R * PARAMS, False, "device-resident sampling params"),
        "draft_probs": (R * K * V * 4, False, "draft_probs"), "advance": (R * 4, False, "advance"),
        "cells": (R * (K + 2) * 4, True, "feed cells"), "logprobs": (LR * 4, True, "logprobs")}),
    "resolve_verified": (resolve_verified, {
        "cells": (R * (K + 2) * 4, False, "verify cells"), "out_ids": (R * 4, True, "out_ids"),
        "out_advance": (R * 4, True, "out_advance")}),
    "verify_logit_params": (verify_logit_params, {
        "params": (R * PARAMS, False, "params"), "advance": (R * 4, False, "advance"),
        "out": (LR * PARAMS, True, "out")}),
    "sample_to_feed": (sample, {
        "logits": (R * V * 4, False, "logits"), "params": (R * PARAMS, False, "device-resident sampling params"),
        "masks": (R * 8, False, "device-resident masks"), "bitmask": (R * 4, False, "bitmask"),
        "cells": (R * 4, True, "feed cells"), "logprobs": (R * 4, True, "logprobs")}),
    "resolve_feed": (resolve_feed, {
        "sources": (R * 4, False, "device-resident sources"), "cells": (R * 4, False, "feed cells"),
        "out": (R * 4, True, "resolve output")}),
    "top_logprobs": (top_logprobs, {
        "logits": (R * V * 4, False, "logits"), "ids": (R * 4, False, "ids"), "out": (R * N * 8, True, "out"),
        "chosen": (R * 4, True, "chosen")}),
    "penalties_apply": (penalties(False), {
        "logits": (R * V * 4, True, "logits"), "state": (SLOTS * 32, False, "penalty state"),
        "table": (SLOTS * TABLE_CAP * 8, False, "penalty table"),
        "items": (SLOTS * ITEM_CAP * 8, False, "penalty items")}),
    "penalties_update": (penalties(True), {
        "ids": (R * 4, False, "ids"), "state": (SLOTS * 32, True, "penalty state"),
        "table": (SLOTS * TABLE_CAP * 8, True, "penalty table"),
        "items": (SLOTS * ITEM_CAP * 8, False, "penalty items")}),
    # tables last: the call takes its words from the bytes left after it.
    "reference_forward": (reference, {
        "input_ids": (R * 4, False, "input ids"), "meta": (R * 8, False, "row meta"),
        "advance": (4, False, "position advance"), "kv": (16 * 4, True, "kv cache"),
        "logits": (R * V * 4, True, "logits"), "tables": (16, False, "block tables")}),
}


def cases():
    for op, (_, args) in OPS.items():
        for out, (_, written, _) in args.items():
            if written:
                for other in args:
                    if other != out:
                        yield pytest.param(op, out, other, id=f"{op}:{out}-over-{other}")


class Arena:
    """One device allocation holding every argument of an op, filled with a sentinel. Arguments
    lie a stride of the largest apart, so an output moved onto one argument overlaps that one
    alone."""

    def __init__(self, args):
        stride = -(-max(n for n, _, _ in args.values()) // 64) * 64
        self.offsets = {name: i * stride for i, name in enumerate(args)}
        self.nbytes = (len(args) + 1) * stride
        self.buf = mf.DeviceBuffer(self.nbytes)
        mf.copy_h2d_async(self.buf, bytes([SENTINEL]) * self.nbytes)
        mf.stream_synchronize(0)

    def pointers(self):
        return {name: self.buf.ptr + at for name, at in self.offsets.items()}

    def untouched(self):
        mf.stream_synchronize(0)
        out = bytearray(self.nbytes)
        mf.copy_d2h_async(self.buf, out)
        mf.stream_synchronize(0)
        return bytes(out) == bytes([SENTINEL]) * self.nbytes


@pytest.fixture
def runtime(backend, no_leaks):
    # Every backend's checks are the C ABI's; each is run (host, simt, and cuda where usable).
    yield backend


@pytest.mark.parametrize("op,out,other", list(cases()))
def test_output_over_another_argument_is_refused(runtime, op, out, other):
    call, args = OPS[op]
    arena = Arena(args)
    try:
        p = arena.pointers()
        p[out] = p[other]
        with pytest.raises(ValueError, match="overlap") as refused:
            call(p)
        message = str(refused.value)
        assert args[out][2] in message and args[other][2] in message, message
        assert arena.untouched(), f"a refused {op} queued work"
    finally:
        mf.stream_synchronize(0)
        arena.buf.close()


@pytest.mark.parametrize("op", list(OPS))
def test_arguments_apart_are_taken(runtime, op):
    """The layout the matrix starts from is a valid call: each refusal above is the overlap's."""
    call, args = OPS[op]
    arena = Arena(args)
    try:
        call(arena.pointers())
        mf.stream_synchronize(0)
    finally:
        arena.buf.close()


def test_host_copies_over_their_source_are_refused(runtime):
    """On host and simt a CPU array is device memory the call borrows and host memory at once, so a
    host copy's ranges can overlap, as a device copy's can (cuda: managed memory)."""
    data = np.arange(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="copy destination and copy source overlap"):
        mf.copy_h2d_async(data, memoryview(data)[2:10])
    with pytest.raises(ValueError, match="copy destination and copy source overlap"):
        mf.copy_d2h_async(data, memoryview(data)[2:])
    mf.stream_synchronize(0)
    assert data.tolist() == list(range(16)), "a refused copy was queued"
    apart = np.zeros(8, np.uint8)
    mf.copy_d2h_async(data, memoryview(apart))  # ranges apart are copied
    mf.stream_synchronize(0)
    assert apart.tolist() == list(range(8))
