"""The sharded feed calls over 1 to 4 ranks, each a separate process in one gloo group on
127.0.0.1 (tests/tp/rank_main.py holds what every rank runs and checks; docs/tensor-parallel.md)."""

import os
import sys

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("ml_dtypes")

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for helpers
from helpers.child import run_ranks  # noqa: E402

RANK_MAIN = os.path.join(os.path.dirname(__file__), "rank_main.py")


def ranks(world, scenario, timeout=240):
    results = run_ranks(RANK_MAIN, world, scenario, timeout=timeout)
    for rank, result in enumerate(results):
        assert result.returncode == 0 and f"OK {scenario}" in result.stdout, \
            f"rank {rank} of {world}: {result.describe()}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_calls_equal_the_unsharded_call_and_the_oracle(world):
    ranks(world, "exact")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_filters_draw_the_unsharded_ids_within_the_oracle_survivors(world):
    ranks(world, "filters", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_filters_take_few_collectives_at_the_unsharded_ids(world):
    ranks(world, "collectives")


@pytest.mark.parametrize("world, scenario", [(1, "bytes"), (1, "bytes+exchange"), (2, "bytes"),
                                             (3, "bytes")])
def test_every_call_sends_the_documented_bytes_within_max_call_bytes(world, scenario):
    # Filter mixes, adaptive and fixed rounds, logprobs or not, fewer rows than max_rows.
    ranks(world, scenario, timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_filters_are_a_feed_error_on_every_rank(world):
    ranks(world, "params-mismatch")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fixed_filter_rounds_give_the_unsharded_ids_in_one_shape_of_exchanges(world):
    ranks(world, "fixed", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_fixed_filter_rounds_with_mismatched_params_fault_every_rank_after_every_exchange(world):
    ranks(world, "fixed-mismatch")


@pytest.mark.parametrize("world", [2, 3])
def test_a_captured_filtered_sample_replays_with_new_device_params_in_fixed_rounds(world):
    ranks(world, "fixed-graph")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_pipeline_spmd_gives_the_unsharded_tokens_on_every_rank(world):
    ranks(world, "pipeline")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_top_logprobs_equal_the_unsharded_call_and_the_oracle(world):
    ranks(world, "top", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_a_captured_sharded_top_logprobs_replays_the_unsharded_records(world):
    ranks(world, "top-graph")


@pytest.mark.parametrize("world", [2, 3])
def test_the_pipeline_with_penalties_and_logprobs_over_the_split(world):
    ranks(world, "pipeline-penalties", timeout=400)


@pytest.mark.parametrize("scenario", ["exact+exchange", "top+exchange", "top-graph+exchange",
                                      "pipeline-penalties+exchange", "verify+exchange", "verify-sampled+exchange",
                                      "pipeline-spec+exchange", "pipeline+exchange", "graph+exchange",
                                      "graph-sample+exchange", "fixed+exchange", "fixed-graph+exchange",
                                      "pipeline-spec-nccl+exchange"])
def test_a_world_of_one_through_the_exchange_equals_the_unsharded_call(scenario):
    # The path of every world (partial, gloo all-gather, combine), on one rank.
    ranks(1, scenario)


@pytest.mark.parametrize("world, scenario", [(1, "threads"), (1, "threads+exchange"), (2, "threads"),
                                             (3, "threads")])
def test_a_shard_takes_calls_from_the_thread_that_made_it_alone(world, scenario):
    # Two threads a rank: the other thread's calls are refused, never paired with the peers'.
    ranks(world, scenario)


@pytest.mark.parametrize("world", [2, 3])
def test_a_captured_sharded_call_replays_on_new_logits_on_every_rank(world):
    ranks(world, "graph")


@pytest.mark.parametrize("world", [2, 3])
def test_a_captured_sharded_sample_replays_with_new_device_params_on_every_rank(world):
    ranks(world, "graph-sample")


@pytest.mark.parametrize("world", [2, 3])
def test_an_empty_slice_given_as_a_rows_by_zero_tensor_takes_its_dtype_from_it(world):
    ranks(world, "empty-tensor")


def test_a_late_peer_leaves_the_others_pending_then_right():
    ranks(2, "late")


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_rows_are_a_feed_error_on_every_rank(world):
    ranks(world, "rows-mismatch")


@pytest.mark.parametrize("world", [2, 3])
def test_logprobs_asked_on_some_ranks_only_is_a_feed_error_on_every_rank(world):
    ranks(world, "logprobs-mismatch")


@pytest.mark.parametrize("world", [2, 3])
def test_calls_reuse_completed_buffers_and_pending_ones_keep_theirs(world):
    ranks(world, "ring")


def test_ranks_that_disagree_on_the_shard_get_feed_error():
    ranks(3, "vocab-mismatch")


def test_bad_offsets_are_refused_before_any_collective():
    ranks(2, "bad-offsets")


def test_a_dead_peer_is_a_feed_error_not_a_hang():
    ranks(2, "dead")


def test_a_hung_peer_faults_a_filtered_call_within_one_timeout():
    ranks(2, "hung-filtered")


def test_bench_tp_checks_ids_and_counts_bytes(tmp_path):
    from helpers.child import run_python

    out = tmp_path / "tp.json"
    run_python(argv=["-m", "metrale_feed.tools.cli", "bench", "--tp", "2", "--quick", "--json", str(out)],
               timeout=300)
    import json

    tp = json.loads(out.read_text())["tp"]
    sizes = tp["sizes"]
    assert [e["rows"] for e in sizes] == [16, 64]  # --quick's sizes
    # simt ranks run the kernels on the CPU: a smaller vocabulary, the same checks.
    assert {e["vocab"] for e in sizes} == {16384 if tp["backend"] == "simt" else 152064}
    for e in sizes:
        assert e["checked"], e
        assert e["sharded_bytes_per_step"] == 16 * (e["rows"] + 2)
        # The shard's own count: its agreement at construction (5 int64), then one block for each
        # of --quick's 3 timed calls.
        assert e["shard_stats"] == {"collectives": 1 + 3,
                                    "bytes_sent": 40 + 3 * e["sharded_bytes_per_step"]}, e
        # A greedy verify over the same logit rows: the rule's cells, in the argmax's one exchange.
        assert e["verify_checked"], e
        assert e["verify_collectives_per_call"] == 1, e
        assert e["verify_bytes_per_call"] == 16 * (e["rows"] + 2), e
        assert e["verify_ms"] > 0 and e["verify_argmax_ms"] > 0, e
        # A sampled verify: the unsharded cells, in a sampled call's two exchanges (TOP, RACE).
        assert e["verify_sampled_checked"], e
        assert e["verify_sampled_collectives_per_call"] == 2, e
        assert e["verify_sampled_bytes_per_call"] == 2 * 16 * (e["rows"] + 2), e
        # Top logprobs (n 20): numpy's ids, one all-gather of the header, then 16 + 8 n bytes a row.
        assert e["top_checked"], e
        assert e["top_collectives_per_call"] == 1, e
        assert e["top_bytes_per_call"] == 32 + e["rows"] * (16 + 8 * e["top_n"]), e
        assert e["top_sharded_ms"] > 0 and e["top_gather_ms"] > 0, e
        # Sampling with top_k 50 and top_p: the unsharded ids (gathered and on one rank), in 3
        # exchanges: the first and last blocks and the candidate lists (50 of 8 bytes a row).
        assert e["filtered_checked"], e
        assert e["filtered_collectives_per_call"] == 3, e
        assert e["filtered_bytes_per_call"] == 2 * 16 * (e["rows"] + 2) + 32 + 400 * e["rows"], e
        assert e["gloo_collective_us"] > 0 and e["filtered_gather_ms"] > 0, e
        # top_p alone: a radix select, its 4 rounds of 2048-byte histograms a row between the first
        # and last blocks, each decided on the stream; the unsharded ids.
        assert e["radix_checked"], e
        assert e["radix_collectives_per_call"] == 6, e
        assert e["radix_bytes_per_call"] == 2 * 16 * (e["rows"] + 2) + 4 * (32 + 2048 * e["rows"]), e
        # Fixed rounds (top_k 64, top_p): 7 exchanges, each sized by max_rows (the rows here), the
        # candidate lists 64 entries a row whatever the call's top_k.
        assert e["fixed_checked"], e
        assert e["fixed_collectives_per_call"] == 7, e
        assert e["fixed_bytes_per_call"] == 2 * 16 * (e["rows"] + 2) + 32 + 512 * e["rows"] + 4 * (32 + 2048 * e["rows"]), e


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.7"],
                                   ["--temperature", "1", "--top-k", "3", "--top-p", "0.9", "--min-p", "0.05"]])
def test_demo_tp_tokens_equal_the_single_rank_run(extra):
    from helpers.child import run_python

    done = run_python(argv=["-m", "metrale_feed.tools.cli", "demo", "--tp", "2", "--rows", "6",
                            "--tokens", "12", "--vocab", "5000", "--quiet", *extra], timeout=300)
    assert "tokens equal the single-rank run on all 2 ranks: yes" in done.stdout, done.describe()


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_greedy_verify_equals_the_unsharded_call_and_the_oracle(world):
    ranks(world, "verify", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_sampled_verify_equals_the_unsharded_call(world):
    ranks(world, "verify-sampled", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_a_captured_sharded_verify_replays_on_new_logits_and_drafts_on_every_rank(world):
    ranks(world, "verify-graph")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_speculative_pipeline_spmd_gives_the_unsharded_greedy_and_sampled_tokens_on_every_rank(world):
    ranks(world, "pipeline-spec", timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_the_speculative_pipeline_spmd_applies_each_ranks_penalties_walking_the_drafts(world):
    ranks(world, "pipeline-spec-penalties", timeout=400)


@pytest.mark.parametrize("world, scenario", [(1, "pipeline-grammar+exchange"), (2, "pipeline-grammar"),
                                             (3, "pipeline-grammar")])
def test_the_pipeline_spmd_follows_the_automata_on_every_rank(world, scenario):
    # Constrained and free rows, plain and speculative, depth 1 and 2: the unsharded oracle's tokens.
    ranks(world, scenario, timeout=400)


@pytest.mark.parametrize("scenario", ["verify-refused", "verify-mismatch"])
def test_a_sharded_verify_refuses_what_it_does_not_take_and_faults_on_mismatched_calls(scenario):
    ranks(2, scenario)



def test_a_sharded_pipeline_refuses_sampled_requests_that_nccl_could_not_verify():
    ranks(1, "pipeline-spec-nccl")
