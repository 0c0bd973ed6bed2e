"""plan() on a model that has already run forward, backward and an optimizer step gives the
plan it gives the same model fresh: gradients and tensors an autograd graph computed (the
weight torch.nn.utils.weight_norm recomputes in each forward) are not copied into the meta
model the plan runs. parallelize refuses a model still holding gradients, naming zero_grad,
before it changes anything; once they are cleared, tests/conformance's own_idiom_trained
checks the trained model exact at 2 and 3 ranks."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from hf_models import build
from multirank import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
from idiom_models import idiom_model, trained  # noqa: E402

IDS = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(5))


class WeightNormed(nn.Module):
    """A positional convolution under torch.nn.utils.weight_norm (its `weight` a computed
    tensor, which torch cannot deepcopy), then an MLP."""

    def __init__(self):
        super().__init__()
        self.position = torch.nn.utils.weight_norm(nn.Conv1d(16, 16, 3, padding=1))
        self.up, self.down = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x):
        x = x + self.position(x.transpose(1, 2)).transpose(1, 2)
        return self.down(torch.relu(self.up(x)))


def _models():
    features = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(6))
    yield "llama", lambda: build("llama"), {"input_ids": IDS}
    yield "own_decoder", lambda: idiom_model("optional_layers"), {"input_ids": IDS}
    yield "weight_norm", WeightNormed, {"x": features}


@pytest.mark.parametrize("name,make,inputs", list(_models()), ids=[m[0] for m in _models()])
@pytest.mark.parametrize("world_size", [2, 3])
def test_plan_is_the_same_after_training(name, make, inputs, world_size):
    torch.manual_seed(0)
    fresh = autoshard.plan(make(), world_size=world_size, example_inputs=inputs)
    torch.manual_seed(0)
    model = trained(make(), clear=False, **inputs)
    assert any(p.grad is not None for p in model.parameters())
    after = autoshard.plan(model, world_size=world_size, example_inputs=inputs)
    assert after.to_json() == fresh.to_json()
    assert any(layer.style != "replicate" for layer in after.layers)
    # The model itself is untouched: its gradients are still there.
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _parallelize_with_gradients():
    torch.manual_seed(0)
    model = trained(idiom_model("optional_layers"), clear=False, input_ids=IDS)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    try:
        autoshard.parallelize(model, example_inputs={"input_ids": IDS})
        error = "no error"
    except ValueError as refusal:
        error = str(refusal)
    unchanged = all(torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1])
                    for n, p in model.named_parameters())
    return error, unchanged, dist.get_rank()


def test_parallelize_refuses_pending_gradients():
    for error, unchanged, rank in run_on_ranks(_parallelize_with_gradients, 2, timeout=300):
        assert "parameters hold gradients from an earlier backward" in error, (rank, error)
        assert "zero_grad()" in error and "'embed.weight'" in error, (rank, error)
        assert unchanged, rank
