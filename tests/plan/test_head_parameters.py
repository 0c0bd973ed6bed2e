"""Parameters over the attention heads split with them (csrc/plan/constructs/head_params.cpp): the
planner on graphs written by hand (each layout it follows, each it refuses and why), then
plan() on small models of our own. Exactness is checked by the conformance entries (deberta,
own_head_scale, own_score_gain); loading and checkpoints by tests/checkpoint/test_head_parameters_loaded.py."""

import warnings

import pytest
import torch
from torch import nn

import autoshard
from test_planner_graphs import G, comm, styles


def attention(g, modify, label="attn", weights=(0, 1)):
    """A column layer split on 3 heads of 2, `modify(g, heads)` applied to the heads (returns the
    new tensor), then a row layer: the smallest attention-like region."""
    x = g.tensor(2, 8)
    nq, q = g.linear(x, 8, 6, weights[0], out_shape=(2, 6))
    heads = g.tensor(2, 3, 2)
    g.node("view", [q], [heads], label="aten.view.default")
    cur = modify(g, heads)
    flat = g.tensor(2, 6)
    g.node("view", [cur], [flat], label="aten.view.default")
    no, y = g.linear(flat, 6, 8, weights[1], out_shape=(2, 8), output=True)
    g.nodes[nq]["label"], g.nodes[no]["label"] = f"{label}.q", f"{label}.o"
    return y


def combine(g, heads, other, label="aten.add.Tensor"):
    out = g.tensor(2, 3, 2)
    g.node("pointwise", [heads, other], [out], label=label)
    return out


def all_head_bias(g, heads, param=5):
    """DeBERTa's q_bias: a parameter of all_head_size (6), viewed as (1, heads, head_dim)."""
    p = g.tensor(6, param=param)
    row = g.tensor(1, 6)
    g.node("view", [p], [row], label="aten.unsqueeze.default")
    split = g.tensor(1, 3, 2)
    g.node("view", [row], [split], label="aten.view.default")
    return p, combine(g, heads, split)


