"""nn.Linear subclasses with a forward of their own: planned as Linear layers only where that
forward computes F.linear (Hugging Face's FalconLinear), checked numerically per class."""

import warnings

import torch
from torch import nn

import autoshard
from autoshard.nn.linear_probe import computes_linear


class MatmulLinear(nn.Linear):
    """FalconLinear's way: input @ weight.T, then the bias."""

    def forward(self, x):
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * nn.functional.linear(x, self.weight, self.bias)


class BiaslessLinear(nn.Linear):
    """Drops its bias: equal to F.linear only when it has none."""

    def forward(self, x):
        return x @ self.weight.T


class OwnInitLinear(nn.Linear):
    def __init__(self, features):
        super().__init__(features, features)

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def test_only_subclasses_computing_linear_are_taken():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    assert computes_linear(nn.Linear)
    assert computes_linear(FalconLinear)
    assert computes_linear(MatmulLinear)
    assert not computes_linear(ScaledLinear)
    assert not computes_linear(BiaslessLinear)
    assert not computes_linear(OwnInitLinear)  # not checkable from nn.Linear's signature


class TwoLayerMLP(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.up, self.down = linear(8, 12), linear(12, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _styles(linear):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(TwoLayerMLP(linear), world_size=2, example_inputs=(torch.randn(2, 3, 8),))
    return {layer.module: layer.style for layer in plan.layers}


def test_a_subclass_computing_linear_is_split_and_another_is_not_a_layer():
    assert _styles(MatmulLinear) == {"up": "column", "down": "row"}
    assert _styles(ScaledLinear) == {}

