"""A device fault that first surfaces in a later launch. On cuda a kernel's fault (an illegal
address, a trap) is reported by whichever runtime call comes next, often the next step's launch,
which raises ``DeviceError`` before it queued anything. That is a fault of the work in flight,
not a refusal to retry: the running requests fail, nothing of the steps in flight is committed,
and no later step runs on as if nothing happened. Here the model's forward raises the
``DeviceError`` itself, as the cuda runtime would."""

from __future__ import annotations

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline
from metrale_feed.sched.speculative import NGramDrafter
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, check_failed, check_the_rest_run, prompts

REASON = ["DeviceError", "cudaErrorIllegalAddress"]


class LateFault(ReferenceModel):
    """The reference model whose ``fault_at``-th fed forward raises ``DeviceError`` before it
    queues anything (a launch that reports an earlier kernel's fault)."""

    def __init__(self, *args, fault_at=0, **kw):
        super().__init__(*args, **kw)
        self.fault_at = fault_at
        self.forwards = 0

    def _launch(self):
        self.forwards += 1
        if self.forwards == self.fault_at:
            raise mf.DeviceError("launch: cudaErrorIllegalAddress (an earlier kernel's fault)")

    def decode_batch_fed(self, sources, seqs, stream):
        self._launch()
        return super().decode_batch_fed(sources, seqs, stream)

    def decode_batch(self, tokens, seqs, stream):
        self._launch()
        return super().decode_batch(tokens, seqs, stream)

    def decode_batch_verify(self, fed, seqs, k, stream, **kw):
        self._launch()
        return super().decode_batch_verify(fed, seqs, k, stream, **kw)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fault_at", [2, 4])
def test_a_fault_surfacing_at_a_launch_fails_the_running_requests(host, no_leaks, greedy, depth,
                                                                  fault_at):
    ps = prompts(5, seed=fault_at)
    with LateFault(VOCAB, block_size=4, num_blocks=120, max_rows=3, fault_at=fault_at) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=8) for p in ps]
            running = reqs[:3]
            with pytest.raises(mf.DeviceError, match="cudaErrorIllegalAddress"):
                for _ in range(100):
                    pipe.step()
            failed = check_failed(reqs, running, REASON)
            assert pipe.step() == failed  # reported by the next step
            check_the_rest_run(pipe, reqs, running)
        assert model.pool.free_count == model.pool.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_a_fault_surfacing_at_a_speculative_launch_fails_the_running_requests(host, no_leaks,
                                                                              greedy, depth):
    ps = prompts(4, seed=3)
    with LateFault(VOCAB, block_size=4, num_blocks=160, max_rows=3, fault_at=3) as model:
        with DecodePipeline(model, 3, depth=depth, speculative=NGramDrafter(2)) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=12) for p in ps]
            running = reqs[:3]
            with pytest.raises(mf.DeviceError, match="cudaErrorIllegalAddress"):
                for _ in range(100):
                    pipe.step()
            check_failed(reqs, running, REASON)
            check_the_rest_run(pipe, reqs, running)
        assert model.pool.free_count == model.pool.num_blocks
