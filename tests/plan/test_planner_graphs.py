"""The C++ planner on graphs written by hand: each op kind, the JSON document's records, and
each error path with its code. Independent of any model or of the Python capture."""

import json

import pytest
import torch

import autoshard  # noqa: F401  (loads the library)


class G:
    """A graph document in the planner's input format (csrc/plan/graph.h)."""

    def __init__(self):
        self.tensors, self.nodes, self.forced, self.entries, self.exits = [], [], [], [], []
        self.observations = []

    def tensor(self, *shape, param=None, output=False):
        self.tensors.append({"shape": list(shape)})
        if param is not None:
            self.tensors[-1]["param"] = param
        if output:
            self.output(len(self.tensors) - 1)
        return len(self.tensors) - 1

    def output(self, t):
        self.tensors[t]["output"] = True

    def node(self, kind, inputs, outputs, label=None, **fields):
        self.nodes.append({"kind": kind, "label": label or kind + str(len(self.nodes)), "inputs": list(inputs),
                           "outputs": list(outputs), **fields})
        return len(self.nodes) - 1

    def linear(self, x, in_features, out_features, weight, bias=-1, out_shape=None, output=False):
        y = self.tensor(*out_shape, output=output)
        n = self.node("linear", [x], [y], in_features=in_features, out_features=out_features, weight_param=weight,
                      bias_param=bias)
        return n, y

    def document(self, sequence_parallel=True, gather_unpaired=0):
        return json.dumps({"version": 1, "tensors": self.tensors, "nodes": self.nodes, "forced": self.forced,
                           "observations": self.observations, "entries": self.entries, "exits": self.exits, "sequence_parallel": sequence_parallel,
                           "gather_unpaired": gather_unpaired})

    def plan(self, world_size, sequence_parallel=True, gather_unpaired=0):
        return json.loads(torch.ops.autoshard.plan_graph(self.document(sequence_parallel, gather_unpaired), world_size))


def letters(*spec):
    """Einsum weight letters: (letter, role, input dim, output dim) each."""
    return [{"letter": letter, "role": role, "input_dim": i, "output_dim": o} for letter, role, i, o in spec]


def styles(doc):
    return [layer["style"] for layer in doc["layers"]]


def comm(doc, phase):
    return {c["kind"]: c["count"] for c in doc["comm"] if c["phase"] == phase}


def mlp(g, hidden=6, features=8):
    x = g.tensor(2, features)
    _, h = g.linear(x, features, hidden, 0, 1, out_shape=(2, hidden))
    a = g.tensor(2, hidden)
    g.node("pointwise", [h], [a])
    _, y = g.linear(a, hidden, features, 2, 3, out_shape=(2, features))
    return x, h, a, y


def test_document_is_versioned_with_named_records():
    g = G()
    x, h, a, y = mlp(g)
    out = g.tensor(2, 8, output=True)
    g.node("pointwise", [y, x], [out])
    doc = g.plan(2)
    assert doc["version"] == 2
    assert set(doc) == {"version", "layers", "regions", "comm", "partial_gradients", "tensors", "sequence_entries",
                        "sequence_gathers", "sequence_exits", "head_entries", "head_outputs", "attention_weights",
                        "head_params", "gathered_params", "norms", "adapters", "summed_outputs"}
    assert set(doc["layers"][0]) == {"node", "style", "region", "units", "copy_group", "deferred_copy", "parts",
                                     "whole_parts",
                                     "summed_parts", "letter", "repeat",
                                     "reason", "note", "whole_units", "sequence", "sequence_dim", "sequence_region",
                                     "sequence_note"}
    assert styles(doc) == ["column", "row"]
    assert doc["layers"][0]["units"] == 6 and doc["layers"][0]["region"] == doc["layers"][1]["region"]
    assert comm(doc, "forward") == {"all_reduce": 1}
    assert comm(doc, "backward") == {}  # the column layer reads a model input: no gradient to sum
    # h and a are sharded on their last axis; nothing else is.
    assert {(t["tensor"], t["axis"], t["size"]) for t in doc["tensors"]} == {(h, 1, 6), (a, 1, 6)}


def test_world_of_one_communicates_nothing():
    g = G()
    x, _, _, y = mlp(g)
    g.output(y)
    assert g.plan(1)["comm"] == []


def test_heads_view_permute_and_reduce_keep_whole_heads():
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 6, 0, out_shape=(2, 4, 6))
    heads = g.tensor(2, 4, 3, 2)
    g.node("view", [q], [heads])
    t = g.tensor(2, 3, 4, 2)
    g.node("permute", [heads], [t], permutation=[0, 2, 1, 3])
    n = g.tensor(2, 3, 4, 2)
    g.node("reduce", [t], [n], axes=[3])  # a norm over head_dim: fine
    back = g.tensor(2, 4, 3, 2)
    g.node("permute", [n], [back], permutation=[0, 2, 1, 3])
    flat = g.tensor(2, 4, 6)
    g.node("view", [back], [flat])
    _, y = g.linear(flat, 6, 8, 1, out_shape=(2, 4, 8), output=True)
    doc = g.plan(3)
    assert styles(doc) == ["column", "row"] and doc["layers"][0]["units"] == 3
    assert doc["regions"][0]["localize"] == [3, 6]  # head and feature counts seen on the sharded axis
    layout = {t["tensor"]: t for t in doc["tensors"]}
    assert layout[t]["axis"] == 1 and layout[t]["size"] == 3


def test_reduce_over_the_sharded_axis_replicates_with_code():
    g = G()
    x, h, a, y = mlp(g)
    r = g.tensor(2, 6)
    g.node("reduce", [h], [r], axes=[1])
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate"
    assert doc["layers"][0]["reason"] == "conflict" and "reduces over the sharded axis" in doc["layers"][0]["note"]


def _shared_mlp_called_twice(g, x):
    """ALBERT's layout: a projection, then one MLP (weights 2 and 4) called twice, a norm
    (a reduction over the features) after each call."""
    _, h = g.linear(x, 4, 8, 0, out_shape=(3, 8))
    for call in range(2):
        _, up = g.linear(h, 8, 6, 2, out_shape=(3, 6))
        a = g.tensor(3, 6)
        g.node("pointwise", [up], [a])
        _, y = g.linear(a, 6, 8, 4, out_shape=(3, 8))
        h = g.tensor(3, 8, output=call == 1)
        g.node("reduce", [y], [h], axes=[1])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layer_called_twice_splits_alike_in_both_calls(sequence_parallel):
    g = G()
    _shared_mlp_called_twice(g, g.tensor(3, 4))
    doc = g.plan(2, sequence_parallel)
    # Its first call read the projection's sharded output as a row layer, its second a whole
    # input as a column layer: the projection is replicated, and both calls split alike.
    assert styles(doc) == ["replicate", "column", "row", "column", "row"]
    assert doc["layers"][0]["reason"] == "feeds_called_layer"
    assert "called elsewhere as a column layer" in doc["layers"][0]["note"]
    # A layer called twice has one input copy for both calls: its tokens stay whole.
    assert [layer["sequence"] for layer in doc["layers"]] == [""] * 5
    assert comm(doc, "forward") == {"all_reduce": 2} and comm(doc, "backward") == {"all_reduce": 2}


