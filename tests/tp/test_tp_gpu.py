"""The cuda backend's exchange: NCCL through torch.distributed on the caller's stream, run as a
world of one rank on one GPU through the real partial, exchange and combine path (the shard's
private switch), eagerly and captured in a graph replayed on new logits. Each rank is a child
process (tests/tp/rank_main.py checks its results against the unsharded call and the numpy
oracle). Skipped without a GPU (tools/gpu_check.sh runs them where one is lent)."""

import os
import sys

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("ml_dtypes")

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for helpers
from helpers.child import run_ranks  # noqa: E402

RANK_MAIN = os.path.join(os.path.dirname(__file__), "rank_main.py")


def nccl_ready():
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_nccl_available()


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["exact", "graph", "pipeline", "top", "top-graph", "fixed", "fixed-graph"])
def test_nccl_world_of_one_through_the_exchange_equals_the_unsharded_call(scenario):
    if not nccl_ready():
        pytest.fail("a GPU is here but this torch has no CUDA or no NCCL: install a CUDA torch")
    results = run_ranks(RANK_MAIN, 1, f"{scenario}+exchange+nccl", timeout=300, backend="cuda")
    for rank, result in enumerate(results):
        assert result.returncode == 0 and f"OK {scenario}+exchange+nccl" in result.stdout, \
            f"rank {rank}: {result.describe()}"
