"""Dropout inside a sharded region at an uneven split (10 heads over 3 ranks: 4, 3, 3) draws a
different number of values on each rank; a later dropout on activations every rank holds whole
must still draw the same mask on every rank, or the replicated computation differs between
ranks and the replicated parameters drift. At 2 ranks (5, 5 heads) the generators advance
alike and the masks agree."""

import pytest
import torch

from dropout_regions import replicated_outputs
from multirank import run_on_ranks


UNEVEN = pytest.mark.xfail(strict=True, reason=(
    "not fixed yet: each rank's generator advances by its own shard's size inside the region (4, 3, 3 heads), "
    "and nothing re-synchronises the generators at the row layer's finish; the fix must cover every row-style "
    "module (nn/linear.py, nn/einsum.py, nn/embedding.py and the constructs' sharded modules), nested and "
    "recomputed regions (activation checkpointing restores the generator itself) and the CUDA generators"))


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=UNEVEN)])
def test_dropout_after_an_uneven_sharded_region_draws_the_same_mask_on_every_rank(world_size):
    results = run_on_ranks(replicated_outputs, world_size, timeout=300)
    for rank, outputs in enumerate(results[1:], start=1):
        for step, (mine, reference) in enumerate(zip(outputs, results[0])):
            assert torch.equal(mine, reference), f"forward {step}: rank {rank}'s replicated output differs from rank 0's"
