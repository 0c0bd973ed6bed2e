"""Sequence parallelism decided by the C++ planner on graphs written by hand: which layers
split and gather tokens, which replicated parameters get partial gradients, which
collectives the plan predicts, and every refusal with its reason."""

import pytest

from test_planner_graphs import G, comm


def block(g, seq=5, hidden=8, ffn=12, vocab=16, mixing=None, merge=False, pos_embedding=False,
          hidden_output=False, entry=True, read_after=False, narrow=False):
    """A token embedding, a block (a norm, an MLP (column -> row), a residual add) that a
    module "layers.0" computes, a final norm and an output head: the smallest
    transformer-like stream. With `entry` the graph records that layers.0 receives the
    embedding output (so it can be cut to the tokens there)."""
    ids = g.tensor(2, seq)
    g.tensor(vocab, hidden, param=0)  # the token table (parameter 0)
    x0 = g.tensor(2, seq, hidden)
    g.node("embedding", [ids], [x0], label="embed", num_embeddings=vocab, embedding_dim=hidden, weight_param=0)
    if pos_embedding:
        positions = g.tensor(1, seq)
        g.tensor(seq, hidden, param=7)
        p = g.tensor(1, seq, hidden)
        g.node("embedding", [positions], [p], label="positions", num_embeddings=seq, embedding_dim=hidden, weight_param=7)
        summed = g.tensor(2, seq, hidden)
        g.node("pointwise", [x0, p], [summed], label="add_positions")
        x0 = summed
    w1 = g.tensor(hidden, param=1)
    first = len(g.nodes)
    n1 = g.tensor(2, seq, hidden)
    g.node("reduce", [x0, w1], [n1], label="norm1", axes=[2])
    if narrow:  # the norm scales by (1 + weight) computed in a narrower dtype (Gemma in float64)
        cast, scale, scaled = g.tensor(hidden), g.tensor(hidden), g.tensor(2, seq, hidden)
        g.node("pointwise", [w1], [cast], label="aten._to_copy.default", narrowing=True)
        g.node("pointwise", [cast], [scale], label="aten.add.Tensor")
        g.node("pointwise", [n1, scale], [scaled], label="aten.mul.Tensor")
        n1 = scaled
    _, h = g.linear(n1, hidden, ffn, 2, out_shape=(2, seq, ffn))
    a = g.tensor(2, seq, ffn)
    g.node("pointwise", [h], [a], label="act")
    _, y = g.linear(a, ffn, hidden, 3, 4, out_shape=(2, seq, hidden))
    x1 = g.tensor(2, seq, hidden, output=hidden_output)
    g.node("pointwise", [x0, y], [x1], label="residual")
    if entry:
        g.entries.append({"tensor": x0, "first": first, "end": len(g.nodes), "leaf": 0, "module": "layers.0"})
    if read_after:
        g.node("pointwise", [x0], [g.tensor(2, seq, hidden, output=True)], label="read_after")
    if mixing is not None:
        mixed = g.tensor(2, seq, hidden)
        g.node("reduce", [x1], [mixed], label=mixing, axes=[1])  # e.g. a cumsum over the tokens
        x1 = mixed
    if merge:
        flat = g.tensor(2 * seq, hidden)
        g.node("view", [x1], [flat], label="flatten_tokens")
        x1 = flat
    w2 = g.tensor(hidden, param=5)
    n2 = g.tensor(*g_shape(merge, seq, hidden))
    g.node("reduce", [x1, w2], [n2], label="norm2", axes=[len(g_shape(merge, seq, hidden)) - 1])
    _, logits = g.linear(n2, hidden, vocab, 6, out_shape=g_shape(merge, seq, vocab), output=True)
    return dict(x0=x0, n1=n1, y=y, x1=x1, n2=n2, w2=w2)


def g_shape(merge, seq, last):
    return (2 * seq, last) if merge else (2, seq, last)


