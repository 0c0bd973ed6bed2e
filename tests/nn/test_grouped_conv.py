"""Grouped and depthwise convolutions split over their groups (autoshard.constructs.grouped_conv):
a column layer's output split by whole groups passes through them with no collective (style
batch). On 2 and 3 gloo ranks, in float64, equal to the unsharded model in outputs, every
gradient, the collectives the plan predicts and one SGD step; AdamW with clipping, and a
checkpoint saved on 3 ranks reloaded on 2."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import checkpoint
from gathered import parallelized_and_stepped
from multirank import run_on_ranks


class CausalMixer(nn.Module):
    """Mamba's idiom: in_proj, a depthwise causal Conv1d over the tokens (padded on both sides,
    then sliced to the sequence length), SiLU, a gate, out_proj. 10 channels over 3 ranks are
    4, 3, 3 whole groups."""

    def __init__(self, hidden=6, channels=10, kernel=4):
        super().__init__()
        self.in_proj = nn.Linear(hidden, 2 * channels)
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
        self.out_proj = nn.Linear(channels, hidden, bias=False)

    def forward(self, h):
        length = h.shape[1]
        x, gate = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)
        x = F.silu(self.conv1d(x)[..., :length])
        return self.out_proj((x * F.silu(gate)).transpose(1, 2))


class DepthwiseBlock2d(nn.Module):
    """MobileNet's inverted residual without its norms: a 1x1 expansion, a depthwise 3x3 with
    reflect padding, a 1x1 projection."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(4, 12, 1)
        self.depthwise = nn.Conv2d(12, 12, 3, padding=1, groups=12, padding_mode="reflect")
        self.project = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        return x + self.project(F.relu6(self.depthwise(F.relu6(self.expand(x)))))


class FourGroups(nn.Module):
    """A grouped convolution of 4 groups (16 -> 8 channels, 4 in and 2 out per group): over 3
    ranks its groups split 2, 1, 1, and the channels around it with them."""

    def __init__(self):
        super().__init__()
        self.up = nn.Conv1d(6, 16, 1)
        self.grouped = nn.Conv1d(16, 8, 3, padding=1, groups=4)
        self.down = nn.Conv1d(8, 6, 1)

    def forward(self, x):
        return self.down(F.gelu(self.grouped(self.up(x))))


MODELS = {
    "causal_mixer": (CausalMixer, (2, 7, 6), ("in_proj", "conv1d", "out_proj")),
    "depthwise_2d": (DepthwiseBlock2d, (2, 4, 5, 6), ("expand", "depthwise", "project")),
    "four_groups": (FourGroups, (2, 6, 9), ("up", "grouped", "down")),
}


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]().double()


def _inputs(name: str, seed: int = 1) -> torch.Tensor:
    return torch.randn(MODELS[name][1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _equal_unsharded(name: str) -> dict:
    reference, model = _build(name), _build(name)
    plan, forward, backward = parallelized_and_stepped(model, reference, _inputs(name), rtol=1e-10, atol=1e-12)
    grouped = model.get_submodule(MODELS[name][2][1])
    return {"styles": [plan.layer(module).style.value for module in MODELS[name][2]],
            "local": (grouped.groups, grouped.in_channels, grouped.out_channels, tuple(grouped.weight.shape)),
            "forward": forward, "backward": backward, "same_module": type(grouped) is type(reference.get_submodule(
                MODELS[name][2][1]))}


def _all_equal_unsharded() -> dict:
    return {name: _equal_unsharded(name) for name in MODELS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_convolutions_equal_unsharded(world_size):
    results = run_on_ranks(_all_equal_unsharded, world_size, timeout=600)
    for name, summary in results[0].items():
        assert summary["styles"] == ["column", "batch", "row"], (name, summary)
        assert summary["forward"] == {"all_reduce": 1}, (name, summary)  # the row layer's, nothing more
        assert summary["same_module"], name
    mixer = [autoshard.split_sizes(10, world_size)[rank] for rank in range(world_size)]
    assert [r["causal_mixer"]["local"] for r in results] == [(c, c, c, (c, 1, 4)) for c in mixer]
    # Four groups of 4 input and 2 output channels: whole groups per rank (2, 1, 1 at 3 ranks).
    groups = autoshard.split_sizes(4, world_size)
    assert [r["four_groups"]["local"] for r in results] == [(g, 4 * g, 2 * g, (2 * g, 4, 3)) for g in groups]


def test_plan_of_a_whole_input_keeps_the_grouped_convolution_whole():
    model = nn.Sequential(nn.Conv1d(8, 8, 3, groups=8), nn.GELU(), nn.Conv1d(8, 4, 1))
    plan = autoshard.plan(model, world_size=2, example_inputs=(torch.randn(2, 8, 6),))
    assert plan.layer("0").style.value == "replicate" and plan.layer("0").reason == "groups_input_whole"
    assert "groups_input_whole" in str(plan) or "arrive whole" in str(plan)


def test_grouped_transposed_convolution_is_not_a_layer():
    model = nn.Sequential(nn.Conv1d(4, 8, 1), nn.ConvTranspose1d(8, 8, 3, groups=2))
    plan = autoshard.plan(model, world_size=2, example_inputs=(torch.randn(2, 4, 6),))
    assert [layer.module for layer in plan.layers] == ["0"]
    assert plan.parameters["1.weight"].whole_reason == "convolution"


LR, MAX_NORM = 1e-2, 0.05


def _train(model, optimizer, steps, sharded: bool):
    for step in range(steps):
        optimizer.zero_grad()
        model(_inputs("causal_mixer", seed=10 + step)).square().sum().backward()
        clip = autoshard.clip_grad_norm_ if sharded else torch.nn.utils.clip_grad_norm_
        clip(model.parameters(), MAX_NORM)
        optimizer.step()


def _train_and_save(path: str):
    """Two AdamW steps with clipping on the sharded mixer equal torch's on an unsharded copy;
    the sharded one is saved."""
    model = _build("causal_mixer")
    reference = copy.deepcopy(model)
    autoshard.parallelize(model, example_inputs=(_inputs("causal_mixer"),))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=LR)
    _train(model, optimizer, 2, sharded=True)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR), 2, sharded=False)
    saved = {name: value.clone() for name, value in autoshard.full_state_dict(model).items()}
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    checkpoint.save(path, model, optimizer, extra={"step": 2})
    return saved


def _load(path: str):
    model = _build("causal_mixer", seed=5)
    autoshard.parallelize(model, example_inputs=(_inputs("causal_mixer"),))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=LR)
    assert checkpoint.load(path, model, optimizer) == {"step": 2}
    assert model.conv1d.groups == autoshard.split_sizes(10, dist.get_world_size())[dist.get_rank()]
    return {name: value.clone() for name, value in autoshard.full_state_dict(model).items()}


def test_checkpoint_saved_on_three_ranks_reloads_on_two(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_train_and_save, 3, path, timeout=600)[0]
    loaded = run_on_ranks(_load, 2, path, timeout=600)[0]
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
