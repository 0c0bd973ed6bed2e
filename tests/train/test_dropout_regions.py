"""Dropout inside a sharded region at an uneven split (10 heads over 3 ranks: 4, 3, 3) draws a
different number of values on each rank; a later dropout on activations every rank holds whole
must still draw the same mask on every rank, or the replicated computation differs between
ranks and the replicated parameters drift. Regions get generator states of their own
(autoshard/core/region_generators.py); these tests check that the ranks' generators stay together,
that a rank's masks inside a region are its own, and that activation checkpointing recomputes
the same masks."""

import pytest
import torch

import dropout_regions
from multirank import run_on_ranks


def _assert_same_on_every_rank(per_rank, what):
    for rank, values in enumerate(per_rank[1:], start=1):
        assert len(values) == len(per_rank[0])
        for step, (mine, reference) in enumerate(zip(values, per_rank[0])):
            assert torch.equal(mine, reference), f"forward {step}: rank {rank}'s {what} differs from rank 0's"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dropout_after_an_uneven_sharded_region_draws_the_same_mask_on_every_rank(world_size):
    _assert_same_on_every_rank(run_on_ranks(dropout_regions.replicated_outputs, world_size, timeout=300),
                               "replicated output")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_region_draws_rank_masks_and_leaves_the_synchronised_generator_as_the_region_found_it(device):
    results = run_on_ranks(getattr(dropout_regions, f"region_mechanics_{device}"), 2, timeout=300)
    for rank, (checks, _) in enumerate(results):
        assert [name for name, held in checks.items() if not held] == [], f"rank {rank}"
    assert not torch.equal(results[0][1], results[1][1]), "the ranks drew the same mask inside the region"


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("start_inside", [False, True], ids=["whole-block", "from-inside-the-region"])
def test_activation_checkpointing_recomputes_the_masks_inside_and_after_a_region(use_reentrant, start_inside):
    plain = run_on_ranks(dropout_regions.checkpointed_training, 3, False, use_reentrant, start_inside, timeout=300)
    recomputed = run_on_ranks(dropout_regions.checkpointed_training, 3, True, use_reentrant, start_inside,
                              timeout=300)
    for rank, ((outputs, gradients, states), (outputs_again, gradients_again, states_again)) in enumerate(
            zip(plain, recomputed)):
        assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_again)), f"rank {rank}: outputs"
        for step, (expected, got) in enumerate(zip(gradients, gradients_again)):
            differ = [name for name in expected if not torch.equal(expected[name], got[name])]
            assert differ == [], f"rank {rank}, step {step}: gradients of {differ} differ from the run without " \
                                 "checkpointing"
        assert all(torch.equal(a, b) for a, b in zip(states, states_again)), f"rank {rank}: generator states"
    _assert_same_on_every_rank([outputs for outputs, _, _ in recomputed], "replicated output")
    _assert_same_on_every_rank([states for _, _, states in recomputed], "generator state")


def test_a_region_left_open_by_a_vocabulary_parallel_head_ends_before_the_next_forward():
    results = run_on_ranks(dropout_regions.gpt2_after_an_open_head_region, 3, timeout=600)
    loss_parallel, _ = results[0][2]
    assert loss_parallel, "the head must keep its vocabulary shard for the loss (a region never closed)"
    _assert_same_on_every_rank([recorded for recorded, _, _ in results], "embedding dropout output")
    _assert_same_on_every_rank([states for _, states, _ in results], "generator state")


def test_generators_stay_synchronised_with_sequence_parallelism_at_uneven_token_counts():
    results = run_on_ranks(dropout_regions.llama_with_sequence_parallelism, 3, timeout=600)
    _, sequence_parallel = results[0][2]
    assert sequence_parallel, "the plan must split the tokens"
    _assert_same_on_every_rank([states for _, states, _ in results], "generator state")
    # Each rank holds its own tokens there: 3, 2 and 2 of 7.
    assert [recorded[0].shape[1] for recorded, _, _ in results] == [3, 2, 2]
