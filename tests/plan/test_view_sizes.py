"""Sizes a module reads from a whole tensor and reshapes a sharded one with: nanoGPT's attention
takes `B, T, C = x.size()` and ends with `y.view(B, T, C)` on its heads' output, and views q, k
and v with `C // self.n_head`. The plan names those view calls and their global sizes, and the
sharded module gets the local ones (nn/view_sizes.py). Checked against the unsharded model on 2,
3 and 4 gloo ranks, with heads that split unevenly, through the plan's JSON, and against
Hugging Face's TrOCR, which reshapes to `hidden_states.size()`'s width."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.nn import view_sizes
from autoshard.nn.view_sizes import LocalViewSizes, ViewSizeHooks
from gathered import forward_backward_as_planned, gathered_grads
from multirank import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
from idiom_models import SizeViewAttention  # noqa: E402

WIDTH, VOCAB = 24, 40


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = SizeViewAttention(WIDTH, n_head=6)  # nanoGPT's attention, 6 heads: uneven at 4 ranks
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt():
    torch.manual_seed(0)
    return GPT().double()


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def test_the_attention_is_split_by_heads_with_its_view_sizes_made_local():
    plan = autoshard.plan(_gpt(), example_inputs=(_ids(),), world_size=4)
    styles = {layer.module: layer.style.value for layer in plan.layers}
    assert styles["h.0.attn.c_attn"] == "column" and styles["h.0.attn.c_proj"] == "row", str(plan)
    region = next(r for r in plan.regions.values() if r.module == "h.0.attn")
    # q, k and v viewed to (B, T, 6 heads, 4), the heads' output to (B, T, 24): 6 heads over 4
    # ranks are 2/2/1/1.
    assert sorted(region.view_sizes) == [[0, 2, 6], [1, 2, 6], [2, 2, 6], [3, 2, WIDTH]]
    assert [region.local_value(6, r, 4) for r in range(4)] == [2, 2, 1, 1]
    assert "view and reshape sizes read from whole tensors, made local" in str(plan)
    again = autoshard.ShardingPlan.from_json(plan.to_json())
    assert [r.view_sizes for r in again.regions.values()] == [r.view_sizes for r in plan.regions.values()]


def _gpt_exact(from_json: bool):
    ids = _ids()
    model, reference = _gpt(), _gpt()
    plan = autoshard.plan(model, example_inputs=(ids,), world_size=torch.distributed.get_world_size())
    if from_json:
        plan = autoshard.ShardingPlan.from_json(plan.to_json())
    autoshard.parallelize(model, plan, example_inputs=(ids,))
    forward_backward_as_planned(model, reference, plan, lambda m: m(ids), rtol=1e-10, atol=1e-10)
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return {layer.module: layer.style.value for layer in plan.layers}


@pytest.mark.parametrize("world_size,from_json", [(2, False), (3, False), (4, True)])
def test_nanogpt_split_equals_the_unsharded_model(world_size, from_json):
    for styles in run_on_ranks(_gpt_exact, world_size, from_json):
        assert styles["h.1.attn.c_attn"] == "column"


def _trocr():
    from transformers import TrOCRConfig, TrOCRForCausalLM

    torch.manual_seed(0)
    config = TrOCRConfig(vocab_size=VOCAB, d_model=16, decoder_layers=2, decoder_attention_heads=4,
                         decoder_ffn_dim=32, max_position_embeddings=32, use_cache=False, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0)
    return TrOCRForCausalLM(config).double()


def _trocr_exact():
    ids = _ids()
    model, reference = _trocr(), _trocr()
    autoshard.parallelize(model, example_inputs={"input_ids": ids})
    plan = autoshard.core.parallel_state.state_of(model).plan
    forward_backward_as_planned(model, reference, plan, lambda m: m(input_ids=ids).logits, rtol=1e-9, atol=1e-9)
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    return {layer.module: layer.style.value for layer in plan.layers}


def test_trocr_reshaping_to_its_inputs_width_is_split_and_exact():
    for styles in run_on_ranks(_trocr_exact, 2):
        assert styles["model.decoder.layers.0.self_attn.out_proj"] == "row"


class Reshapes(nn.Module):
    def forward(self, x, width):
        return x.view(2, width), x.reshape(-1, width), torch.reshape(x, (2, width))


def test_a_view_is_given_the_local_size_only_where_the_global_one_does_not_fit():
    seen = []
    module = Reshapes()
    ViewSizeHooks(module, {0: {1: (8, 4)}, 1: {1: (8, 4)}, 2: {1: (8, 4)}}, seen)
    local = torch.arange(8.0).view(2, 4)
    assert [tuple(o.shape) for o in module(local, 8)] == [(2, 4), (2, 4), (2, 4)]
    # A size other than the one recorded is left as written.
    assert [tuple(o.shape) for o in module(torch.arange(12.0), 6)] == [(2, 6), (2, 6), (2, 6)]
    with pytest.raises(RuntimeError):
        module(torch.arange(6.0), 4)
    assert [call[0] for call in seen] == [0, 1, 2, 0, 1, 2, 0]
    assert [call[3] for call in seen] == [True] * 6 + [False]  # the call that raised did not return


def test_views_made_by_torch_or_in_a_nested_module_are_not_counted():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Reshapes()

        def forward(self, x):
            a = F.linear(x.view(2, 4), torch.eye(4, dtype=x.dtype))  # torch's own code: no counted view
            return a.view(8), self.inner(x, 4)

    outer_seen, inner_seen = [], []
    outer = Outer()
    ViewSizeHooks(outer, {}, outer_seen)
    ViewSizeHooks(outer.inner, {}, inner_seen)
    outer(torch.arange(8.0))
    assert [(call[0], call[2]) for call in outer_seen] == [(0, (2, 4)), (1, (8,))]
    assert [(call[0], call[2]) for call in inner_seen] == [(0, (2, 4)), (1, (-1, 4)), (2, (2, 4))]
    assert view_sizes._stack() == [] and not any(isinstance(m, LocalViewSizes) for m in _function_modes())


def _function_modes():
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
