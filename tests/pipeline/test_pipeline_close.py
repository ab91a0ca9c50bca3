"""Closing a pipeline after a step that was interrupted: a failed wait (an injected synchronize
failure), a Ctrl-C in a wait, or a KeyboardInterrupt raised right after a model's forward or a
drafter's proposal was queued. Leaving the ``with`` must let the original exception surface and
free every event, pinned and device byte the pipeline made, plain or speculative, with or without
logprobs and top logprobs, at depth 1 and 2 (before the fix, a speculative pipeline's close raised
``BufferError``: a pinned buffer still held by the interrupted step's copy, and the rest of its
buffers and events were left behind)."""

from __future__ import annotations

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline
from metrale_feed.errors import InjectedFault
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, prompts
from helpers.child import run_python
from helpers.leaks import assert_counts_back


class _Interrupted(ReferenceModel):
    """Raises KeyboardInterrupt once its ``at``-th forward (fed, by host ids or a verify) is
    queued: the step is interrupted part-way, its work still in the stream. Its polls always
    answer "not yet" (a busy device), so every wait of a step blocks in a synchronize, whose
    count ``fail_synchronize_at`` then reaches whatever the timing."""

    at = 0

    def event_query(self, event):
        return False

    def _interrupt_after(self, method, *args, **kw):
        logits = method(*args, **kw)
        self.forwards = getattr(self, "forwards", 0) + 1
        if self.forwards == self.at:
            raise KeyboardInterrupt
        return logits

    def decode_batch(self, *args, **kw):
        return self._interrupt_after(super().decode_batch, *args, **kw)

    def decode_batch_fed(self, *args, **kw):
        return self._interrupt_after(super().decode_batch_fed, *args, **kw)

    def decode_batch_verify(self, *args, **kw):
        return self._interrupt_after(super().decode_batch_verify, *args, **kw)


class _InterruptedDrafter(ReferenceDrafter):
    """Raises KeyboardInterrupt once its ``at``-th proposal (its copy to the device) is queued."""

    at = 0

    def propose(self, batch, out, stream):
        super().propose(batch, out, stream)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.at:
            raise KeyboardInterrupt


_LOGPROBS = {"none": {}, "logprobs": {"logprobs": True},
             "top": {"logprobs": True, "top_logprobs": 3}}


def _interrupted_close(how, at, speculative, depth, logprobs):
    """Runs a pipeline that ``how`` interrupts at its ``at``-th event, leaves the ``with``, and
    checks that the injected exception surfaced and that nothing the pipeline made is left
    (counted while the closed pipeline object is still referenced)."""
    before = mf.live_objects()
    model = _Interrupted(VOCAB, block_size=4, num_blocks=200, max_rows=4)
    drafter = _InterruptedDrafter(VOCAB, 2, 0.5) if speculative else None
    if how == "forward":
        model.at = at
    elif how == "propose":
        drafter.at = at
    expected = InjectedFault if how == "synchronize" else KeyboardInterrupt
    try:
        with pytest.raises(expected) as raised:
            with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
                for i, prompt in enumerate(prompts(3, seed=at)):
                    # one sampled request among greedy ones: both kinds of step run
                    pipe.submit(prompt, max_new_tokens=12, temperature=0.8 if i == 1 else 0.0,
                                seed=i, **_LOGPROBS[logprobs])
                if how == "synchronize":
                    mf.configure_host(fail_synchronize_at=at)
                pipe.run()
        mf.configure_host()
        assert not getattr(raised.value, "__notes__", None), raised.value.__notes__  # close was clean
        assert model.pool.free_count == model.pool.num_blocks
        assert pipe.idle
    finally:
        mf.configure_host()
        model.close()
    assert_counts_back(before, f"{how} {at}: left after close")


@pytest.mark.parametrize("logprobs", sorted(_LOGPROBS))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("how,speculative", [
    pytest.param(how, spec, id=f"{how}-{'speculative' if spec else 'plain'}")
    for how, spec in (("synchronize", False), ("forward", False), ("synchronize", True),
                      ("forward", True), ("propose", True))])
def test_close_after_an_interrupted_step_frees_everything_and_the_error_surfaces(
        host, no_leaks, how, speculative, depth, logprobs):
    for at in range(1, 5):
        _interrupted_close(how, at, speculative, depth, logprobs)


def test_ctrl_c_in_a_speculative_wait_then_close_frees_everything():
    """A real SIGINT (``interrupt_main``) sent from the stream while the host waits for a step,
    the host backend lagging so the wait is long: KeyboardInterrupt surfaces, and the close that
    follows frees everything, for each kind of speculative pipeline."""
    code = f"""
        import _thread, gc, itertools, signal, time
        import metrale_feed as mf
        from metrale_feed import DecodePipeline
        # A child of a background job inherits SIGINT ignored (POSIX shells do that without job
        # control), and Python then installs no handler: restore the default one.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from metrale_feed.testing.drafter import ReferenceDrafter
        from metrale_feed.testing.reference import ReferenceModel

        class Drafter(ReferenceDrafter):
            at, calls = 0, 0
            def propose(self, batch, out, stream):
                super().propose(batch, out, stream)
                self.calls += 1
                if self.calls == self.at:  # a signal once the stream gets here
                    mf.launch_host_func(stream, _thread.interrupt_main)

        for depth, lp, at in itertools.product((1, 2), (0, 1, 2), (1, 2, 3)):
            before = mf.live_objects()
            model = ReferenceModel({VOCAB}, block_size=4, num_blocks=200, max_rows=4)
            drafter = Drafter({VOCAB}, 2, 0.5)
            drafter.at = at
            try:
                with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
                    for i in range(3):
                        pipe.submit([1, 2, 3 + i], max_new_tokens=12, logprobs=lp > 0,
                                    top_logprobs=2 if lp == 2 else 0)
                    mf.configure_host(lag_us=2000)
                    pipe.run()
                raise SystemExit(f"no KeyboardInterrupt at depth {{depth}}, {{lp}}, {{at}}")
            except KeyboardInterrupt as exc:
                assert not getattr(exc, "__notes__", None), exc.__notes__
            mf.configure_host()
            model.close()
            deadline = time.monotonic() + 20  # frees deferred behind queued work come back
            while mf.live_objects() != before and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.005)
            assert mf.live_objects() == before, (depth, lp, at, before, mf.live_objects())
        print("ok")
    """
    result = run_python(code, timeout=240)
    assert result.stdout.strip().endswith("ok"), result.describe()
