"""The C++ planner's batch letter on graphs written by hand: a grouped convolution read as an
einsum layer whose groups are shared by its input, weight and output channels. Its input split
by whole groups passes through to its output with no collective (style batch); a whole input
keeps it whole (reason groups_input_whole)."""

from test_planner_graphs import G, comm, styles


def groups_letter(axis, groups):
    return [{"letter": "g", "role": "batch", "input_dim": axis, "output_dim": axis, "size": groups}]


def mamba_mixer(g, hidden=6, channels=12, groups=12, out_channels=None, length=5):
    """in_proj (Linear) -> transpose -> grouped Conv1d over the channels -> SiLU -> transpose ->
    out_proj (Linear)."""
    out_channels = out_channels or channels
    x = g.tensor(2, length, hidden)
    _, h = g.linear(x, hidden, channels, 0, 1, out_shape=(2, length, channels))
    t = g.tensor(2, channels, length)
    g.node("permute", [h], [t], permutation=[0, 2, 1])
    c = g.tensor(2, out_channels, length)
    conv = g.node("einsum", [t], [c], label="conv1d", weight_param=2, bias_param=3, letters=groups_letter(1, groups))
    a = g.tensor(2, out_channels, length)
    g.node("pointwise", [c], [a])
    b = g.tensor(2, length, out_channels)
    g.node("permute", [a], [b], permutation=[0, 2, 1])
    _, y = g.linear(b, out_channels, hidden, 4, 5, out_shape=(2, length, hidden), output=True)
    return conv, c


def test_grouped_layer_carries_its_input_split_with_no_collective():
    g = G()
    mamba_mixer(g)
    doc = g.plan(3)
    assert styles(doc) == ["column", "batch", "row"]
    assert [layer["letter"] for layer in doc["layers"]][1] == "g"
    assert len({layer["region"] for layer in doc["layers"]}) == 1 and doc["layers"][1]["units"] == 12
    assert comm(doc, "forward") == {"all_reduce": 1}  # the row layer's: Megatron's minimum
    assert comm(doc, "backward") == {}  # the column layer's input is a model input
    assert not doc["partial_gradients"]


def test_units_divide_the_groups_and_follow_a_changed_channel_count():
    g = G()
    conv, c = mamba_mixer(g, channels=16, groups=4, out_channels=8)
    doc = g.plan(3)
    assert styles(doc) == ["column", "batch", "row"]
    assert {layer["units"] for layer in doc["layers"]} == {4}  # gcd(16, 4): whole groups of 4 channels
    sharded = {t["tensor"]: t for t in doc["tensors"]}
    assert sharded[c]["axis"] == 1 and sharded[c]["size"] == 8


def test_fewer_groups_than_ranks_keep_the_region_whole():
    g = G()
    mamba_mixer(g, channels=16, groups=2)
    doc = g.plan(3)
    assert styles(doc) == ["replicate", "replicate", "column_gather"]  # out_proj: a model output
    assert doc["layers"][0]["reason"] == "too_few_units"
    assert doc["layers"][1]["reason"] == "groups_input_whole"


def test_grouped_layer_over_a_whole_input_stays_whole_with_code():
    g = G()
    x = g.tensor(2, 8, 5)
    c = g.tensor(2, 8, 5)
    g.node("einsum", [x], [c], label="conv", weight_param=0, bias_param=1, letters=groups_letter(1, 8))
    out = g.tensor(2, 8, 5, output=True)
    g.node("pointwise", [c, x], [out])
    doc = g.plan(2)
    assert styles(doc) == ["replicate"]
    assert doc["layers"][0]["reason"] == "groups_input_whole"
    assert "input is held whole" in doc["layers"][0]["note"]
    assert comm(doc, "forward") == {} and comm(doc, "backward") == {}


def test_grouped_layer_whose_output_needs_the_channels_whole_replicates_the_region():
    g = G()
    conv, c = mamba_mixer(g)
    r = g.tensor(2, 1, 5)
    g.node("reduce", [c], [r], axes=[1])  # a norm over the channels
    g.output(r)
    doc = g.plan(2)
    assert styles(doc)[:2] == ["replicate", "replicate"]
    assert doc["layers"][0]["reason"] == "conflict"
