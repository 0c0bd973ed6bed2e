"""The sequence-parallel rules the C++ planner judges from the module calls around a region
(csrc/plan/token_indexing.cpp, csrc/plan/length_reads.cpp, planned again by replan.cpp), on
graphs written by hand: column layers reading tokens through an op that indexes the token axis
get them gathered where a module returns them, or sequence parallelism is given up with the
reason on every row layer; a module that gathers tokens inside its own call and reshapes the
result keeps its other inputs whole."""

import pytest

from test_planner_graphs import G, comm

SEQ, HIDDEN, FFN, VOCAB = 5, 8, 12, 16


def layer(g, label, x, in_features, out_features, weight, output=False):
    y = g.tensor(2, SEQ, out_features, output=output)
    g.node("linear", [x], [y], label=label, in_features=in_features, out_features=out_features, weight_param=weight)
    return y


def stream(g):
    """A token embedding and a block "layers.0" (a norm, an MLP, a residual add): the residual
    stream after it is split on its tokens."""
    ids = g.tensor(2, SEQ)
    g.tensor(VOCAB, HIDDEN, param=0)
    x0 = g.tensor(2, SEQ, HIDDEN)
    g.node("embedding", [ids], [x0], label="embed", num_embeddings=VOCAB, embedding_dim=HIDDEN, weight_param=0)
    first = len(g.nodes)
    n1 = g.tensor(2, SEQ, HIDDEN)
    g.node("reduce", [x0, g.tensor(HIDDEN, param=1)], [n1], label="layers.0.norm", axes=[2])
    a = g.tensor(2, SEQ, FFN)
    g.node("pointwise", [layer(g, "layers.0.up", n1, HIDDEN, FFN, 2)], [a], label="layers.0.act")
    x1 = g.tensor(2, SEQ, HIDDEN)
    g.node("pointwise", [x0, layer(g, "layers.0.down", a, FFN, HIDDEN, 3)], [x1], label="layers.0.residual")
    g.entries.append({"tensor": x0, "first": first, "end": len(g.nodes), "leaf": 0, "module": "layers.0"})
    return x1


def last_tokens(indexing="alias", exit="norm", other_reader=False):
    """stream, a final norm "norm", then the head reading the tokens through `indexing` (an
    alias or a slice over the whole token axis, as transformers' hidden_states[:, slice_indices,
    :] records with every token kept; None: the norm's output itself). `exit`: the module
    recorded as returning the norm's output ("norm"; "late": only one whose call ends after the
    indexing; None: none)."""
    g = G()
    x1 = stream(g)
    norm = len(g.nodes)
    n2 = g.tensor(2, SEQ, HIDDEN)
    g.node("reduce", [x1, g.tensor(HIDDEN, param=4)], [n2], label="norm", axes=[2])
    # A larger call returning the same tensor, listed first: the innermost one is chosen.
    g.exits.append({"tensor": n2, "first": 0, "end": len(g.nodes), "leaf": 1, "module": "body"})
    if exit == "norm":
        g.exits.append({"tensor": n2, "first": norm, "end": len(g.nodes), "leaf": 0, "module": "norm"})
    if exit is None:
        g.exits.clear()
    picked = n2
    if indexing == "alias":
        picked = g.tensor(2, SEQ, HIDDEN)
        g.node("view", [n2], [picked], label="aten.alias.default")
    elif indexing == "slice":
        picked = g.tensor(2, SEQ, HIDDEN)
        g.node("slice", [n2], [picked], label="aten.slice.Tensor", dim=1, start=0, stop=SEQ, drop_dim=False)
    if exit == "late":
        g.exits[:] = [{"tensor": n2, "first": norm, "end": len(g.nodes) + 1, "leaf": 0, "module": "norm"}]
    layer(g, "lm_head", picked, HIDDEN, VOCAB, 5, output=True)
    if other_reader:
        scaled = g.tensor(2, SEQ, HIDDEN)
        g.node("pointwise", [n2], [scaled], label="aux_scale")
        layer(g, "aux_head", scaled, HIDDEN, VOCAB, 6, output=True)
    return g, n2, picked


def roles(doc):
    return [(layer["style"], layer["sequence"]) for layer in doc["layers"]]


@pytest.mark.parametrize("indexing", ["alias", "slice"])
@pytest.mark.parametrize("world", [2, 3])
def test_tokens_are_gathered_where_a_module_returns_them_before_an_op_indexing_them(indexing, world):
    g, n2, picked = last_tokens(indexing)
    doc = g.plan(world)
    assert roles(doc) == [("vocab", ""), ("column", "gather"), ("row", "reduce_scatter"),
                          ("column_gather", "gathered")]
    region = doc["layers"][2]["sequence_region"]
    assert doc["layers"][3]["sequence_region"] == region
    # Gathered at the innermost call returning the indexed tensor, the norm's, on the token axis.
    assert doc["sequence_exits"] == [{"tensor": n2, "module": "norm", "leaf": 0, "dim": 1, "region": region}]
    sharded = {t["tensor"] for t in doc["tensors"]}
    assert n2 in sharded and picked not in sharded  # the indexing runs on every token
    # The gather is the one the head made of the same tensor: the collectives are those of a
    # head reading the norm's output directly.
    plain = last_tokens(indexing=None)[0].plan(world)
    assert roles(plain)[3] == ("column_gather", "gather") and plain["sequence_exits"] == []
    assert doc["comm"] == plain["comm"]
    assert all(layer["sequence_note"] == "" for layer in doc["layers"])


