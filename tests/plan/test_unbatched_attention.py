"""Attention written without a batch axis, as vision towers that pack every image's patches into
one sequence do (Qwen2-VL, GLM-4V): q, k and v taken apart from one fused projection by
reshape, permute and unbind, given a batch of one with transpose(0, 1).unsqueeze(0), and the
output reshaped back to [tokens, features]. Split by heads, and equal to the unsharded module
in outputs and every gradient at 2 and 3 ranks (6 heads: uneven at 4)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from gathered import assert_equals_unsharded
from multirank import run_on_ranks

HIDDEN, HEADS, HEAD_DIM = 48, 6, 8


class PackedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM)
        self.proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x):
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return self.proj(out.reshape(tokens, -1))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = PackedAttention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


def _inputs() -> torch.Tensor:
    return torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _equal_unsharded() -> dict:
    torch.manual_seed(0)
    reference = Tower().double()
    model = Tower().double()
    model.load_state_dict(reference.state_dict())
    autoshard.parallelize(model, example_inputs=(_inputs(),))
    assert_equals_unsharded(model, reference, (_inputs(),), rtol=1e-10, atol=1e-10)
    return {layer.module: layer.style.value for layer in model.autoshard_state.plan.layers}


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_by_heads_and_equal_unsharded(world_size):
    styles = run_on_ranks(_equal_unsharded, world_size)[0]
    assert styles == {"attn.qkv": "column", "attn.proj": "row"}, styles


def test_the_plan_holds_the_fused_parts():
    plan = autoshard.plan(Tower(), world_size=4, example_inputs=(_inputs().float(),))
    qkv = plan.layer("attn.qkv")
    assert qkv.style.value == "column" and list(qkv.parts) == [HEADS * HEAD_DIM] * 3, (qkv.style, qkv.parts)