def test_layer_called_twice_as_a_row_layer_keeps_its_split():
    g = G()
    x = g.tensor(3, 8)
    _, h = g.linear(x, 8, 6, 0, out_shape=(3, 6))
    for call in range(2):  # one row layer (weight 2) reading two halves' worth of features
        y = g.tensor(3, 8)
        g.node("linear", [h], [y], in_features=6, out_features=8, weight_param=2, bias_param=-1)
    doc = g.plan(2, sequence_parallel=False)
    assert styles(doc) == ["column", "row", "row"]


def test_too_few_units_with_code_and_count():
    g = G()
    mlp(g, hidden=3)
    doc = g.plan(4)
    # The second layer's input is then replicated: it starts a region of its own.
    assert styles(doc) == ["replicate", "column_gather"] or styles(doc)[:1] == ["replicate"]
    assert doc["layers"][0]["reason"] == "too_few_units" and doc["layers"][0]["whole_units"] == 3


def test_sharded_model_output_is_gathered():
    g = G()
    x = g.tensor(2, 8)
    g.linear(x, 8, 10, 0, out_shape=(2, 10), output=True)
    doc = g.plan(2)
    assert styles(doc) == ["column_gather"] and doc["layers"][0]["reason"] == "model_output"
    assert comm(doc, "forward") == {"all_gather": 1}


def test_overrides_carry_their_code():
    g = G()
    mlp(g)
    g.forced.append({"node": 0, "style": "replicate"})
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["layers"][0]["reason"] == "override_replicate"
    assert styles(doc)[1] != "row"


@pytest.mark.parametrize("kind", ["shape_mismatch", "dry_run_mismatch"])
def test_an_observed_layer_is_held_whole_by_the_planner_saying_why(kind):
    """The Python layer reports what a module computed; the planner decides the style, the reason
    code and the note, and the rest of the plan around it (the row layer it fed is no longer paired)."""
    g = G()
    mlp(g)
    assert styles(g.plan(2)) == ["column", "row"]
    g.observations.append({"node": 0, "kind": kind, "detail": "plan: fc1 computes [2, 4, 8] where [2, 4, 4] is planned"})
    layer = g.plan(2)["layers"][0]
    assert (layer["style"], layer["reason"]) == ("replicate", kind)
    assert layer["note"] == "replicated: fc1 computes [2, 4, 8] where [2, 4, 4] is planned"
    assert styles(g.plan(2))[1] != "row"


def test_an_observation_of_another_kind_is_refused():
    g = G()
    mlp(g)
    g.observations.append({"node": 0, "kind": "slow", "detail": ""})
    with pytest.raises(ValueError, match="observation 0 must be of kind 'shape_mismatch' or 'dry_run_mismatch'"):
        g.plan(2)
    g.observations[0] = {"node": 99, "kind": "shape_mismatch", "detail": ""}
    with pytest.raises(ValueError, match="an observation names node 99, which is not a layer"):
        g.plan(2)


def test_token_embedding_is_vocab_parallel():
    g = G()
    ids = g.tensor(2, 5)
    e = g.tensor(2, 5, 8)
    g.node("embedding", [ids], [e], num_embeddings=11, embedding_dim=8, weight_param=0)
    doc = g.plan(2)
    assert styles(doc) == ["vocab"] and doc["layers"][0]["units"] == 11
    assert comm(doc, "forward") == {"all_reduce": 1}


def test_einsum_splits_its_output_letter_then_contracts_it():
    g = G()
    x = g.tensor(2, 4, 8)
    h = g.tensor(2, 4, 3, 2)
    # "btd,dnh->btnh": d contracted (input dim 2), n and h output letters (output dims 2 and 3)
    g.node("einsum", [x], [h], weight_param=0, bias_param=-1,
           letters=letters(("d", "contracted", 2, -1), ("n", "output", -1, 2), ("h", "output", -1, 3)))
    y = g.tensor(2, 4, 8, output=True)
    # "btnh,nhd->btd": n and h contracted (input dims 2, 3), d output (dim 2)
    g.node("einsum", [h], [y], weight_param=1, bias_param=-1,
           letters=letters(("n", "contracted", 2, -1), ("h", "contracted", 3, -1), ("d", "output", -1, 2)))
    doc = g.plan(3)
    assert styles(doc) == ["column", "row"]
    assert [layer["letter"] for layer in doc["layers"]] == ["n", "n"] and doc["layers"][0]["units"] == 3


def test_fused_output_split_part_by_part():
    g = G()
    x = g.tensor(2, 8)
    _, qkv = g.linear(x, 8, 12, 0, out_shape=(2, 12))
    parts = [g.tensor(2, 4) for _ in range(3)]
    g.node("split", [qkv], parts, dim=1)
    s = g.tensor(2, 4)
    g.node("pointwise", parts, [s])
    g.linear(s, 4, 8, 1, out_shape=(2, 8), output=True)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"] and doc["layers"][0]["parts"] == [4, 4, 4]


def _sliced_into_parts(ranges, partition):
    """A fused layer's output sliced by `ranges` along its features, each slice marked with
    `partition` (as the capture marks slices that cover the axis), then a row layer."""
    g = G()
    x = g.tensor(2, 8)
    _, qkv = g.linear(x, 8, 12, 0, out_shape=(2, 12))
    pieces = []
    for part, (start, stop) in enumerate(ranges):
        pieces.append(g.tensor(2, stop - start))
        g.node("slice", [qkv], [pieces[-1]], dim=1, start=start, stop=stop, drop_dim=False,
               **({"partition": partition, "part": part} if partition else {}))
    s = g.tensor(2, 4)
    g.node("pointwise", pieces, [s])
    g.linear(s, 4, 8, 1, out_shape=(2, 8), output=True)
    return g.plan(2)


def test_slices_covering_a_fused_output_are_its_parts():
    doc = _sliced_into_parts([(0, 4), (4, 8), (8, 12)], [4, 4, 4])
    assert styles(doc) == ["column", "row"] and doc["layers"][0]["parts"] == [4, 4, 4]


def test_slices_not_marked_as_a_partition_keep_the_layer_whole():
    doc = _sliced_into_parts([(0, 4), (4, 8), (8, 12)], None)
    assert styles(doc)[0] == "replicate" and "slices the sharded axis" in doc["layers"][0]["note"]


