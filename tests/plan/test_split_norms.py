"""RMS norms over a layer's output features (OLMo 2's q_norm and k_norm, over every head's
features before the view into heads): one planner node, split with the layer's features by
heads, replicated or split on tokens as a per-token op elsewhere. Against the unsharded model
(float64, exactly, with a norm computing in its input's dtype), numpy's array_split, Hugging
Face's OLMo 2, and a checkpoint saved on 3 ranks reloaded on 2 and on 1."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import checkpoint
from autoshard.nn.layer_norm import ShardedLayerNorm
from autoshard.nn.rms_norm import ShardedRMSNorm
from autoshard.constructs.split_norm import LAYER_NORM, layer_norm_form, rms_norm_form
from autoshard.planner.sharding_plan import ShardingPlan
from multirank import run_on_ranks
from test_planner_graphs import G, comm, styles


# ---- the planner on hand-written graphs


def _norm_block(g, norm_on="column"):
    """x -> q (column, 3 heads of 2) -> norm over q's 6 features -> heads -> row layer.
    With norm_on="row", the norm reads the row layer's output instead."""
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 6, 0, out_shape=(2, 4, 6))
    weight = g.tensor(6, param=2)
    if norm_on == "column":
        normed = g.tensor(2, 4, 6)
        g.node("norm", [q, weight], [normed], label="attn.q_norm", weight_param=2)
        q = normed
    heads = g.tensor(2, 4, 3, 2)
    g.node("view", [q], [heads])
    flat = g.tensor(2, 4, 6)
    g.node("view", [heads], [flat])
    _, y = g.linear(flat, 6, 8, 1, out_shape=(2, 4, 8))
    if norm_on == "row":
        post = g.tensor(8, param=3)
        normed = g.tensor(2, 4, 8)
        g.node("norm", [y, post], [normed], label="post_norm", weight_param=3)
        y = normed
    g.output(y)
    return q, y


@pytest.mark.parametrize("world", [2, 3])
def test_norm_over_split_features_splits_with_them(world):
    g = G()
    normed, _ = _norm_block(g)
    doc = g.plan(world)
    assert styles(doc) == ["column", "row"]
    assert doc["norms"] == [{"node": 1, "region": doc["layers"][0]["region"], "features": 6}]
    layout = {t["tensor"]: t for t in doc["tensors"]}
    assert (layout[normed]["axis"], layout[normed]["outer"], layout[normed]["size"]) == (2, 1, 6)
    # Its weight is split like the features, never a partial gradient.
    assert doc["partial_gradients"] == []
    # One value per token each way: the sum of squares forward, the scale's gradient backward.
    forward = {c["kind"]: (c["count"], c["elements"]) for c in doc["comm"] if c["phase"] == "forward"}
    backward = {c["kind"]: (c["count"], c["elements"]) for c in doc["comm"] if c["phase"] == "backward"}
    assert forward == {"all_reduce": (2, 2 * 4 + 2 * 4 * 8)}  # the norm's and the row layer's
    assert backward == {"all_reduce": (1, 2 * 4)}  # the norm's (x is an input: no copy to sum)


def test_norm_over_a_replicated_output_passes_it_through():
    g = G()
    _, y = _norm_block(g, norm_on="row")
    doc = g.plan(2, sequence_parallel=False)
    assert styles(doc) == ["column", "row"] and doc["norms"] == []
    assert y not in {t["tensor"] for t in doc["tensors"]}
    assert comm(doc, "forward") == {"all_reduce": 1}


