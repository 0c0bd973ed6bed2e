"""Tokens that sequence parallelism gathers where a module returns them (a causal LM's final
norm, for its head) also leave the model: a backbone's ``last_hidden_state`` read by a classifier,
a fused LM head or a loss of the user's. Their gradient there is replicated, not a column layer's
partial sum, and must be counted once. At 2 and 3 ranks (float64), with sequence parallelism on:
every parameter's gradient from a loss on the backbone's output, and from the model's own loss
and that loss together, equals the unsharded model's."""

import pytest
import torch

import autoshard
from gathered import gathered_grads
from hf_models import build
from multirank import run_on_ranks


def _worst_gradient(reader: str) -> dict:
    reference, model = build("llama", seed=0).double(), build("llama", seed=0).double()
    autoshard.parallelize(model)
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    for m in (reference, model):
        hidden = m.model(ids).last_hidden_state
        loss = hidden.pow(2).mean()
        if reader == "both":  # the plan's head and an outside reader of the same tokens
            output = m(input_ids=ids, labels=ids, output_hidden_states=True)
            loss = output.loss + output.hidden_states[-1].pow(2).mean()
        loss.backward()
    grads = gathered_grads(model)
    worst = max(float((grads[name] - p.grad).abs().max() / p.grad.abs().max())
                for name, p in reference.named_parameters() if p.grad is not None)
    return {"worst": worst, "sequence_parallel": any(layer.sequence for layer in model.autoshard_state.plan.layers),
            "exits": [entry.module for entry in model.autoshard_state.plan.sequence_exits]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reader", ["backbone", "both"])
def test_a_gradient_reaching_gathered_tokens_from_outside_the_plan_counts_once(reader, world_size):
    for rank, result in enumerate(run_on_ranks(_worst_gradient, world_size, reader, timeout=600)):
        assert result["sequence_parallel"] and result["exits"] == ["model.norm"], result
        # The model's own loss is computed in float32 (as transformers does) over the shards and
        # over whole logits: rounding apart. Counting the outside reader N times is a factor of N.
        tolerance = 1e-12 if reader == "backbone" else 1e-5
        assert result["worst"] < tolerance, f"rank {rank}: a gradient {result['worst']:.2e} from the unsharded model's"