def test_slices_into_other_parts_than_before_keep_the_layer_whole():
    g = G()
    x = g.tensor(2, 8)
    _, qkv = g.linear(x, 8, 12, 0, out_shape=(2, 12))
    a, b, c = g.tensor(2, 4), g.tensor(2, 8), g.tensor(2, 4)
    g.node("slice", [qkv], [a], dim=1, start=0, stop=4, drop_dim=False, partition=[4, 8], part=0)
    g.node("slice", [qkv], [b], dim=1, start=4, stop=12, drop_dim=False, partition=[4, 8], part=1)
    g.node("slice", [qkv], [c], dim=1, start=8, stop=12, drop_dim=False, partition=[4, 4, 4], part=2)
    s = g.tensor(2, 4)
    g.node("pointwise", [a, c], [s])
    g.linear(s, 4, 8, 1, out_shape=(2, 8), output=True)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and "other parts" in doc["layers"][0]["note"], doc["layers"][0]


@pytest.mark.parametrize("kind,fields,why", [
    ("cat", {"dim": 1}, "concatenates along the sharded axis"),
    ("slice", {"dim": 1, "start": 0, "stop": 2, "drop_dim": False}, "slices the sharded axis"),
    ("opaque", {}, "cannot follow"),
])
def test_ops_that_need_the_axis_whole(kind, fields, why):
    g = G()
    x, h, a, y = mlp(g)
    out = g.tensor(2, 12 if kind == "cat" else 2 if kind == "slice" else 6)
    # A cat of the sharded output with a tensor held whole, along the split axis.
    g.node(kind, [h, g.tensor(2, 6)] if kind == "cat" else [h], [out], **fields)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and why in doc["layers"][0]["note"], doc["layers"][0]


def concatenated_projections(g, read_as_one=False, per_channel=None):
    """Two column layers (widths 6 and 12, 3 heads each) concatenated along their features, an
    elementwise op (with a parameter over all 18 channels: `per_channel`), then either split into
    the same parts, the second part read by a row layer, or read as one by a row layer."""
    x = g.tensor(2, 8)
    _, q = g.linear(x, 8, 6, 0, out_shape=(2, 6))
    _, v = g.linear(x, 8, 12, 1, out_shape=(2, 12))
    joined = g.tensor(2, 18)
    g.node("cat", [q, v], [joined], dim=1)
    mixed = g.tensor(2, 18)
    g.node("pointwise", [joined] + ([g.tensor(18, param=per_channel)] if per_channel is not None else []), [mixed])
    if read_as_one:
        return g.linear(mixed, 18, 8, 2, out_shape=(2, 8), output=True)
    q_part, v_part = g.tensor(2, 6), g.tensor(2, 12)
    g.node("split", [mixed], [q_part, v_part], dim=1)
    return g.linear(v_part, 12, 8, 2, out_shape=(2, 8), output=True)


def test_concatenated_outputs_split_into_their_parts_stay_split():
    g = G()
    concatenated_projections(g, per_channel=5)
    doc = g.plan(2)
    assert styles(doc) == ["column", "column", "row"], doc["layers"]
    # The parameter over the concatenation splits part by part: each rank holds its heads of both.
    assert [(p["param"], p["parts"]) for p in doc["head_params"]] == [(5, [6, 12])]


def test_concatenated_outputs_read_as_one_keep_the_layers_whole():
    g = G()
    concatenated_projections(g, read_as_one=True)
    doc = g.plan(2)
    assert styles(doc)[:2] == ["replicate", "replicate"], doc["layers"]
    assert "reads a concatenation of split outputs as one" in doc["layers"][0]["note"], doc["layers"][0]


def heads_block(g, scale_shape=None, scale_param=None, matmul_param=None):
    """A column layer split on 3 heads of 2, something applied per head, then a row layer."""
    x = g.tensor(2, 8)
    _, q = g.linear(x, 8, 6, 0, out_shape=(2, 6))
    heads = g.tensor(2, 3, 2)
    g.node("view", [q], [heads])
    cur, w = heads, None
    if scale_param is not None:
        w = g.tensor(*scale_shape, param=scale_param)
        scaled = g.tensor(2, 3, 2)
        g.node("pointwise", [cur, w], [scaled])
        cur = scaled
    if matmul_param is not None:
        w = g.tensor(2, 2, param=matmul_param)
        mixed = g.tensor(2, 3, 2)
        g.node("matmul", [cur, w], [mixed])
        cur = mixed
    flat = g.tensor(2, 6)
    g.node("view", [cur], [flat])
    _, y = g.linear(flat, 6, 8, 1, out_shape=(2, 8), output=True)
    return x, y, w


def test_replicated_parameter_inside_a_region_has_a_partial_gradient():
    g = G()
    heads_block(g, scale_shape=(2,), scale_param=5)
    doc = g.plan(3)
    assert styles(doc) == ["column", "row"]
    assert doc["partial_gradients"] == [{"params": [5], "elements": 2}]
    assert comm(doc, "backward") == {"all_reduce": 1}  # the partial gradient's sum


def test_replicated_weight_times_sharded_heads_has_a_partial_gradient():
    g = G()
    heads_block(g, matmul_param=7)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"] and doc["partial_gradients"] == [{"params": [7], "elements": 4}]


def test_partial_gradients_share_one_bucket():
    g = G()
    heads_block(g, scale_shape=(2,), scale_param=5, matmul_param=7)
    doc = g.plan(2)
    assert doc["partial_gradients"] == [{"params": [7, 5], "elements": 6}]
    assert comm(doc, "backward") == {"all_reduce": 1}


def test_parameter_also_used_outside_the_region_replicates_it():
    g = G()
    x, y, w = heads_block(g, scale_shape=(2,), scale_param=5)
    # The same parameter also scales a replicated tensor that reaches the output.
    other = g.tensor(2, 2)
    src = g.tensor(2, 2)
    g.node("source", [], [src])
    g.node("pointwise", [src, w], [other])
    g.output(other)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and styles(doc)[1] != "row" and doc["partial_gradients"] == []
    assert doc["layers"][0]["reason"] == "conflict" and "partly partial" in doc["layers"][0]["note"]


def test_per_head_parameter_on_the_heads_axis_is_split_with_them():
    # Each rank holds its heads' rows of the scale (test_head_parameters.py has the other layouts).
    g = G()
    _, _, w = heads_block(g, scale_shape=(3, 1), scale_param=5)
    doc = g.plan(3)
    assert styles(doc) == ["column", "row"] and doc["partial_gradients"] == []
    region = doc["layers"][0]["region"]
    assert doc["head_params"] == [{"tensor": w, "param": 5, "axis": 0, "size": 3, "region": region, "layer": -1,
                                  "parts": []}]


