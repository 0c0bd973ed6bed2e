"""A device move in forward (TransformerLens's `residual.to(cfg.device)`) reads no value: planned
on meta it stays on meta, and the model is split and exact; a value read after such a move
still fails on meta, saying so."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from gathered import gathered_grads
from multirank import run_on_ranks


class ResidualMovedToItsDevice(nn.Module):
    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.device = device

    def forward(self, x):
        hidden = torch.relu(self.up(x)).to(self.device)
        return x + self.down(hidden).to(self.device, torch.float64)


class ValuesReadAfterTheMove(ResidualMovedToItsDevice):
    def forward(self, x):
        hidden = torch.relu(self.up(x)).to(self.device)
        return self.down(hidden) * float(hidden.sum().item() > 0)


def test_a_device_move_is_planned_as_the_copy_it_is():
    plan = autoshard.plan(ResidualMovedToItsDevice().double(), world_size=2, example_inputs=(torch.randn(2, 8),))
    assert [(layer.module, layer.style.value) for layer in plan.layers] == [("up", "column"), ("down", "row")]


def test_values_read_after_a_device_move_still_fail_on_meta():
    with pytest.raises(RuntimeError, match="reads the values of a tensor.*depend on more than the example inputs"):
        autoshard.plan(ValuesReadAfterTheMove(), world_size=2, example_inputs=(torch.randn(2, 8),))


def _moved_model_trains_exactly():
    torch.manual_seed(0)
    model = ResidualMovedToItsDevice().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, example_inputs=(x,))
    got, want = model(x), reference(x)
    weights = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    grads = gathered_grads(model)
    worst = max(float((grads[name] - p.grad).abs().max()) for name, p in reference.named_parameters())
    split = [name for name, module in model.named_modules() if hasattr(module, "shard_specs")]
    return float((got - want).abs().max()), worst, split, dist.get_world_size()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_moving_its_residual_is_split_and_exact(world_size):
    for output, gradient, split, world in run_on_ranks(_moved_model_trains_exactly, world_size):
        assert world == world_size and split == ["up", "down"]
        assert output < 1e-12 and gradient < 1e-12, (output, gradient)