@pytest.mark.parametrize("exit", [None, "late"])
def test_indexed_tokens_no_module_returns_give_up_sequence_parallelism(exit):
    g, _, _ = last_tokens(exit=exit)
    doc = g.plan(2)
    assert [layer["sequence"] for layer in doc["layers"]] == [""] * 4 and doc["sequence_exits"] == []
    assert not any(t["sequence"] for t in doc["tensors"])
    why = ("sequence parallelism refused: aten.alias.default indexes the token axis (another call may select other "
           "tokens) and no module returns the tokens it reads, where they could be gathered first")
    assert [layer["sequence_note"] for layer in doc["layers"]] == ["", "", why, ""]
    # Otherwise the plan planned without sequence parallelism.
    off = g.plan(2, sequence_parallel=False)
    assert doc["comm"] == off["comm"] and doc["tensors"] == off["tensors"]
    assert comm(doc, "forward") == {"all_reduce": 2, "all_gather": 1}


def test_indexed_tokens_read_by_another_op_give_up_sequence_parallelism():
    doc = last_tokens(other_reader=True)[0].plan(2)
    assert not any(layer["sequence"] for layer in doc["layers"]) and doc["sequence_exits"] == []
    assert doc["layers"][2]["sequence_note"] == (
        "sequence parallelism refused: norm returns tokens that aux_scale reads besides the column layers reading "
        "them through aten.alias.default, which indexes the token axis")


def two_input_attention(reshape: bool):
    """stream, then a module "cross" called on the stream and a memory computed from it, as
    attn(x, memory): it norms both itself before its q and k layers (which gather the tokens
    inside its call) and, with `reshape`, views q's output to heads and back, as a forward
    spelling .view(b, t, heads, -1) with a length read from x.shape does."""
    g = G()
    x1 = stream(g)
    memory = g.tensor(2, SEQ, HIDDEN)
    g.node("pointwise", [x1], [memory], label="memory_scale")
    first = len(g.nodes)
    xn, mn = g.tensor(2, SEQ, HIDDEN), g.tensor(2, SEQ, HIDDEN)
    g.node("reduce", [x1, g.tensor(HIDDEN, param=4)], [xn], label="cross.x_norm", axes=[2])
    g.node("reduce", [memory, g.tensor(HIDDEN, param=5)], [mn], label="cross.memory_norm", axes=[2])
    q = layer(g, "cross.q_proj", xn, HIDDEN, HIDDEN, 6)
    if reshape:
        heads, back = g.tensor(2, SEQ, 4, HIDDEN // 4), g.tensor(2, SEQ, HIDDEN)
        g.node("view", [q], [heads], label="aten.view.default")
        g.node("view", [heads], [back], label="aten.view.default")
        q = back
    mixed = g.tensor(2, SEQ, HIDDEN)
    g.node("pointwise", [q, layer(g, "cross.k_proj", mn, HIDDEN, HIDDEN, 7)], [mixed], label="cross.mix")
    out = layer(g, "cross.o_proj", mixed, HIDDEN, HIDDEN, 8)
    for leaf, tensor in enumerate([x1, memory]):
        g.entries.append({"tensor": tensor, "first": first, "end": len(g.nodes), "leaf": leaf, "module": "cross"})
    x2, n3 = g.tensor(2, SEQ, HIDDEN), g.tensor(2, SEQ, HIDDEN)
    g.node("pointwise", [x1, out], [x2], label="residual")
    g.node("reduce", [x2, g.tensor(HIDDEN, param=9)], [n3], label="norm", axes=[2])
    layer(g, "lm_head", n3, HIDDEN, VOCAB, 10, output=True)
    return g


def test_module_gathering_inside_its_call_without_reshaping_keeps_split_inputs():
    doc = two_input_attention(reshape=False).plan(2)
    sequence = {g["node"]: g["sequence"] for g in doc["layers"]}
    assert sorted(sequence.values()) == ["", "gather", "gather", "gather", "gather", "reduce_scatter",
                                         "reduce_scatter"], doc["layers"]
    assert all(layer["sequence_note"] == "" for layer in doc["layers"])


@pytest.mark.parametrize("world", [2, 3])
def test_module_reshaping_what_it_gathers_inside_keeps_its_inputs_whole(world):
    doc = two_input_attention(reshape=True).plan(world)
    assert not any(layer["sequence"] for layer in doc["layers"])
    assert not any(t["sequence"] for t in doc["tensors"])
    why = ("sequence parallelism refused: module 'cross' receives tokens split over the ranks and gathers them only "
           "in its own layers: it may read their count first (as an attention called as attn(x, memory) does with "
           "x.shape), so its inputs stay whole")
    rows = [layer for layer in doc["layers"] if layer["style"] == "row"]
    assert len(rows) == 2 and all(layer["sequence_note"] == why for layer in rows), doc["layers"]
    # The tensor-parallel plan is the one made without sequence parallelism.
    off = two_input_attention(reshape=True).plan(world, sequence_parallel=False)
    assert [layer["style"] for layer in doc["layers"]] == [layer["style"] for layer in off["layers"]]
    assert doc["comm"] == off["comm"]


def test_exits_are_checked_like_entries():
    g, n2, _ = last_tokens()
    g.exits.append({"tensor": 99, "first": 0, "end": 1, "leaf": 0, "module": "norm"})
    with pytest.raises(ValueError, match=r"\[plan.bad_graph\] plan: exit 2 names undeclared tensor 99"):
        g.plan(2)