def attention_returning_weights(g, average=True, read=False):
    """Attention of 4 heads of 2 computed with its weights (softmax of q k^T), which an
    nn.MultiheadAttention returns (averaged over the heads, or per head): the weights node, and
    the tensor it returns (read by a pointwise op whose result is an output, if `read`)."""
    x = g.tensor(2, 4, 8)
    heads = []
    for param in range(3):
        _, y = g.linear(x, 8, 8, param, out_shape=(2, 4, 8))
        split, t = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 4, 2)
        g.node("view", [y], [split])
        g.node("permute", [split], [t], permutation=[0, 2, 1, 3])
        heads.append(t)
    q, k, v = heads
    kt, scores, weights = g.tensor(2, 4, 2, 4), g.tensor(2, 4, 4, 4), g.tensor(2, 4, 4, 4)
    g.node("permute", [k], [kt], permutation=[0, 1, 3, 2])
    g.node("matmul", [q, kt], [scores])
    g.node("reduce", [scores], [weights], axes=[3])
    returned = g.tensor(2, 4, 4) if average else g.tensor(2, 4, 4, 4)
    node = g.node("attention_weights", [weights], [returned], label="attn", dim=1, average=average)
    o, ot, flat = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 4, 2), g.tensor(2, 4, 8)
    g.node("matmul", [weights, v], [o])
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    g.node("view", [ot], [flat])
    g.linear(flat, 8, 8, 3, out_shape=(2, 4, 8), output=True)
    if read:
        used = g.tensor(*g.tensors[returned]["shape"], output=True)
        g.node("pointwise", [returned], [used])
    return node, returned


@pytest.mark.parametrize("world_size", [2, 4])
def test_averaged_attention_weights_never_read_split_with_no_collective(world_size):
    g = G()
    node, _ = attention_returning_weights(g)
    doc = g.plan(world_size)
    assert styles(doc) == ["column", "column", "column", "row"]
    assert [(w["node"], w["used"]) for w in doc["attention_weights"]] == [(node, False)]
    assert doc["attention_weights"][0]["region"] == doc["layers"][0]["region"]
    assert comm(doc, "forward") == {"all_reduce": 1}  # the row layer's


@pytest.mark.parametrize("read_by", ["an op", "the output"])
def test_averaged_attention_weights_read_cost_one_forward_all_reduce(read_by):
    g = G()
    node, returned = attention_returning_weights(g, read=read_by == "an op")
    if read_by == "the output":
        g.output(returned)
    doc = g.plan(2)
    assert styles(doc) == ["column", "column", "column", "row"]
    assert [(w["node"], w["used"]) for w in doc["attention_weights"]] == [(node, True)]
    forward = [c for c in doc["comm"] if c["phase"] == "forward"]
    assert forward == [{"phase": "forward", "kind": "all_reduce", "count": 2, "elements": 2 * 4 * 8 + 2 * 4 * 4}]
    assert comm(doc, "backward") == {}  # its gradient reaches each rank's heads as it is
    assert g.plan(1)["comm"] == [] and g.plan(1)["attention_weights"][0]["used"]


def test_attention_weights_per_head_read_keep_the_attention_whole():
    g = G()
    attention_returning_weights(g, average=False, read=True)
    doc = g.plan(2)
    # The q, k and v projections whole (the last layer, fed whole, gathers the model output).
    assert styles(doc)[:3] == ["replicate"] * 3 and doc["attention_weights"] == []
    assert "per head" in doc["layers"][0]["note"] and "reads them" in doc["layers"][0]["note"]
    unread = G()
    node, _ = attention_returning_weights(unread, average=False)
    doc = unread.plan(2)
    assert styles(doc) == ["column", "column", "column", "row"]
    assert [(w["node"], w["used"]) for w in doc["attention_weights"]] == [(node, False)]


def test_attention_weights_node_needs_its_fields():
    g = G()
    x, y = g.tensor(2, 4, 4, 4), g.tensor(2, 4, 4)
    g.node("attention_weights", [x], [y], dim=1)
    with pytest.raises(ValueError, match=r"\[plan.bad_graph\].*no field 'average'"):
        g.plan(2)


def test_grouped_query_attention_shares_kv_heads():
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 8, 0, out_shape=(2, 4, 8))   # 4 query heads of 2
    _, k = g.linear(x, 8, 4, 1, out_shape=(2, 4, 4))   # 2 KV heads of 2
    _, v = g.linear(x, 8, 4, 2, out_shape=(2, 4, 4))
    qh, kh, vh = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 2, 2), g.tensor(2, 4, 2, 2)
    g.node("view", [q], [qh])
    g.node("view", [k], [kh])
    g.node("view", [v], [vh])
    qt, kt, vt = g.tensor(2, 4, 4, 2), g.tensor(2, 2, 4, 2), g.tensor(2, 2, 4, 2)
    for a, b in ((qh, qt), (kh, kt), (vh, vt)):
        g.node("permute", [a], [b], permutation=[0, 2, 1, 3])
    o = g.tensor(2, 4, 4, 2)
    g.node("attention", [qt, kt, vt], [o])
    ot = g.tensor(2, 4, 4, 2)
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    flat = g.tensor(2, 4, 8)
    g.node("view", [ot], [flat])
    g.linear(flat, 8, 8, 3, out_shape=(2, 4, 8), output=True)
    doc = g.plan(4)  # 4 query heads over 4 ranks, 2 KV heads: each KV head on two ranks
    assert styles(doc) == ["column", "column", "column", "row"]
    assert [layer["repeat"] for layer in doc["layers"]] == [0, 2, 2, 0]
    assert doc["regions"][0]["coarse_units"] == 2
    assert any(t["coarse"] for t in doc["tensors"])