@pytest.mark.parametrize("world", [2, 3])
def test_norm_on_split_tokens_is_per_token_with_a_partial_weight_gradient(world):
    # The sequence planner's stream, its final norm as a norm node: planned as the ops it stands for.
    from test_sequence_planner import block

    as_ops, as_node = G(), G()
    block(as_ops, seq=7)
    t = block(as_node, seq=7)
    (index,) = [i for i, n in enumerate(as_node.nodes) if n["label"] == "norm2"]
    record = as_node.nodes[index]
    as_node.nodes[index] = {"kind": "norm", "label": "norm2", "inputs": record["inputs"], "outputs": record["outputs"],
                            "weight_param": 5}
    want, got = as_ops.plan(world), as_node.plan(world)
    assert got["norms"] == []
    for key in ("layers", "comm", "partial_gradients", "tensors", "sequence_entries"):
        assert got[key] == want[key], key
    assert any(x["tensor"] == t["n2"] and x["sequence"] for x in got["tensors"])
    assert 5 in [p for bucket in got["partial_gradients"] for p in bucket["params"]]


def test_norm_over_an_axis_other_than_the_split_one_keeps_the_layer_whole():
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 6, 0, out_shape=(2, 4, 6))
    heads = g.tensor(2, 4, 3, 2)
    g.node("view", [q], [heads])
    weight = g.tensor(2, param=2)
    normed = g.tensor(2, 4, 3, 2)
    # Over head_dim, its weight shared by every head: not a norm over the layer's features.
    g.node("norm", [heads, weight], [normed], label="head_norm", weight_param=2)
    flat = g.tensor(2, 4, 6)
    g.node("view", [normed], [flat])
    g.linear(flat, 6, 8, 1, out_shape=(2, 4, 8), output=True)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["norms"] == []
    assert "head_norm normalises over an axis split otherwise than by its features" in doc["layers"][0]["note"]


def test_norm_node_needs_its_fields():
    g = G()
    x = g.tensor(2, 6)
    y = g.tensor(2, 6)
    g.node("norm", [x], [y])
    with pytest.raises(ValueError, match=r"plan.bad_graph.*weight_param"):
        g.plan(2)
    g = G()
    x, w, y = g.tensor(2, 6), g.tensor(6, param=0), g.tensor(2, 6)
    g.node("norm", [x, w, w, w], [y], weight_param=0)
    with pytest.raises(ValueError, match=r"plan.bad_graph.*reads \{x\[, weight\]\[, bias\]\}"):
        g.plan(2)


# ---- which modules count as such a norm


def test_rms_norm_forms_are_recognised_by_what_they_compute():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    assert rms_norm_form(Olmo2RMSNorm(8)) == "scale_then_cast"
    assert rms_norm_form(LlamaRMSNorm(8)) == "cast_then_scale"
    assert rms_norm_form(PlainRMSNorm(8)) == "input_dtype"
    assert rms_norm_form(GemmaRMSNorm(8)) is None  # scales by 1 + weight
    assert rms_norm_form(nn.LayerNorm(8)) is None
    assert rms_norm_form(nn.RMSNorm(8, eps=1e-6)) == "input_dtype"
    assert rms_norm_form(nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)) is None  # no weight


class ShiftedLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that adds 1 to its output: no LayerNorm for the split."""

    def forward(self, x):
        return super().forward(x) + 1


class CastingLayerNorm(nn.LayerNorm):
    """ESM-C's: a LayerNorm that returns its input's dtype."""

    def forward(self, x):
        return super().forward(x).to(x.dtype)


def test_layer_norms_are_recognised_by_what_they_compute():
    assert layer_norm_form(nn.LayerNorm(8)) == LAYER_NORM
    assert layer_norm_form(nn.LayerNorm(8, bias=False)) == LAYER_NORM
    assert layer_norm_form(CastingLayerNorm(8)) == LAYER_NORM
    assert layer_norm_form(ShiftedLayerNorm(8)) is None
    assert layer_norm_form(nn.LayerNorm(8, elementwise_affine=False)) is None  # no weight to split
    assert layer_norm_form(nn.LayerNorm((4, 2))) is None  # over two axes
    assert layer_norm_form(PlainRMSNorm(8)) is None


# ---- a model of our own, exactly in float64


class PlainRMSNorm(nn.Module):
    """An RMS norm computing in its input's dtype."""

    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class NormedAttention(nn.Module):
    """q and k normalised over every head's features together, as OLMo 2 does."""

    def __init__(self, hidden=24, heads=6, layer_norm=False):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        # ESM-C normalises with LayerNorms (weight and bias) where OLMo 2 has RMS norms.
        norm = CastingLayerNorm if layer_norm else PlainRMSNorm
        self.q_norm, self.k_norm = norm(hidden), norm(hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape
        shape = (b, t, -1, 4)  # head_dim 4: the head count follows from the local features
        q = self.q_norm(self.q_proj(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _build_own(seed=0, layer_norm=False):
    torch.manual_seed(seed)
    model = NormedAttention(layer_norm=layer_norm).double()
    with torch.no_grad():
        for norm in (model.q_norm, model.k_norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, dtype=torch.float64) + 0.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.rand(norm.bias.shape, dtype=torch.float64) - 0.5)
    return model


def _own_against_unsharded(layer_norm=False):
    model, reference = _build_own(layer_norm=layer_norm), _build_own(layer_norm=layer_norm)
    # Features far from zero mean, where a variance taken as E[x^2] - E[x]^2 would lose digits.
    x = 3 + torch.randn(2, 5, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, example_inputs=(x,))
    sharded = ShardedLayerNorm if layer_norm else ShardedRMSNorm
    assert isinstance(model.q_norm, sharded) and isinstance(model.k_norm, sharded)
    with autoshard.CommCounter() as forward:
        got = model(x.clone())
    counted = {k: v for k, v in forward.counts.items() if v}
    want = reference(x.clone())
    got.square().sum().backward()
    want.square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    specs = model.autoshard_state.plan.param_specs(torch.distributed.get_rank())
    errors = {}
    for name, p in reference.named_parameters():
        full = p.grad if name not in specs else specs[name].take(p.grad)
        errors[name] = float((grads[name] - full).abs().max())
    predicted = model.autoshard_state.plan.collectives("forward")
    return float((got - want).abs().max()), errors, model.q_norm.weight.detach().clone(), (counted, predicted)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms_norm", "layer_norm"])
@pytest.mark.parametrize("world", [2, 3])
def test_own_model_matches_unsharded_in_float64(world, layer_norm):
    results = run_on_ranks(_own_against_unsharded, world, layer_norm, timeout=300)
    heads = np.array_split(np.arange(6), world)
    full = _build_own(layer_norm=layer_norm).q_norm.weight.detach()
    for rank, (output_error, errors, q_norm, (counted, predicted)) in enumerate(results):
        assert output_error < 1e-12
        assert set(errors) == {n for n, _ in _build_own(layer_norm=layer_norm).named_parameters()}
        assert counted == predicted  # a LayerNorm's mean and variance: two all-reduces each
        assert max(errors.values()) < 1e-12, errors
        # This rank's heads' 4 features each.
        want = full[heads[rank][0] * 4:(heads[rank][-1] + 1) * 4]
        assert torch.equal(q_norm, want)


# ---- OLMo 2


def _olmo2(seed=0, device="cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("olmo2", hidden_size=48, intermediate_size=70, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=3, vocab_size=101, attention_dropout=0.0,
                                  bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms that are not all ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape) + 0.5)
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_olmo2_plan_splits_attention_with_its_norms(world):
    p = autoshard.plan(_olmo2().to("meta"), world_size=world)
    assert [n.module for n in p.norms] == [f"model.layers.{i}.self_attn.{k}_norm" for i in (0, 1) for k in "qk"]
    assert p.layer("model.layers.0.self_attn.q_proj").style == "column"
    assert "norms split with their layer's features" in str(p)
    spec = p.param_specs(0)["model.layers.0.self_attn.k_norm.weight"]
    kv_heads = np.array_split(np.arange(3), world)[0]
    assert spec.local_size() == len(kv_heads) * 8
    assert ShardingPlan.from_json(p.to_json()).norms == p.norms


def test_olmo2_on_4_ranks_keeps_attention_whole_where_ranks_share_kv_heads():
    p = autoshard.plan(_olmo2().to("meta"), world_size=4)
    assert p.norms == [] and p.layer("model.layers.0.self_attn.k_proj").style == "replicate"
    # Held whole, the attention would leave each rank half the model: its query and output
    # projections, which cannot be paired, are split and gathered instead.
    q_proj = p.layer("model.layers.0.self_attn.q_proj")
    assert q_proj.style == "column_gather" and "normalises over KV heads that several ranks hold" in q_proj.note
    assert p.held_fraction(0) < 0.35


def _save_trained(path):
    model = _olmo2()
    autoshard.parallelize(model)
    assert isinstance(model.model.layers[0].self_attn.q_norm, ShardedRMSNorm)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    autoshard.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    checkpoint.save(path, model, opt, extra={"step": 1})
    return {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def _reload(path):
    model = _olmo2(seed=5)
    autoshard.parallelize(model)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3)
    extra = checkpoint.load(path, model, opt)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(4))
    logits = model(input_ids=ids).logits  # whole, called without labels
    return extra, {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}, logits.detach()


