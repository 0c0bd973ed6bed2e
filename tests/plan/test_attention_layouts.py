"""Attention the plan follows through other layouts: rotary embeddings built with stack and
flatten (GPT-J), complex pairs, repeat (of the table and of the KV heads), and
torch.nn.MultiheadAttention, whose fused q/k/v weight is applied with functional calls. The
tiny models (hidden 48, 6 heads, 2 layers) split their attention: a rank holds at most
1/N + 0.1 of the parameters. Exactness is checked by the conformance entries
(tests/conformance: own_rotary_*, own_multihead*, gptj)."""

import copy
import os
import sys
import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard import checkpoint
from autoshard.nn.multihead_attention import ReturnedWeights, shard_multihead_attention
from autoshard.constructs.attention import ReturnedAttentionWeights
from autoshard.core.spec import ShardSpec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))

import conformance_models  # noqa: E402
from conformance_builders import hf  # noqa: E402
from multirank import run_on_ranks  # noqa: E402

IDS = {"input_ids": torch.randint(1, conformance_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))}


def _plan(model, world_size=2, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.plan(model, world_size=world_size, **kwargs)


MODELS = {
    "gptj": hf("gptj", n_embd=48, n_layer=2, n_head=6, n_positions=32, rotary_dim=4),
    "rotary_stack": lambda: conformance_models.tiny_decoder(rotary_layout="stack"),
    "rotary_interleave": lambda: conformance_models.tiny_decoder(rotary_layout="interleave"),
    "rotary_repeat": lambda: conformance_models.tiny_decoder(rotary_layout="repeat"),
    "multihead": lambda: conformance_models.multihead_decoder(),
    "multihead_seq_first": lambda: conformance_models.multihead_decoder(batch_first=False),
    "multihead_no_bias": lambda: conformance_models.multihead_decoder(bias=False),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_is_split_and_a_rank_holds_its_share(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = _plan(model, example_inputs=None if name == "gptj" else IDS)
    attention = [layer for layer in plan.layers if ".attn." in layer.module]
    assert attention and all(layer.style in ("column", "row") for layer in attention), \
        [(layer.module, layer.style, layer.note) for layer in attention]
    assert plan.held_fraction(0) <= 0.5 + 0.1, plan.held_fraction(0)


def test_multihead_attention_projections_are_a_fused_column_and_a_row():
    plan = _plan(conformance_models.multihead_decoder(), world_size=3, example_inputs=IDS)
    in_proj, out_proj = plan.layer("blocks.0.attn.in_proj"), plan.layer("blocks.0.attn.out_proj")
    assert (in_proj.style, in_proj.parts, in_proj.units, in_proj.weight) == \
        ("column", [48, 48, 48], 6, "blocks.0.attn.in_proj_weight")
    assert (out_proj.style, out_proj.units) == ("row", 6)
    # Each of q, k and v gives the rank its heads: 2 heads of 8 features on 3 ranks.
    assert in_proj.weight_spec(1, 3).local_size() == 3 * 16


def test_multihead_attention_with_weights_never_read_is_split_and_returns_none():
    """need_weights=True (torch's default) with `out, _ = attn(...)`: the averaged weights are
    never read, so the attention is split by heads with no collective for them, and the plan
    says the sharded attention returns None in their place."""
    plan = _plan(conformance_models.multihead_decoder(need_weights=True), example_inputs=IDS)
    unread = _plan(conformance_models.multihead_decoder(), example_inputs=IDS)
    for block in range(2):
        styles = [plan.layer(f"blocks.{block}.attn.{p}").style for p in ("in_proj", "out_proj")]
        assert styles == ["column", "row"], styles
    assert plan.attention_weights == [ReturnedAttentionWeights(f"blocks.{b}.attn", used=False) for b in range(2)]
    assert plan.returned_weights("blocks.0.attn") == "none"
    assert plan.collectives("forward") == unread.collectives("forward")
    assert "blocks.0-1.attn: attention weights not returned (None): the model never reads them" in str(plan)
    assert plan.held_fraction(0) <= 0.5 + 0.1


@pytest.mark.parametrize("world_size", [2, 3])
def test_multihead_attention_whose_averaged_weights_are_read_plans_one_all_reduce_each(world_size):
    """Read by the model, the weights averaged over every head cost one forward all-reduce per
    attention (the size of the averaged weights), none in backward; the plan lists them."""
    plan = _plan(conformance_models.multihead_decoder(read_weights=True), world_size, example_inputs=IDS)
    unread = _plan(conformance_models.multihead_decoder(need_weights=True), world_size, example_inputs=IDS)
    assert [plan.layer(f"blocks.{b}.attn.in_proj").style for b in range(2)] == ["column", "column"]
    assert plan.attention_weights == [ReturnedAttentionWeights(f"blocks.{b}.attn", used=True) for b in range(2)]
    forward, backward = plan.collectives("forward"), plan.collectives("backward")
    assert forward["all_reduce"] == unread.collectives("forward")["all_reduce"] + 2
    assert backward == unread.collectives("backward")
    averaged = 2 * 7 * 7 * 4  # (batch, tokens, tokens) fp32 per attention
    bytes_of = lambda p: next(c.bytes for c in p.comm if c.phase == "forward" and c.kind == "all_reduce")
    assert bytes_of(plan) - bytes_of(unread) == 2 * averaged
    assert "blocks.0-1.attn: attention weights averaged over every head (one all-reduce" in str(plan)
    assert plan.held_fraction(0) <= 1 / world_size + 0.1
    # The plan's record survives its JSON form.
    assert autoshard.ShardingPlan.from_json(plan.to_json()).attention_weights == plan.attention_weights


def test_multihead_attention_whose_per_head_weights_are_read_stays_whole():
    """average_attn_weights=False returns the weights of every head: read by the model, the
    attention is kept whole with that reason; never read, it is split and returns None."""
    plan = _plan(conformance_models.multihead_decoder(read_weights=True, average_weights=False), example_inputs=IDS)
    for block in range(2):
        styles = {plan.layer(f"blocks.{block}.attn.{p}").style for p in ("in_proj", "out_proj")}
        assert styles == {"replicate"}, styles
    note = plan.layer("blocks.0.attn.in_proj").note
    assert "per head (average_attn_weights=False) and the model reads them" in note, note
    assert plan.attention_weights == []
    unread = _plan(conformance_models.multihead_decoder(need_weights=True, average_weights=False), example_inputs=IDS)
    assert unread.layer("blocks.0.attn.in_proj").style == "column"
    assert unread.returned_weights("blocks.0.attn") == "none"


def _attention_weights_on_ranks(options):
    """On each rank: a decoder parallelized by its plan, and what its first attention returns
    against the unsharded module's (output, weights), with the weights' gradient."""
    torch.manual_seed(0)
    model = conformance_models.multihead_decoder(**options).double()
    reference = copy.deepcopy(model.blocks[0].attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autoshard.parallelize(model, example_inputs=IDS)
    attention = model.blocks[0].attn
    x = torch.randn(2, 7, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    got_out, got_weights = attention(x, x, x, attn_mask=causal)
    want_out, want_weights = reference(x, x, x, attn_mask=causal)
    result = {"type": type(attention).__name__, "out": torch.allclose(got_out, want_out)}
    if got_weights is None:
        result["weights"] = None
        return result
    result["weights"] = torch.allclose(got_weights, want_weights)
    probe = torch.randn(want_weights.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (grad_got,) = torch.autograd.grad((got_weights * probe).sum(), x)
    (grad_want,) = torch.autograd.grad((want_weights * probe).sum(), x)
    result["grad"] = torch.allclose(grad_got, grad_want)
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_multihead_attention_returns_every_heads_average_or_none(world_size):
    """Split on 2 and 3 ranks: where the plan found the weights read, every rank returns the
    unsharded module's average over all heads, and its input's gradient through them is the
    unsharded one's; where never read, None (a reader fails loudly, never a local average).
    A module planned from calls returning no weights averages them exactly if asked to."""
    exact = [{"type": "ParallelMultiheadAttention", "out": True, "weights": True, "grad": True}] * world_size
    assert run_on_ranks(_attention_weights_on_ranks, world_size, dict(read_weights=True), timeout=300) == exact
    assert run_on_ranks(_attention_weights_on_ranks, world_size, dict(), timeout=300) == exact
    unread = run_on_ranks(_attention_weights_on_ranks, world_size, dict(need_weights=True), timeout=300)
    assert unread == [{"type": "ParallelMultiheadAttention", "out": True, "weights": None}] * world_size


def test_returned_weights_refuses_bad_arguments_and_per_head_weights_on_a_split_group():
    attention = nn.MultiheadAttention(48, 6)
    spec = ShardSpec(0, 144, 0, 1, units=6, parts=(48, 48, 48))
    with pytest.raises(ValueError, match="returned_weights must be one of"):
        shard_multihead_attention(attention, spec, attention.out_proj, None, "local")
    assert type(attention) is nn.MultiheadAttention  # refused before anything changed
    returned = ReturnedWeights("some_group", 6, "all_reduce")
    with pytest.raises(ValueError, match="per head"):
        returned(torch.rand(2, 3, 5, 5), False)


@pytest.mark.parametrize("batch_first", [True, False])
def test_parallel_multihead_attention_computes_the_module_and_refuses_other_calls(batch_first):
    """With every head (one rank, no collective) it computes what nn.MultiheadAttention computes,
    masks and returned weights included; a cross-attention call, which no plan split, is refused."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(48, 6, batch_first=batch_first).double()
    attention = copy.deepcopy(reference)
    spec = ShardSpec(0, 144, 0, 1, units=6, parts=(48, 48, 48))
    shard_multihead_attention(attention, spec, attention.out_proj, None)
    assert [name for name, _ in attention.named_parameters()] == [name for name, _ in reference.named_parameters()]
    shape = (2, 5, 48) if batch_first else (5, 2, 48)  # 2 sequences of 5 tokens
    x = torch.randn(*shape, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for kwargs in (dict(need_weights=False), dict(attn_mask=causal), dict(key_padding_mask=padding),
                   dict(attn_mask=causal, key_padding_mask=padding, average_attn_weights=False),
                   dict(attn_mask=causal, is_causal=True, need_weights=False)):
        got, want = attention(x, x, x, **kwargs), reference(x, x, x, **kwargs)
        torch.testing.assert_close(got[0], want[0])
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            torch.testing.assert_close(got[1], want[1])
    y = torch.randn(*shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="only self-attention is split"):
        attention(x, y, y)


def test_codegen_attention_is_split_on_whole_groups_of_its_interleaved_qkv():
    """CodeGen's fused projection interleaves q, v and k in 4 groups (mp_num, a constant of its
    code) and views its output as (..., -1, 3 * embed_dim // 4): the plan splits it on whole groups
    (4 units), and the heads each rank computes are those its share of out_proj reads (the
    conformance entry "codegen" checks outputs and every gradient at 2, 3 and 4 ranks)."""
    model = hf("codegen", n_embd=64, n_layer=2, n_head=8, n_positions=32, rotary_dim=4)()
    for world_size in (2, 3):
        plan = _plan(model, world_size=world_size)
        qkv = plan.layer("transformer.h.0.attn.qkv_proj")
        assert (qkv.style, qkv.units) == ("column", 4), qkv.note
        assert plan.layer("transformer.h.0.attn.out_proj").style == "row"
        assert plan.layer("transformer.h.0.mlp.fc_in").style == "column"


def _save_sharded_multihead(path):
    torch.manual_seed(0)
    model = conformance_models.multihead_decoder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autoshard.parallelize(model, example_inputs=IDS)
    assert type(model.blocks[0].attn).__name__ == "ParallelMultiheadAttention"
    opt = autoshard.optim.SGD(model.parameters(), lr=0.1)
    model(**IDS).sum().backward()
    opt.step()
    checkpoint.save(path, model, extra={"step": 1})
    return {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def test_sharded_multihead_attention_checkpoint_reloads_unsharded(tmp_path):
    """Saved on 4 ranks (6 heads: 2, 2, 1, 1 per rank, in each of q, k and v), reloaded into the
    plain model on one process: the same tensors under nn.MultiheadAttention's own names."""
    path = str(tmp_path / "step-1")
    full = run_on_ranks(_save_sharded_multihead, 4, path, timeout=300)[0]
    model = conformance_models.multihead_decoder()
    assert checkpoint.load(path, model) == {"step": 1}
    state = model.state_dict()
    assert state.keys() == full.keys() and "blocks.0.attn.in_proj_weight" in state
    for name, value in full.items():
        assert torch.equal(state[name], value), name