def by_kind(doc, phase):
    return {c["kind"]: (c["count"], c["elements"]) for c in doc["comm"] if c["phase"] == phase}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stream_between_row_and_column_layers_is_split_on_tokens(world):
    g = G()
    t = block(g, seq=7)
    doc = g.plan(world)
    roles = [(layer["style"], layer["sequence"], layer["sequence_dim"]) for layer in doc["layers"]]
    # embed (vocab), up (column), down (row), head (column_gather: its output is a model output)
    assert roles == [("vocab", "", -1), ("column", "gather", 1), ("row", "reduce_scatter", 1),
                     ("column_gather", "gather", 1)]
    region = doc["layers"][2]["sequence_region"]
    assert doc["layers"][1]["sequence_region"] == doc["layers"][3]["sequence_region"] == region
    # The embedding output is cut to this rank's tokens where layers.0 receives it.
    assert doc["sequence_entries"] == [{"tensor": t["x0"], "module": "layers.0", "leaf": 0, "dim": 1, "region": region}]
    sequence = {x["tensor"]: x for x in doc["tensors"] if x["sequence"]}
    assert set(sequence) >= {t["n1"], t["y"], t["x1"], t["n2"]} and t["x0"] not in sequence
    assert all(x["axis"] == 1 and x["size"] == 7 for x in sequence.values())
    # Norm weights and the row layer's bias see this rank's tokens only: partial gradients.
    assert sorted(p for bucket in doc["partial_gradients"] for p in bucket["params"]) == [1, 4, 5]
    stream = 2 * 7 * 8
    assert by_kind(doc, "forward") == {"all_reduce": (1, stream), "reduce_scatter": (1, stream),
                                       "all_gather": (3, 2 * stream + 2 * 7 * 16)}
    assert by_kind(doc, "backward") == {"all_gather": (2, 2 * stream), "reduce_scatter": (2, 2 * stream),
                                        "all_reduce": (1, 8 + 8 + 8)}


def test_sequence_off_keeps_the_all_reduces_with_equal_elements():
    g = G()
    block(g, seq=7)
    on, off = g.plan(3), g.plan(3, sequence_parallel=False)
    assert all(layer["sequence"] == "" and layer["sequence_note"] == "" for layer in off["layers"])
    assert not any(x["sequence"] for x in off["tensors"])
    assert off["partial_gradients"] == []
    assert off["sequence_entries"] == []
    assert comm(off, "forward") == {"all_reduce": 2, "all_gather": 1}
    assert comm(off, "backward") == {"all_reduce": 2}
    # The row layer's all-reduce becomes a reduce-scatter of the same tensor (the embedding
    # keeps its own), each backward one (of a column layer's input copy) a reduce-scatter too.
    replaced = by_kind(off, "forward")["all_reduce"][1] - by_kind(on, "forward")["all_reduce"][1]
    assert by_kind(on, "forward")["reduce_scatter"][1] == replaced
    assert by_kind(on, "backward")["reduce_scatter"][1] == by_kind(off, "backward")["all_reduce"][1]


@pytest.mark.parametrize("case, why", [
    (dict(mixing="cumsum"), "cumsum mixes tokens"),
    (dict(merge=True), "flatten_tokens merges the token axis"),
    (dict(hidden_output=True), "its tokens reach a model output"),
    # The embedding output held whole can only be cut where a module receiving it holds every
    # op reading it: the model reads its shape before its blocks (position ids).
    (dict(entry=False), "residual combines its tokens with a tensor held whole that no module entry can cut"),
    (dict(read_after=True), "residual combines its tokens with a tensor held whole that no module entry can cut"),
    (dict(narrow=True), "aten.mul.Tensor reads a parameter cast to a narrower dtype"),
])
def test_a_region_that_is_not_per_token_keeps_its_all_reduces(case, why):
    g = G()
    block(g, **case)
    doc = g.plan(2)
    off = g.plan(2, sequence_parallel=False)
    assert all(layer["sequence"] == "" for layer in doc["layers"])
    assert doc["sequence_entries"] == []
    notes = {layer["sequence_note"] for layer in doc["layers"] if layer["style"] == "row"}
    assert len(notes) == 1 and why in notes.pop()
    assert doc["comm"] == off["comm"] and doc["partial_gradients"] == off["partial_gradients"]


def test_position_embeddings_added_before_the_block_are_cut_with_it():
    g = G()
    t = block(g, pos_embedding=True)
    doc = g.plan(2)
    assert [e["tensor"] for e in doc["sequence_entries"]] == [t["x0"]]
    assert sorted(layer["sequence"] for layer in doc["layers"]) == ["", "", "gather", "gather", "reduce_scatter"]
    # The cut tensor's gradient is gathered back whole: no partial sum for the tables.
    assert 7 not in [p for bucket in doc["partial_gradients"] for p in bucket["params"]]


def test_parameter_read_inside_and_outside_the_region_refuses_it():
    g = G()
    t = block(g)
    # The final norm's weight also scales something outside any region.
    other = g.tensor(2, 8)
    g.node("pointwise", [other, t["w2"]], [g.tensor(2, 8, output=True)], label="reuse")
    doc = g.plan(2)
    assert all(layer["sequence"] == "" for layer in doc["layers"])
    assert any("partly partial" in layer["sequence_note"] for layer in doc["layers"])