def test_attention_refuses_kv_heads_tiled_as_an_outer_factor():
    """k.repeat(1, 2, 1, 1) of 2 KV heads gives 4 heads laid out [repeat][kv] (query head h
    reads KV head h % 2): no contiguous split of the query heads pairs them on one rank, so the
    attention is replicated rather than paired head by head."""
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 8, 0, out_shape=(2, 4, 8))   # 4 query heads of 2
    _, k = g.linear(x, 8, 4, 1, out_shape=(2, 4, 4))   # 2 KV heads of 2
    _, v = g.linear(x, 8, 4, 2, out_shape=(2, 4, 4))
    qh, qt = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 4, 2)
    g.node("view", [q], [qh])
    g.node("permute", [qh], [qt], permutation=[0, 2, 1, 3])
    tiled = []
    for source in (k, v):  # (batch, tokens, 2 * 2) -> (batch, 2 heads, tokens, 2), tiled to 4 heads
        heads, moved = g.tensor(2, 4, 2, 2), g.tensor(2, 2, 4, 2)
        spread, grown, merged = g.tensor(2, 1, 2, 4, 2), g.tensor(2, 2, 2, 4, 2), g.tensor(2, 4, 4, 2)
        g.node("view", [source], [heads])
        g.node("permute", [heads], [moved], permutation=[0, 2, 1, 3])
        g.node("view", [moved], [spread], label="aten.repeat.default")
        g.node("expand", [spread], [grown], label="aten.repeat.default")
        g.node("view", [grown], [merged], label="aten.repeat.default")
        tiled.append(merged)
    o = g.tensor(2, 4, 4, 2)
    g.node("attention", [qt, tiled[0], tiled[1]], [o], label="sdpa")
    ot, flat = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 8)
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    g.node("view", [ot], [flat])
    g.linear(flat, 8, 8, 3, out_shape=(2, 4, 8), output=True)
    doc = g.plan(2)
    assert styles(doc)[:3] == ["replicate", "replicate", "replicate"], styles(doc)
    assert "sdpa pairs heads laid out differently" in doc["layers"][0]["note"]


def _document(tensors=(), nodes=(), forced=(), version=1):
    return json.dumps({"version": version, "tensors": [{"shape": list(t)} for t in tensors], "nodes": list(nodes),
                       "forced": list(forced)})


def _pointwise(inputs, outputs):
    return {"kind": "pointwise", "label": "p", "inputs": inputs, "outputs": outputs}


@pytest.mark.parametrize("document,world,code,field", [
    (_document(), 0, "[plan.world_size]", ""),
    ("tensor 0 1 4", 2, "[plan.bad_graph]", "not valid JSON"),
    (_document(version=2), 2, "[plan.bad_graph]", "version 2"),
    (_document(nodes=[{"kind": "nonsense", "label": "x", "inputs": [], "outputs": []}]), 2, "[plan.bad_graph]",
     "unknown node kind 'nonsense'"),
    (_document([(4,)], [_pointwise([3], [0])]), 2, "[plan.bad_graph]", "node 0 reads undeclared tensor 3"),
    (_document([(4,)], [{"kind": "pointwise", "label": "p", "inputs": [0]}]), 2, "[plan.bad_graph]",
     "node 0 has no field 'outputs'"),
    (_document([(4,), (4,)], [{"kind": "linear", "label": "l", "inputs": [0], "outputs": [1], "in_features": 4,
                               "out_features": "4", "weight_param": 0}]), 2, "[plan.bad_graph]",
     "field 'out_features' has the wrong type"),
    (_document([(4,), (4,)], [_pointwise([0], [1])], [{"node": 0, "style": "replicate"}]), 2,
     "[plan.override_not_layer]", ""),
    (_document(forced=[{"node": 0, "style": "shard"}]), 2, "[plan.bad_override]", "'shard'"),
    (_document([(4,), (4,)], [{"kind": "einsum", "label": "e", "inputs": [0], "outputs": [1], "weight_param": 0,
                               "letters": [{"letter": "dd", "role": "output", "input_dim": -1, "output_dim": 0}]}]),
     2, "[plan.bad_graph]", "'letter' must be one character"),
])
def test_errors_carry_codes_and_name_the_field(document, world, code, field):
    with pytest.raises(ValueError) as error:
        torch.ops.autoshard.plan_graph(document, world)
    assert code in str(error.value) and field in str(error.value), str(error.value)


def bias_block(g, bias_param=None, entry=True, module="attn"):
    """Heads split 3 ways with a bias over the heads added to them (ALiBi): the bias is made
    outside the attention "attn" (from positions, or from a parameter) and received by `module`."""
    source = g.tensor(3, 2, param=bias_param)
    if bias_param is None:
        g.node("source", [], [source])
    bias = g.tensor(3, 2)
    g.node("pointwise", [source], [bias])
    x = g.tensor(2, 8)
    first = len(g.nodes)
    nq, q = g.linear(x, 8, 6, 0, out_shape=(2, 6))
    heads = g.tensor(2, 3, 2)
    g.node("view", [q], [heads])
    biased = g.tensor(2, 3, 2)
    g.node("pointwise", [heads, bias], [biased])
    flat = g.tensor(2, 6)
    g.node("view", [biased], [flat])
    no, y = g.linear(flat, 6, 8, 1, out_shape=(2, 8), output=True)
    g.nodes[nq]["label"], g.nodes[no]["label"] = "attn.q", "attn.o"
    if entry:
        g.entries.append({"tensor": bias, "first": first, "end": len(g.nodes), "leaf": 1, "module": module})
    return bias


def test_bias_over_the_heads_is_cut_where_the_attention_receives_it():
    g = G()
    bias = bias_block(g)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"]
    region = doc["layers"][0]["region"]
    assert doc["head_entries"] == [{"tensor": bias, "module": "attn", "leaf": 1, "axis": 0, "outer": 1, "size": 3,
                                    "region": region}]
    assert bias not in [t["tensor"] for t in doc["tensors"]]  # held whole where it is made
    # The cut communicates nothing (no gradient reaches the bias; x is a model input).
    assert comm(doc, "forward") == {"all_reduce": 1} and comm(doc, "backward") == {}


def test_bias_without_an_entry_keeps_attention_whole():
    # A bias made from a parameter is split with the heads instead (test_head_parameters.py).
    g = G()
    bias_block(g, entry=False)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["head_entries"] == [] and doc["head_params"] == []
    assert "replicated tensor" in doc["layers"][0]["note"]


def test_bias_received_by_a_module_other_than_the_attention_is_not_cut():
    # A module inside the attention (its projections outside it), or a block around it: the
    # attention's attributes could not be made local from a cut input there.
    for module in ("attn.core", "block"):
        g = G()
        bias_block(g, module=module)
        doc = g.plan(2)
        assert styles(doc)[0] == "replicate" and doc["head_entries"] == []


def test_one_bias_for_two_attentions_is_cut_at_each():
    g = G()
    source = g.tensor(3, 2)
    g.node("source", [], [source])
    x = g.tensor(2, 8)
    for block in range(2):
        first = len(g.nodes)
        nq, q = g.linear(x, 8, 6, 2 * block, out_shape=(2, 6))
        heads, biased, flat = g.tensor(2, 3, 2), g.tensor(2, 3, 2), g.tensor(2, 6)
        g.node("view", [q], [heads])
        g.node("pointwise", [heads, source], [biased])
        g.node("view", [biased], [flat])
        no, x = g.linear(flat, 6, 8, 2 * block + 1, out_shape=(2, 8), output=block == 1)
        g.nodes[nq]["label"], g.nodes[no]["label"] = f"attn{block}.q", f"attn{block}.o"
        g.entries.append({"tensor": source, "first": first, "end": len(g.nodes), "leaf": 1, "module": f"attn{block}"})
    doc = g.plan(3)
    assert styles(doc) == ["column", "row", "column", "row"]
    assert [e["module"] for e in doc["head_entries"]] == ["attn0", "attn1"]


