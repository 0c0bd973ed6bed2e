"""A gradient that is not finite on one tensor-parallel rank only: every rank takes the same
decision before any rank steps, so the replicated parameters stay bitwise equal.

- nan in a replicated gradient during backward, on rank 1 only: autoshard's optimizers raise on
  every rank, naming the parameter, and step nothing; after zero_grad() training goes on alike.
- nan on rank 1 only after backward, then clip_grad_norm_: the norm is nan on every rank, every
  rank scales by it and steps alike (torch's behaviour for a nan norm).
"""

import pytest
import torch

from multirank import run_on_ranks
from nonfinite_steps import nan_on_one_rank


def _same_bits(results):
    reference = results[0][1]
    assert reference, "no replicated parameter"
    for rank, (_, bits) in enumerate(results[1:], start=1):
        for name, value in reference.items():
            assert torch.equal(bits[name], value), f"{name} differs between rank 0 and rank {rank}"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_nan_in_a_replicated_gradient_on_one_rank_is_refused_on_every_rank(world_size, optimizer):
    results = run_on_ranks(nan_on_one_rank, world_size, optimizer, "backward", timeout=300)
    _same_bits(results)  # before: rank 1 stepped its copy into nan alone
    for rank, (outcomes, _) in enumerate(results):
        assert outcomes[0] == "no error" and outcomes[2] == "no error", (rank, outcomes)
        text = outcomes[1]
        assert "the gradient of the replicated parameter 'model.norm.weight' is not finite on some" in text, text
        assert "between 0 and 1 non-finite elements" in text and "Nothing was stepped, on any rank" in text, text


def test_nan_after_backward_then_clip_steps_every_rank_alike():
    results = run_on_ranks(nan_on_one_rank, 2, "adamw", "clip", timeout=300)
    for outcomes, bits in results:
        assert outcomes == ["no error"] * 3, outcomes
        assert torch.isnan(bits["model.norm.weight"].view(torch.float32)).all()
    _same_bits(results)
