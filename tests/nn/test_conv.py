"""Convolutions split over channels (autoshard.constructs.conv): planned as column and row
layers from the dataflow, and on 2 and 3 gloo ranks equal to the unsharded model in outputs,
every gradient, the collectives the plan predicts and one SGD step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.constructs.conv import ShardedConv
from gathered import parallelized_and_stepped
from multirank import run_on_ranks


class ConvPair1d(nn.Module):
    """Uneven channels (10 over 3 ranks is 4, 3, 3), reflect padding and dilation."""

    def __init__(self):
        super().__init__()
        self.up = nn.Conv1d(6, 10, 3, padding=1)
        self.down = nn.Conv1d(10, 6, 3, padding=2, dilation=2, padding_mode="reflect")

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ConvPair2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 10, 3, stride=2, padding=1)
        self.project = nn.Conv2d(10, 4, 1, bias=False)

    def forward(self, x):
        return self.project(torch.relu(self.stem(x)))


class ConvTransposePair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose1d(4, 10, 4, stride=2)
        self.out = nn.ConvTranspose1d(10, 3, 3, stride=2, output_padding=1)

    def forward(self, x):
        return self.out(torch.tanh(self.up(x)))


class Conv3dPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv3d(2, 6, 2)
        self.b = nn.Conv3d(6, 2, 1)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


class AudioEncoder(nn.Module):
    """Whisper's idiom: two convolutions over the frames, then tokens through an MLP."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(5, 12, 3, padding=1)
        self.conv2 = nn.Conv1d(12, 8, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(8, 14)
        self.fc2 = nn.Linear(14, 8)

    def forward(self, x):
        # Whisper reads the convolutions' strides to check its input's length.
        assert x.shape[-1] % (self.conv1.stride[0] * self.conv2.stride[0]) == 0, x.shape
        h = F.gelu(self.conv2(F.gelu(self.conv1(x)))).permute(0, 2, 1)
        return h + self.fc2(F.gelu(self.fc1(h)))


class GroupedThenNorm(nn.Module):
    """A depthwise convolution and a BatchNorm over the channels, between a column and a row
    convolution: both split with the channels (MobileNet's block)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Conv1d(4, 8, 1)
        self.depthwise = nn.Conv1d(8, 8, 3, padding=1, groups=8)
        self.norm = nn.BatchNorm1d(8)
        self.down = nn.Conv1d(8, 4, 1)

    def forward(self, x):
        return self.down(self.norm(self.depthwise(self.up(x))))


MODELS = {
    "conv1d": (ConvPair1d, (2, 6, 11)),
    "conv2d": (ConvPair2d, (2, 3, 9, 7)),
    "conv_transpose": (ConvTransposePair, (2, 4, 5)),
    "conv3d": (Conv3dPair, (1, 2, 4, 5, 3)),
    "audio_encoder": (AudioEncoder, (2, 5, 10)),
    "grouped_then_norm": (GroupedThenNorm, (2, 4, 6)),
}


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def _inputs(name: str) -> torch.Tensor:
    return torch.randn(MODELS[name][1], generator=torch.Generator().manual_seed(1))


def _equal_unsharded(name: str) -> dict:
    reference, model = _build(name), _build(name)
    plan, forward, backward = parallelized_and_stepped(model, reference, _inputs(name), rtol=1e-5, atol=1e-6)
    sharded = {n: (type(m).__name__, m.style.value, m.shard_specs["weight"].local_size())
               for n, m in model.named_modules() if isinstance(m, ShardedConv)}
    return {"styles": {layer.module: layer.style.value for layer in plan.layers}, "sharded": sharded,
            "forward": forward, "backward": backward}


def _all_equal_unsharded() -> dict:
    return {name: _equal_unsharded(name) for name in MODELS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_convolutions_equal_unsharded(world_size):
    results = run_on_ranks(_all_equal_unsharded, world_size, timeout=600)
    pairs = {"conv1d": ("up", "down"), "conv2d": ("stem", "project"), "conv_transpose": ("up", "out"),
             "conv3d": ("a", "b"), "audio_encoder": ("conv1", "conv2")}
    for name, (column, row) in pairs.items():
        summary = results[0][name]
        assert summary["styles"][column] == "column" and summary["styles"][row] == "row", (name, summary)
        # One all-reduce in forward per pair (the row convolution's partial outputs).
        assert summary["forward"]["all_reduce"] >= 1, (name, summary)
        channels = _build(name).get_submodule(column).out_channels
        local = [r[name]["sharded"][column][2] for r in results]
        assert local == autoshard.split_sizes(channels, world_size), (name, local)
    # Whisper's idiom: the MLP after the convolutions is split too, a second pair.
    assert results[0]["audio_encoder"]["styles"]["fc1"] == "column"
    assert results[0]["audio_encoder"]["forward"]["all_reduce"] == 2
    # The row convolution's all-reduce, and the norm's running statistics gathered in training.
    assert results[0]["grouped_then_norm"]["styles"] == {"up": "column", "depthwise": "batch", "down": "row"}
    assert results[0]["grouped_then_norm"]["forward"] == {"all_reduce": 1, "all_gather": 1}


def test_grouped_convolution_and_batch_norm_split_with_the_channels():
    plan = autoshard.plan(GroupedThenNorm(), world_size=2, example_inputs=(torch.randn(2, 4, 6),))
    styles = {layer.module: layer.style.value for layer in plan.layers}
    assert styles == {"up": "column", "depthwise": "batch", "down": "row"}, styles
    assert [(norm.module, norm.per_channel) for norm in plan.norms] == [("norm", True)]


def test_a_depthwise_convolution_over_a_whole_input_stays_whole_with_its_reason():
    # On the model's input, which arrives whole: split alone it would cut its groups' channels
    # from it and need its output gathered back.
    model = nn.Sequential(nn.Conv1d(4, 4, 3, padding=1, groups=4), nn.Conv1d(4, 8, 1), nn.ReLU(), nn.Conv1d(8, 4, 1))
    plan = autoshard.plan(model, world_size=2, example_inputs=(torch.randn(2, 4, 6),))
    assert plan.layer("0").style.value == "replicate" and plan.layer("0").reason == "groups_input_whole"
    text = str(plan)
    assert "grouped or depthwise" in text, text


def test_sharded_conv_refuses_what_it_cannot_split():
    group_free = nn.Conv1d(4, 4, 3, groups=2)
    with pytest.raises(TypeError, match="ungrouped"):
        ShardedConv(group_free, "column")
    with pytest.raises(ValueError, match="style must be column, column_gather or row"):
        ShardedConv(nn.Conv1d(4, 4, 3), "vocab")