def test_multi_query_attention_holds_its_one_kv_head_on_every_rank():
    g = G()
    x = g.tensor(2, 4, 8)
    _, q = g.linear(x, 8, 8, 0, out_shape=(2, 4, 8))   # 4 query heads of 2
    _, k = g.linear(x, 8, 2, 1, out_shape=(2, 4, 2))   # 1 KV head of 2
    _, v = g.linear(x, 8, 2, 2, out_shape=(2, 4, 2))
    qh, kh, vh = g.tensor(2, 4, 4, 2), g.tensor(2, 4, 1, 2), g.tensor(2, 4, 1, 2)
    # A view given its sizes spells the one KV head as a dimension of length 1.
    for a, b in ((q, qh), (k, kh), (v, vh)):
        g.node("view", [a], [b], label="aten.view.default")
    qt, kt, vt = g.tensor(2, 4, 4, 2), g.tensor(2, 1, 4, 2), g.tensor(2, 1, 4, 2)
    for a, b in ((qh, qt), (kh, kt), (vh, vt)):
        g.node("permute", [a], [b], permutation=[0, 2, 1, 3])
    o = g.tensor(2, 4, 4, 2)
    g.node("attention", [qt, kt, vt], [o])
    ot = g.tensor(2, 4, 4, 2)
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    flat = g.tensor(2, 4, 8)
    g.node("view", [ot], [flat], label="aten.view.default")
    g.linear(flat, 8, 8, 3, out_shape=(2, 4, 8), output=True)
    doc = g.plan(3)
    assert styles(doc) == ["column", "column", "column", "row"]
    assert [layer["repeat"] for layer in doc["layers"]] == [0, 4, 4, 0]
    assert doc["regions"][0]["coarse_units"] == 1
    # Each rank sums the KV projections' gradients (weights only: no biases) in backward.
    assert comm(doc, "backward") == {"all_reduce": 2}


