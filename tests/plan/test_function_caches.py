"""A model that caches what a function computed (functools.lru_cache, transformers'
compile_compatible_method_lru_cache) traces the same ops in the plan and in parallelize's dry
run: the caches are emptied before each trace on meta. Against the unsharded model at 2 ranks."""

import functools

import torch
from torch import nn
from transformers.pytorch_utils import compile_compatible_method_lru_cache

import autoshard
from autoshard.capture.function_caches import clear_model_caches
from checks import seeded_twins, worst_gradient_difference
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


class RotaryTable(nn.Module):
    """fair-esm's rotary embedding: its cos table computed on the first call of a length and kept
    in attributes for the next calls."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, width, 2).double() / width)))
        self._seq_len_cached = None
        self._cos_cached = None

    def forward(self, x):
        if x.shape[1] != self._seq_len_cached:
            self._seq_len_cached = x.shape[1]
            angles = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)[:, None] * self.inv_freq
            self._cos_cached = torch.cat((angles, angles), -1).cos()
        return self._cos_cached


class CachedRotaryAttention(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.rotary = RotaryTable(self.head_dim)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, self.head_dim).unbind(2)
        cos = self.rotary(x)[None, :, None]
        q, k, v = (t.transpose(1, 2) for t in (q * cos, k * cos, v))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class CachedRotaryModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CachedRotaryAttention() for _ in range(2))
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x + self.down(torch.relu(self.up(x)))


def _cached_rotary_against_unsharded():
    model, reference = seeded_twins(CachedRotaryModel)
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, example_inputs=(x,))
    autoshard.parallelize(model, plan, example_inputs=(x,))
    got, want = model(x), reference(x)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    whole = [layer.module for layer in plan.layers if not layer.style.is_split]
    return whole, max((got - want).abs().max().item(), worst_gradient_difference(model, reference))


def test_a_table_a_module_caches_in_its_attributes_does_not_keep_it_whole():
    # Before, the capture's call filled the cache and the next trace of the module took the
    # cached path: every block was held whole ("shape_mismatch"), and with them nothing split.
    for whole, worst in run_on_ranks(_cached_rotary_against_unsharded, 2):
        assert whole == [], whole
        assert worst < 1e-12, worst


def test_planning_a_model_on_meta_leaves_its_caches_as_they_were():
    with torch.device("meta"):
        model = CachedRotaryModel().double()
    plan = autoshard.plan(model, world_size=2, example_inputs=(torch.randn(2, 5, 32, dtype=torch.float64),))
    assert not [layer.module for layer in plan.layers if not layer.style.is_split]
    # The capture ran the model itself (it is on meta already): what its call cached is undone.
    assert all(block.rotary._cos_cached is None and block.rotary._seq_len_cached is None for block in model.blocks)
