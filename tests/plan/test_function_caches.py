"""A model that caches what a function computed (functools.lru_cache, transformers'
compile_compatible_method_lru_cache) traces the same ops in the plan and in parallelize's dry
run: the caches are emptied before each trace on meta. Against the unsharded model at 2 ranks."""

import functools

import torch
from torch import nn
from transformers.pytorch_utils import compile_compatible_method_lru_cache

import autoshard
from autoshard.capture.function_caches import clear_model_caches
from multirank import run_on_ranks


@functools.lru_cache(maxsize=4)
def _positions(length: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    steps = torch.arange(length, dtype=dtype, device=device)
    return torch.sin(steps[:, None] / (1 + torch.arange(width, dtype=dtype, device=device)))


class CachedPositions(nn.Module):
    """An MLP over its input plus positions computed once per shape by a module-level cache and
    scaled by a method-level one (DINOv3's and SAM 3's way)."""

    def __init__(self, width=8, hidden=12):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    @compile_compatible_method_lru_cache(maxsize=2)
    def scale(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.linspace(0.5, 1.5, length, dtype=dtype, device=device)[:, None]

    def forward(self, x):
        b, t, w = x.shape
        x = x + _positions(t, w, x.dtype, x.device) * self.scale(t, x.dtype, x.device)
        return self.down(torch.relu(self.up(x)))


def test_clear_model_caches_empties_module_and_method_caches():
    model = CachedPositions()
    model(torch.randn(2, 5, 8))
    assert _positions.cache_info().currsize == 1
    assert clear_model_caches(model) >= 2  # the module's function and its method's cache
    assert _positions.cache_info().currsize == 0
    model(torch.randn(2, 5, 8))  # computed again
    assert _positions.cache_info().misses == 1 and _positions.cache_info().hits == 0


def _against_unsharded():
    torch.manual_seed(0)
    model = CachedPositions().double()
    reference = CachedPositions().double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference(x)  # the caches hold real tensors before the plan's trace, as after a user's run
    autoshard.parallelize(model, example_inputs=(x,))
    plan = model.autoshard_state.plan
    got, want = model(x), reference(x)
    got.square().sum().backward(), want.square().sum().backward()
    return ({layer.module: (layer.style.value, layer.reason) for layer in plan.layers},
            float((got - want).abs().max()), float((model.down.bias.grad - reference.down.bias.grad).abs().max()))


def test_a_cached_computation_does_not_keep_the_model_whole():
    for styles, output_error, grad_error in run_on_ranks(_against_unsharded, 2, timeout=300):
        assert styles["up"][0] == "column" and styles["down"][0] == "row", styles
        assert output_error < 1e-12 and grad_error < 1e-12