def test_olmo2_checkpoint_saved_on_3_ranks_reloads_on_2_and_on_1(tmp_path):
    path = str(tmp_path / "step-1")
    full = run_on_ranks(_save_trained, 3, path, timeout=300)[0]
    reference = _olmo2(seed=5)
    reference.load_state_dict(full)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(4))
    want = reference(input_ids=ids).logits.detach()
    for extra, state, logits in run_on_ranks(_reload, 2, path, timeout=300):
        assert extra == {"step": 1} and state.keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(state[name], value), name
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    model = _olmo2(seed=5)
    assert checkpoint.load(path, model, torch.optim.AdamW(model.parameters(), lr=2e-3)) == {"step": 1}
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[name]), name


def _load_pretrained_and_run(path):
    model = _olmo2(device="meta")
    autoshard.parallelize(model)
    autoshard.load_pretrained(model, path, progress=False)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(4))
    return model(input_ids=ids).logits.detach(), autoshard.full_state_dict(model)


def test_olmo2_load_pretrained_gives_each_rank_its_norm_features(tmp_path):
    reference = _olmo2(seed=11)
    reference.save_pretrained(str(tmp_path), max_shard_size="20KB")
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(4))
    expected = reference(input_ids=ids).logits.detach()
    for logits, state in run_on_ranks(_load_pretrained_and_run, 3, str(tmp_path), timeout=300):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], value), name


# ---- a norm at a module's entry, on a layer's output from outside it


class _PatchMergedBlock(nn.Module):
    """A block whose first op is a LayerNorm of its input, and whose heads count is an attribute
    (traced alone to choose it); the model calls it on a Linear's output (Swin's patch merging)."""

    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(attended.transpose(1, 2).reshape(b, t, -1))


class _Merged(nn.Module):
    def __init__(self):
        super().__init__()
        self.reduction = nn.Linear(16, 8)
        self.block = _PatchMergedBlock()

    def forward(self, x):
        return self.block(self.reduction(x))


def test_a_block_traced_alone_records_the_norm_at_its_entry_as_the_capture_did():
    torch.manual_seed(0)
    plan = autoshard.plan(_Merged(), world_size=2, example_inputs=(torch.randn(2, 5, 16),))
    # Traced alone to choose `heads`, the block's norm must be the node the capture recorded
    # (the reduction's output is a layer's), or the block would not match and stay whole.
    assert plan.layer("block.qkv").style == "column" and plan.layer("block.out").style == "row", str(plan)
    assert not [layer for layer in plan.layers if layer.reason == "shape_mismatch"]