def split_params(doc):
    return [(p["tensor"], p["param"], p["axis"], p["size"]) for p in doc["head_params"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bias_of_all_head_size_is_split_with_the_heads(world_size):
    g = G()
    found = {}

    def modify(g, heads):
        found["p"], out = all_head_bias(g, heads)
        return out

    attention(g, modify)
    doc = g.plan(world_size)
    assert styles(doc) == ["column", "row"]
    region = doc["layers"][0]["region"]
    assert doc["layers"][0]["units"] == 3
    # The whole axis (6 = 3 heads x 2) split in the region's 3 units: a rank's heads' features.
    assert doc["head_params"] == [{"tensor": found["p"], "param": 5, "axis": 0, "size": 6, "region": region,
                                   "layer": -1, "parts": []}]
    assert {"tensor": found["p"], "axis": 0, "size": 6} in [{k: t[k] for k in ("tensor", "axis", "size")}
                                                          for t in doc["tensors"]]
    # A local parameter: no partial gradient to sum, nothing more than the region's own collectives.
    assert doc["partial_gradients"] == []
    assert comm(doc, "forward") == {"all_reduce": 1} and comm(doc, "backward") == {}


def test_scale_reached_through_views_broadcasts_and_its_own_elementwise_ops():
    # (3,) -> exp -> times a scalar -> (3, 1) -> expanded to (2, 3, 2), multiplying the heads.
    g = G()
    found = {}

    def modify(g, heads):
        p = found["p"] = g.tensor(3, param=5)
        e = g.tensor(3)
        g.node("pointwise", [p], [e], label="aten.exp.default")
        half = g.tensor()
        g.node("source", [], [half], label="aten.scalar_tensor.default")
        scaled = g.tensor(3)
        g.node("pointwise", [e, half], [scaled], label="aten.mul.Tensor")
        column = g.tensor(3, 1)
        g.node("view", [scaled], [column], label="aten.unsqueeze.default")
        wide = g.tensor(2, 3, 2)
        g.node("expand", [column], [wide], label="aten.expand.default")
        return combine(g, heads, wide, label="aten.mul.Tensor")

    attention(g, modify)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"]
    assert split_params(doc) == [(found["p"], 5, 0, 3)]


def test_one_scale_for_two_attentions_is_split_once():
    g = G()
    scale = g.tensor(3, 1, param=5)
    for label, weights in (("attn0", (0, 1)), ("attn1", (2, 3))):
        attention(g, lambda g, heads: combine(g, heads, scale, label="aten.mul.Tensor"), label, weights)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row", "column", "row"]
    assert split_params(doc) == [(scale, 5, 0, 3)]
    assert len({layer["region"] for layer in doc["layers"]}) == 1  # the shared scale ties their heads


def test_heads_that_are_not_the_outer_factor_are_refused():
    # (6,) viewed as (2, 3): the heads are the inner factor of the parameter's axis.
    g = G()

    def modify(g, heads):
        p = g.tensor(6, param=5)
        grid = g.tensor(2, 3)
        g.node("view", [p], [grid], label="aten.view.default")
        column = g.tensor(2, 3, 1)
        g.node("view", [grid], [column], label="aten.unsqueeze.default")
        return combine(g, heads, column)

    attention(g, modify)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["head_params"] == []
    note = doc["layers"][0]["note"]
    assert "parameter #5 over the heads, whose axis does not hold the heads as its outer factor" in note, note


def test_parameter_read_where_it_must_stay_whole_keeps_attention_whole():
    # The scale multiplies the heads and is also summed over its heads elsewhere: split, that
    # sum would reduce the sharded axis; so it stays whole, and the attention with it.
    g = G()
    scale = g.tensor(3, 1, param=5)
    y = attention(g, lambda g, heads: combine(g, heads, scale, label="aten.mul.Tensor"))
    total = g.tensor(1)
    g.node("reduce", [scale], [total], label="aten.sum.dim_IntList", axes=[0])
    out = g.tensor(2, 8, output=True)
    g.node("pointwise", [y, total], [out], label="aten.add.Tensor")
    doc = g.plan(2)
    assert styles(doc) == ["replicate", "replicate"] and doc["head_params"] == []
    note = doc["layers"][0]["note"]
    assert ("aten.mul.Tensor reads parameter #5 over the heads, which stays whole (with it split, "
            "aten.sum.dim_IntList reduces over the sharded axis)") in note, note


def test_parameter_of_a_layer_is_not_split_apart_from_it():
    # The column layer's own bias (param 9) is also added to the heads directly.
    g = G()
    x = g.tensor(2, 8)
    nq, q = g.linear(x, 8, 6, 0, bias=9, out_shape=(2, 6))
    heads = g.tensor(2, 3, 2)
    g.node("view", [q], [heads], label="aten.view.default")
    _, biased = all_head_bias(g, heads, param=9)
    flat = g.tensor(2, 6)
    g.node("view", [biased], [flat], label="aten.view.default")
    g.linear(flat, 6, 8, 1, out_shape=(2, 8), output=True)
    g.nodes[nq]["label"] = "attn.q"
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["head_params"] == []
    assert "parameter #9 over the heads, which is also the parameter of layer attn.q" in doc["layers"][0]["note"]


def test_scale_over_kv_heads_shared_by_several_ranks_is_refused():
    # 4 query heads, 2 KV heads on 4 ranks: each KV head is held by two ranks, so a parameter
    # over the KV heads could not be one rank's slice.
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 8, 0, out_shape=(2, 4, 8))
    _, k = g.linear(x, 8, 4, 1, out_shape=(2, 4, 4))
    _, v = g.linear(x, 8, 4, 2, out_shape=(2, 4, 4))
    qh, kh, vh = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 2, 2), g.tensor(2, 4, 2, 2)
    for a, b in ((q, qh), (k, kh), (v, vh)):
        g.node("view", [a], [b], label="aten.view.default")
    qt, kt, vt = g.tensor(2, 4, 4, 2), g.tensor(2, 2, 4, 2), g.tensor(2, 2, 4, 2)
    for a, b in ((qh, qt), (kh, kt), (vh, vt)):
        g.node("permute", [a], [b], permutation=[0, 2, 1, 3])
    kv_scale = g.tensor(2, 1, 1, param=9)
    ks = g.tensor(2, 2, 4, 2)
    g.node("pointwise", [kt, kv_scale], [ks], label="aten.mul.Tensor")
    o = g.tensor(2, 4, 4, 2)
    g.node("attention", [qt, ks, vt], [o])
    ot = g.tensor(2, 4, 4, 2)
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    flat = g.tensor(2, 4, 8)
    g.node("view", [ot], [flat], label="aten.view.default")
    g.linear(flat, 8, 8, 3, out_shape=(2, 4, 8), output=True)
    assert split_params(g.plan(2)) == [(kv_scale, 9, 0, 2)]  # one KV head per rank: split
    doc = g.plan(4)
    assert doc["head_params"] == [] and styles(doc)[:3] == ["replicate"] * 3
    # The KV projection's note says why (the query heads' says their attention lost its k).
    note = doc["layers"][1]["note"]
    assert "reads parameter #9 over the heads, which stays whole (its heads are KV heads that several ranks hold)" \
        in note, note


