"""A typed tour of metrale_feed's public API on the active backend.

``mypy --strict examples/typed_usage.py`` passes (tests/test_typing.py checks it), and
``python examples/typed_usage.py`` runs it and checks its own results.
"""

from __future__ import annotations

import importlib.util
from array import array
from typing import List, Sequence

import metrale_feed as mf
from metrale_feed.feed import FeedSource, RowMask
from metrale_feed.kv import SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_next_token
from metrale_feed.sched.router import AsyncDeviceIo, Ticket


def roundtrip(payload: bytes, stream: mf.Stream) -> bytes:
    """Host to device to host; the event, not a stream sync, says when the bytes are back."""
    n = len(payload)
    with mf.PinnedBuffer(n) as staging, mf.DeviceBuffer(n) as device, mf.Event() as done:
        with memoryview(staging) as view:  # a view must be released before the buffer closes
            view[:] = payload
        mf.copy_h2d_async(device, staging, stream)
        back = bytearray(n)
        mf.copy_d2h_async(device, back, stream)
        done.record(stream)
        done.synchronize()
        return bytes(back)


def masked_argmax(rows: Sequence[Sequence[float]], masks: Sequence[RowMask],
                  stream: mf.Stream) -> List[int]:
    """Each row's argmax over float32 logits, skipping its mask ids, read back from pinned memory."""
    flat = array("f", [x for row in rows for x in row])
    with mf.DeviceBuffer(len(flat) * 4) as logits, mf.DeviceBuffer(len(rows) * 4) as cells, \
            mf.PinnedBuffer(len(rows) * 4) as ids, mf.Event() as ready:
        mf.copy_h2d_async(logits, flat, stream)
        mf.argmax_to_feed(logits, masks, cells, ids, ready, stream, vocab=len(rows[0]),
                          dtype="float32")
        ready.synchronize()  # dst is valid once the event has completed
        with memoryview(ids) as raw, raw.cast("I") as words:
            return words.tolist()


def generate(prompt: Sequence[int], new_tokens: int, vocab: int) -> List[int]:
    """Greedy decoding two steps deep: step k+1 is launched, fed on the device from step k's feed
    cell, before step k's id has been read on the host."""
    model = ReferenceModel(vocab, block_size=4, num_blocks=64, max_rows=1)
    io = AsyncDeviceIo(model, max_rows=1)
    seq = SequenceState(0)
    mask = [RowMask()]
    out: List[int] = []
    try:
        model.prefill(seq, prompt[:-1])
        pending: List[Ticket] = [io.launch_decode([prompt[-1]], [seq], mask)]
        while pending:
            if len(out) + len(pending) < new_tokens:
                io.reserve_kv(seq)
                pending.append(io.launch_fed([FeedSource.feed(0)], [seq], mask))
            token = io.await_result(pending.pop(0))[0]
            out.append(token)
            if pending:  # the step ahead has written this id into the KV cache: commit it
                seq.tokens.append(token)
                seq.seq_len += 1
    finally:
        io.teardown()
        model.release_sequence(seq)
        model.close()
    return out


def main() -> int:
    with mf.nvtx_range("typed_usage"), mf.Stream() as stream:
        payload = bytes(range(256)) * 4
        assert roundtrip(payload, stream) == payload
        ids = masked_argmax([[0.1, 0.9, 0.3, 0.9], [0.5, 0.2, 0.8, 0.1]],
                            [RowMask(), RowMask(2)], stream)
        assert ids == [1, 0], ids  # ties go to the lowest id; row 1 may not answer 2
    prompt, vocab = [3, 1, 4, 1, 5], 97
    tokens = generate(prompt, 8, vocab)
    if importlib.util.find_spec("numpy") is not None:  # the host oracle uses numpy
        history = list(prompt)
        for token in tokens:
            assert token == host_next_token(history, vocab), (history, tokens)
            history.append(token)
    print(f"backend {mf.backend()}: argmax {ids}, generated {tokens}")
    live = mf.live_objects()
    print(f"live objects: {live}")
    return 0 if not any(live.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