def fused_kv_block(g, kv_heads):
    """GPT-BigCode's layout: one Linear for 6 query heads of 2 and `kv_heads` KV heads (k, then
    v), split into its three parts; the KV heads repeated for the query heads (unsqueeze, expand
    and view, as repeat_kv does) before the attention."""
    x = g.tensor(2, 4, 8)
    kv = 2 * kv_heads
    _, fused = g.linear(x, 8, 12 + 2 * kv, 0, out_shape=(2, 4, 12 + 2 * kv))
    q, k, v = g.tensor(2, 4, 12), g.tensor(2, 4, kv), g.tensor(2, 4, kv)
    g.node("split", [fused], [q, k, v], dim=2)
    qh = g.tensor(2, 4, 6, 2)
    g.node("view", [q], [qh], label="aten.view.default")
    qt = g.tensor(2, 6, 4, 2)
    g.node("permute", [qh], [qt], permutation=[0, 2, 1, 3])
    repeated = []
    for t in (k, v):
        heads = g.tensor(2, 4, kv_heads, 2)
        g.node("view", [t], [heads], label="aten.view.default")
        ht = g.tensor(2, kv_heads, 4, 2)
        g.node("permute", [heads], [ht], permutation=[0, 2, 1, 3])
        unit = g.tensor(2, kv_heads, 1, 4, 2)
        g.node("view", [ht], [unit], label="aten.unsqueeze.default")
        wide = g.tensor(2, kv_heads, 6 // kv_heads, 4, 2)
        g.node("expand", [unit], [wide], label="aten.expand.default")
        flat = g.tensor(2, 6, 4, 2)
        g.node("view", [wide], [flat], label="aten.view.default")
        repeated.append(flat)
    o = g.tensor(2, 6, 4, 2)
    g.node("attention", [qt, *repeated], [o])
    ot = g.tensor(2, 4, 6, 2)
    g.node("permute", [o], [ot], permutation=[0, 2, 1, 3])
    merged = g.tensor(2, 4, 12)
    g.node("view", [ot], [merged], label="aten.view.default")
    g.linear(merged, 12, 8, 1, out_shape=(2, 4, 8), output=True)


def test_fused_layer_holds_its_one_kv_head_whole_on_every_rank():
    g = G()
    fused_kv_block(g, kv_heads=1)
    doc = g.plan(3)
    fused, out = doc["layers"]
    assert (fused["style"], fused["units"], fused["parts"]) == ("column", 6, [12, 2, 2])
    assert fused["whole_parts"] == [1, 2] and fused["summed_parts"] and fused["reason"] == "small_parts_whole"
    assert out["style"] == "row"
    # The fused output: 12 of its 16 features split by heads, 4 held whole.
    assert {(t["axis"], t["size"], t["whole"]) for t in doc["tensors"] if t["whole"]} == {(2, 16, 4)}
    # The KV rows' gradient (weight only, no bias) is summed in backward: 4 rows of 8.
    assert comm(doc, "backward") == {"all_reduce": 1}
    assert [c["elements"] for c in doc["comm"] if c["phase"] == "backward"] == [4 * 8]


def test_fused_layer_with_kv_heads_it_cannot_hold_whole_is_replicated():
    g = G()
    fused_kv_block(g, kv_heads=2)  # 2 KV heads: 3 ranks cannot split them, nor repeat them whole locally
    doc = g.plan(3)
    assert styles(doc)[0] == "replicate" and doc["layers"][0]["whole_parts"] == []
    # On 2 ranks the KV heads split with the query heads, as for any fused layer.
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"] and doc["layers"][0]["whole_parts"] == []


def test_embedding_over_the_heads_has_its_output_cut():
    g = G()
    ids = g.tensor(4, 4)
    table = g.tensor(4, 4, 3)  # (queries, keys, heads)
    g.node("embedding", [ids], [table], num_embeddings=7, embedding_dim=3, weight_param=9)
    moved = g.tensor(3, 4, 4)
    g.node("permute", [table], [moved], permutation=[2, 0, 1])
    tokens, x = g.tensor(4), g.tensor(4, 6)
    g.node("embedding", [tokens], [x], num_embeddings=50, embedding_dim=6, weight_param=8)  # the token table
    _, q = g.linear(x, 6, 6, 0, out_shape=(4, 6))
    split, heads = g.tensor(4, 3, 2), g.tensor(3, 4, 2)
    g.node("view", [q], [split], label="aten.view.default")
    g.node("permute", [split], [heads], permutation=[1, 0, 2])
    scores = g.tensor(3, 4, 4)
    g.node("matmul", [heads, g.tensor(2, 4)], [scores])
    biased = g.tensor(3, 4, 4)
    g.node("pointwise", [scores, moved], [biased])
    mixed, back = g.tensor(3, 4, 2), g.tensor(4, 3, 2)
    g.node("matmul", [biased, g.tensor(4, 2)], [mixed])
    g.node("permute", [mixed], [back], permutation=[1, 0, 2])
    flat = g.tensor(4, 6)
    g.node("view", [back], [flat], label="aten.view.default")
    g.linear(flat, 6, 6, 1, out_shape=(4, 6), output=True)
    doc = g.plan(3, sequence_parallel=False)
    assert styles(doc) == ["replicate", "vocab", "column", "row"], [l["note"] for l in doc["layers"]]
    assert [(e["module"], e["axis"], e["size"]) for e in doc["head_outputs"]] == [("embedding0", 2, 3)]
    # The cut's backward gathers the table's gradient whole: one all-gather, no partial sum.
    assert comm(doc, "backward").get("all_gather") == 1 and doc["partial_gradients"] == []


# ---- rules the planner took over: layers split together, gradient flow, routing, adapters, regions


def _mlp(g, out_shape=(2, 8)):
    x = g.tensor(2, 8)
    up, h = g.linear(x, 8, 16, weight=0, out_shape=(2, 16))
    act = g.tensor(2, 16)
    g.node("pointwise", [h], [act])
    down, y = g.linear(act, 16, 8, weight=1, out_shape=out_shape, output=True)
    return x, up, down, y


def test_layers_split_together_are_forced_whole_together():
    g = G()
    _, up, down, _ = _mlp(g)
    assert styles(g.plan(2)) == ["column", "row"]
    # A row layer that must pair with an unrelated first layer: both whole, with the reason.
    g2 = G()
    x = g2.tensor(2, 8)
    a, ya = g2.linear(x, 8, 8, weight=0, out_shape=(2, 8))
    b, yb = g2.linear(ya, 8, 8, weight=1, out_shape=(2, 8), output=True)
    c, yc = g2.linear(x, 8, 8, weight=2, out_shape=(2, 8), output=True)
    doc = json.loads(torch.ops.autoshard.plan_graph(
        json.dumps({**json.loads(g2.document()), "together": [[c, b]]}), 2))
    by_node = {layer["node"]: layer for layer in doc["layers"]}
    assert by_node[c]["style"] == by_node[b]["style"] == "replicate"
    assert by_node[b]["reason"] == "attention_unpaired" and "split only together" in by_node[b]["note"]


def test_frozen_layers_and_dropped_outputs_issue_no_backward_collectives():
    g = G()
    x, up, down, y = _mlp(g)
    trained = comm(g.plan(2), "backward")
    # The input copy of the first column layer: the model input needs no gradient.
    assert trained == {}
    # A layer after a trained one: its input copy all-reduces in backward...
    g = G()
    x = g.tensor(2, 8)
    first, h = g.linear(x, 8, 8, weight=0, out_shape=(2, 8))
    second, h2 = g.linear(h, 8, 16, weight=1, out_shape=(2, 16))
    act = g.tensor(2, 16)
    g.node("pointwise", [h2], [act])
    g.linear(act, 16, 8, weight=2, out_shape=(2, 8), output=True)
    doc = json.loads(g.document(sequence_parallel=False))
    assert comm(json.loads(torch.ops.autoshard.plan_graph(json.dumps(doc), 2)), "backward") == {"all_reduce": 1}
    # ... unless nothing before it is trained (frozen layers, recorded as such) ...
    frozen = dict(doc, nodes=[dict(n, trainable=False) if i in (first, second) else n
                              for i, n in enumerate(doc["nodes"])])
    assert comm(json.loads(torch.ops.autoshard.plan_graph(json.dumps(frozen), 2)), "backward") == {}
    # ... or its output reaches no model output (backward never reaches it).
    dropped = dict(doc, tensors=[{k: v for k, v in t.items() if k != "output"} for t in doc["tensors"]])
    dropped["tensors"][h]["output"] = True
    assert comm(json.loads(torch.ops.autoshard.plan_graph(json.dumps(dropped), 2)), "backward") == {}


def test_experts_routing_weights_get_one_backward_all_reduce_each():
    g = G()
    x = g.tensor(4, 8)
    _, h = g.linear(x, 8, 16, weight=0, out_shape=(4, 16))
    act = g.tensor(4, 16)
    g.node("pointwise", [h], [act])
    _, down = g.linear(act, 16, 8, weight=1, out_shape=(4, 8))
    routing, indices, out = g.tensor(4, 2), g.tensor(4, 2), g.tensor(4, 8, output=True)
    g.node("opaque", [down, routing, indices], [out], routing_floating=[True, False])
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"]
    assert comm(doc, "backward") == {"all_reduce": 1} and comm(doc, "forward") == {"all_reduce": 1}
    assert comm(g.plan(1), "backward") == {}


def test_lora_factors_split_with_their_base_layer():
    g = G()
    x, up, down, _ = _mlp(g)
    doc = json.loads(g.document())
    doc["nodes"][up]["adapters"] = [{"a": 2, "b": 3, "a_shape": [4, 8], "b_shape": [16, 4]}]
    doc["nodes"][down]["adapters"] = [{"a": 4, "b": 5, "a_shape": [4, 16], "b_shape": [8, 4], "b_trainable": False}]
    plan = json.loads(torch.ops.autoshard.plan_graph(json.dumps(doc), 2))
    assert [(a["node"], a["split"], a["whole"]) for a in plan["adapters"]] == [(up, [3], [2]), (down, [4], [5])]
    # A of the column layer is whole and trained: its partial gradient summed (B of the row layer is frozen).
    assert [bucket["params"] for bucket in plan["partial_gradients"]] == [[2]]
    assert comm(plan, "backward") == {"all_reduce": 1}


def test_region_modules_are_the_smallest_module_holding_their_layers():
    g = G()
    x = g.tensor(2, 8)
    _, h = g.linear(x, 8, 16, weight=0, out_shape=(2, 16))
    g.nodes[-1]["label"] = "blocks.0.mlp.up"
    act = g.tensor(2, 16)
    g.node("pointwise", [h], [act])
    g.linear(act, 16, 8, weight=1, out_shape=(2, 8), output=True)
    g.nodes[-1]["label"] = "blocks.0.mlp.down"
    (region,) = g.plan(2)["regions"]
    assert region["module"] == "blocks.0.mlp" and region["part_modules"] == []


def test_fused_output_split_into_parts_and_read_whole_by_a_row_layer_stays_whole():
    # The split makes the layer's weight split part by part ([4, 8]); a row layer reading the
    # same output whole would split its input features as one run, meeting other features.
    g = G()
    x = g.tensor(2, 8)
    _, h = g.linear(x, 8, 12, 0, out_shape=(2, 12))
    a, b = g.tensor(2, 4), g.tensor(2, 8)
    g.node("split", [h], [a, b], dim=1)
    scaled = g.tensor(2, 4)
    g.node("pointwise", [a], [scaled])
    g.linear(scaled, 4, 8, 2, out_shape=(2, 8), output=True)
    g.linear(h, 12, 8, 3, out_shape=(2, 8), output=True)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate", doc["layers"]
    assert all(layer["style"] != "row" for layer in doc["layers"]), doc["layers"]


def latent_attention(g, also_read_whole=False):
    """MLA's shape: a replicated projection (a norm reduces all of its features) whose output is
    read by a column layer split on 3 heads and, as one key head, broadcast to the split heads
    (made at the rank's heads there). With `also_read_whole`, the column layer's input is also a
    model output, so its copy's gradient must stay whole."""
    x = g.tensor(2, 8)
    _, latent = g.linear(x, 8, 4, 0, out_shape=(2, 4))
    normed = g.tensor(2, 4)
    g.node("reduce", [latent], [g.tensor(2, 1)], axes=[1])  # the norm's mean: keeps `latent` whole
    g.node("pointwise", [latent], [normed])
    if also_read_whole:
        g.output(normed)
    _, kv = g.linear(normed, 4, 6, 1, out_shape=(2, 6))
    heads = g.tensor(2, 3, 2)
    g.node("view", [kv], [heads])
    rotary = g.tensor(2, 2)
    g.node("slice", [latent], [rotary], dim=1, start=0, stop=2, drop_dim=False)
    key = g.tensor(2, 1, 2)
    g.node("view", [rotary], [key])
    broadcast = g.tensor(2, 3, 2)
    g.node("expand", [key], [broadcast])
    mixed = g.tensor(2, 3, 2)
    g.node("pointwise", [heads, broadcast], [mixed])
    flat = g.tensor(2, 6)
    g.node("view", [mixed], [flat])
    g.linear(flat, 6, 8, 2, out_shape=(2, 8), output=True)


def test_replicated_output_with_only_partial_gradients_is_summed_where_it_returns():
    g = G()
    latent_attention(g)
    doc = g.plan(3)
    assert styles(doc) == ["replicate", "column", "row"], doc["layers"]
    assert doc["summed_outputs"] == [{"node": 0, "elements": 8}], doc["summed_outputs"]
    assert doc["layers"][1]["deferred_copy"] is True
    # The summed output's all-reduce replaces the column layer's input copy's.
    assert comm(doc, "backward")["all_reduce"] == 1, doc["comm"]


def test_a_deferred_copy_whose_input_is_read_whole_elsewhere_is_not_deferred():
    g = G()
    latent_attention(g, also_read_whole=True)
    doc = g.plan(3)
    assert doc["summed_outputs"] == [], doc["summed_outputs"]
    assert not any(layer["deferred_copy"] for layer in doc["layers"]), doc["layers"]


def _unpaired_layers(g):
    """A free parameter read by a large and a small Linear, each output reduced over its features
    (an op that needs the whole axis): neither can be paired with a row layer."""
    p = g.tensor(2, 8, param=4)
    x = g.tensor(2, 8)
    g.node("pointwise", [p], [x])
    for weight, features in ((0, 64), (1, 2)):
        y = g.tensor(2, features)
        g.node("linear", [x], [y], in_features=8, out_features=features, weight_param=weight,
               weight_elements=8 * features)
        r = g.tensor(2, output=True)
        g.node("reduce", [y], [r], axes=[1])


@pytest.mark.parametrize("world_size", [2, 3])
def test_unpaired_layer_is_gathered_from_the_size_asked_for(world_size):
    g = G()
    _unpaired_layers(g)
    doc = g.plan(world_size, gather_unpaired=64)
    large, small = doc["layers"]
    assert (large["style"], large["reason"]) == ("column_gather", "gathered_unpaired")
    assert large["units"] == 64 and "reduces over the sharded axis" in large["note"]
    # Smaller than asked for (16 elements): a gather would buy little memory, it stays whole.
    assert (small["style"], small["reason"]) == ("replicate", "conflict")
    # The gather in forward; the gathered layer's input gradient summed in backward.
    assert comm(doc, "forward") == {"all_gather": 1}
    assert comm(doc, "backward") == {"all_reduce": 1}
    assert doc["tensors"] == []  # every tensor whole outside the layer
    # Without gather_unpaired (the document's default: 0) both stay whole; with 1 both gather.
    assert styles(g.plan(world_size)) == ["replicate", "replicate"]
    assert styles(g.plan(world_size, gather_unpaired=1)) == ["column_gather", "column_gather"]
    assert comm(g.plan(world_size, gather_unpaired=1), "backward") == {"all_reduce": 1}  # one input, one sum


def test_gathered_layer_read_only_through_indices_sums_no_gradient():
    # Scores whose top-k indices are all the model keeps of them (DeepSeek's sparse-attention
    # indexer): no gradient flows back through the indices, so none reaches the gathered layer's
    # input, and the plan counts no backward collective for it (autograd runs none).
    g = G()
    p = g.tensor(2, 8, param=4)
    x = g.tensor(2, 8)
    g.node("pointwise", [p], [x])
    _, scores = g.linear(x, 8, 64, 0, out_shape=(2, 64))
    indices = g.tensor(2, 4, output=True)
    g.tensors[indices]["floating"] = False
    g.node("opaque", [scores], [indices], label="topk")
    doc = g.plan(2, gather_unpaired=1)
    assert styles(doc) == ["column_gather"]
    assert comm(doc, "forward") == {"all_gather": 1} and comm(doc, "backward") == {}
    # The same layer whose scores reach the output themselves: its input's gradient is summed.
    g.output(scores)
    assert comm(g.plan(2, gather_unpaired=1), "backward") == {"all_reduce": 1}


def test_collectives_over_no_elements_are_not_counted():
    # Higgs-Audio's audio MLP, called on the tokens an audio mask selects: none in a text batch.
    # The comm ops return at once on an empty tensor, so the plan counts nothing for it.
    g = G()
    x = g.tensor(0, 8)
    _, h = g.linear(x, 8, 6, 0, 1, out_shape=(0, 6))
    a = g.tensor(0, 6)
    g.node("pointwise", [h], [a])
    _, y = g.linear(a, 6, 8, 2, 3, out_shape=(0, 8), output=True)
    doc = g.plan(2)
    assert styles(doc) == ["column", "row"]
    assert doc["comm"] == []