# ---- plan() on models of our own


class ScaledAttention(nn.Module):
    """Self-attention with a per-head scale on its output heads; with `read_whole` the scale is
    also summed over the heads into the output, where it must stay whole."""

    def __init__(self, hidden=48, heads=6, read_whole=False):
        super().__init__()
        self.heads, self.read_whole = heads, read_whole
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.head_scale = nn.Parameter(1.0 + 0.1 * torch.randn(heads))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        o = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        o = o * self.head_scale[:, None, None]
        y = self.out(o.transpose(1, 2).reshape(b, t, -1))
        return y + self.head_scale.sum() if self.read_whole else y


class Tiny(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.embed = nn.Embedding(97, 48)
        self.attn = ScaledAttention(**options)
        self.head = nn.Linear(48, 97, bias=False)

    def forward(self, ids):
        return self.head(self.attn(self.embed(ids)))


def _plan(model, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.plan(model, world_size=world_size, example_inputs=(torch.ones(2, 5, dtype=torch.long),))


def test_plan_names_the_split_parameters_and_their_pieces():
    torch.manual_seed(0)
    plan = _plan(Tiny(), 4)
    assert plan.layer("attn.q").style == "column" and plan.layer("attn.out").style == "row"
    (record,) = plan.head_parameters
    assert record.name == "attn.head_scale" and record.dim == 0 and record.size == 6
    # 6 heads over 4 ranks: 2, 2, 1, 1 (numpy's array_split), as the projections split them.
    assert [plan.param_specs(r)["attn.head_scale"].local_size() for r in range(4)] == [2, 2, 1, 1]
    assert plan.held_parameters(3)["attn.head_scale"] == 1
    assert "parameters split with their heads: attn.head_scale" in str(plan)
    assert autoshard.ShardingPlan.from_json(plan.to_json()).head_parameters == plan.head_parameters


def test_plan_says_why_a_parameter_read_whole_keeps_attention_whole():
    torch.manual_seed(0)
    plan = _plan(Tiny(read_whole=True), 2)
    # Not split by heads; unpaired, the projection is split on its features and gathered.
    assert plan.head_parameters == [] and plan.layer("attn.q").style in ("replicate", "column_gather")
    note = plan.layer("attn.q").note
    assert "reads parameter 'attn.head_scale' over the heads, which stays whole (with it split, " in note, note
    assert "reduces over the sharded axis" in note, note
