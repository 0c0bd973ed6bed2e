"""Large parameters outside the layers, stored split and gathered whole for each call of their
module (csrc/plan/constructs/gathered_params.cpp, nn/gathered_parameters.py), and position tables split by
their rows (csrc/plan/passes/settling.cpp's split_tables): the planner on graphs written by hand, then a
model of our own on 2 and 3 gloo ranks against the unsharded model."""

import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard.state.unsharded import full_state_dict
from gathered import forward_backward_as_planned, gathered_grads
from multirank import run_on_ranks
from test_planner_graphs import G, comm, styles


def _plan(g, world_size, gather_unpaired, gatherable=()):
    document = json.loads(g.document(gather_unpaired=gather_unpaired))
    document["gatherable_params"] = list(gatherable)
    return json.loads(torch.ops.autoshard.plan_graph(json.dumps(document), world_size))


def _positions_then_mlp(g, position_reader="pointwise"):
    """Token ids through a table, a position parameter (param 9, [5, 8]) added, then an MLP."""
    ids = g.tensor(2, 5)
    e = g.tensor(2, 5, 8)
    g.node("embedding", [ids], [e], num_embeddings=11, embedding_dim=8, weight_param=0)
    positions = g.tensor(5, 8, param=9)
    x = g.tensor(2, 5, 8)
    g.node(position_reader, [e, positions], [x], label="aten.add.Tensor")
    _, h = g.linear(x, 8, 6, 1, out_shape=(2, 5, 6))
    a = g.tensor(2, 5, 6)
    g.node("pointwise", [h], [a])
    g.linear(a, 6, 8, 2, out_shape=(2, 5, 8), output=True)
    return positions


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_large_parameter_read_whole_inside_its_module_is_gathered(world_size):
    g = G()
    positions = _positions_then_mlp(g)
    doc = _plan(g, world_size, gather_unpaired=40, gatherable=[9])
    # Stored split on its longest axis (8 features), one all-gather of its 40 elements in forward.
    assert doc["gathered_params"] == [{"tensor": positions, "param": 9, "axis": 1, "size": 8, "elements": 40}]
    kept = _plan(g, world_size, gather_unpaired=0, gatherable=[9])
    assert kept["gathered_params"] == []
    assert comm(doc, "forward")["all_gather"] == comm(kept, "forward").get("all_gather", 0) + 1
    assert comm(doc, "backward") == comm(kept, "backward")  # each rank keeps its piece of the gradient
    assert styles(doc) == styles(kept) == ["vocab", "column", "row"]


def test_a_parameter_is_gathered_only_where_it_is_large_and_read_inside_its_module():
    g = G()
    _positions_then_mlp(g)
    assert _plan(g, 2, gather_unpaired=41, gatherable=[9])["gathered_params"] == []  # smaller than asked
    assert _plan(g, 2, gather_unpaired=40, gatherable=[])["gathered_params"] == []  # read outside its module


def test_a_parameter_meeting_a_sharded_tensor_is_not_gathered():
    # A scale over the column layer's split features: its gradient is this rank's features' only.
    g = G()
    x = g.tensor(2, 8)
    _, h = g.linear(x, 8, 6, 0, out_shape=(2, 6))
    scale = g.tensor(2, 6, param=5)
    a = g.tensor(2, 6)
    g.node("pointwise", [h, scale], [a], label="aten.mul.Tensor")
    g.linear(a, 6, 8, 1, out_shape=(2, 8), output=True)
    doc = _plan(g, 2, gather_unpaired=1, gatherable=[5])
    assert doc["gathered_params"] == []


def test_a_position_table_as_wide_as_the_token_table_is_split_by_rows():
    g = G()
    ids = g.tensor(2, 5)
    tokens, positions, bias = g.tensor(2, 5, 8), g.tensor(2, 5, 8), g.tensor(2, 5, 3)
    g.node("embedding", [ids], [tokens], num_embeddings=11, embedding_dim=8, weight_param=0)
    g.node("embedding", [ids], [positions], num_embeddings=5, embedding_dim=8, weight_param=1)
    # A table of another width (a relative position bias over 3 heads) stays whole.
    g.node("embedding", [ids], [bias], num_embeddings=5, embedding_dim=3, weight_param=2)
    x = g.tensor(2, 5, 8)
    g.node("pointwise", [tokens, positions], [x])
    y = g.tensor(2, 5, 8, output=True)
    g.node("pointwise", [x, bias], [y])
    doc = _plan(g, 2, gather_unpaired=40)
    assert styles(doc) == ["vocab", "vocab", "replicate"]
    assert [layer["reason"] for layer in doc["layers"]] == ["", "split_table", ""]
    assert comm(doc, "forward") == {"all_reduce": 2}  # one more for the position table
    assert styles(_plan(g, 2, gather_unpaired=41)) == ["vocab", "replicate", "replicate"]  # smaller than asked
    assert styles(_plan(g, 2, gather_unpaired=0)) == ["vocab", "replicate", "replicate"]


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 16)
        self.positions = nn.Parameter(torch.randn(1, 64, 16))

    def forward(self, x):
        return self.proj(x) + self.positions


class _Model(nn.Module):
    """A patch embedding with a large position parameter, then an MLP block and a head."""

    def __init__(self):
        super().__init__()
        self.embeddings = _Embeddings()
        self.norm = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embeddings(x)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))
        return self.head(h)


def _equal_to_unsharded(model, reference, inputs):
    """`model` parallelized on `inputs` against `reference`: outputs, the collectives the plan
    predicts, every gradient (gathered). Returns the plan."""
    autoshard.parallelize(model, example_inputs=inputs)
    plan = autoshard.core.parallel_state.state_of(model).plan
    forward_backward_as_planned(model, reference, plan, lambda m: m(*inputs), rtol=1e-12, atol=1e-12)
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    return plan


def _gathered_on_ranks():
    torch.manual_seed(0)
    model, reference = _Model().double(), _Model().double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plan = _equal_to_unsharded(model, reference, (x,))
    piece = tuple(model.embeddings.positions.shape)  # the call put the piece back
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-12, atol=1e-12)
    whole = full_state_dict(model)["embeddings.positions"]
    model.embeddings.positions = nn.Parameter(torch.zeros(1, 64, 16, dtype=torch.float64))
    try:
        model(x)
        replaced = ""
    except RuntimeError as error:
        replaced = str(error)
    return {"gathered": [(r.name, r.dim, r.size) for r in plan.gathered_parameters], "piece": piece,
            "forward": plan.collectives("forward"), "whole": (whole, reference.embeddings.positions.detach()),
            "replaced": replaced}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gathered_parameter_gives_the_unsharded_outputs_and_gradients(world_size):
    for rank, result in enumerate(run_on_ranks(_gathered_on_ranks, world_size, timeout=300)):
        assert result["gathered"] == [("embeddings.positions", 1, 64)]
        assert result["piece"] == (1, autoshard.split_sizes(64, world_size)[rank], 16)
        assert result["forward"]["all_gather"] >= 1
        torch.testing.assert_close(*result["whole"], rtol=0, atol=0)
        assert "'positions'" in result["replaced"] and "replaced after parallelize" in result["replaced"]


def test_the_plan_names_its_gathered_parameters_and_keeps_them_through_json():
    x = torch.randn(2, 64, 4)
    plan = autoshard.plan(_Model(), example_inputs=(x,), world_size=2)
    assert [(r.name, r.dim, r.size, r.elements) for r in plan.gathered_parameters] == [
        ("embeddings.positions", 1, 64, 1024)]
    assert "gathered whole for each call of their module (one all-gather each in forward): embeddings.positions" \
        in str(plan)
    # Stored split: counted as this rank's piece, not among the parameters held whole.
    held_whole = lambda p: [r.params for r in p.replicated() if r.module == "embeddings"]  # noqa: E731
    assert held_whole(plan) == []
    assert plan.held_fraction(0) <= 0.6
    again = autoshard.ShardingPlan.from_json(plan.to_json())
    assert again.gathered_parameters == plan.gathered_parameters and again.to_json() == plan.to_json()
    kept = autoshard.plan(_Model(), example_inputs=(x,), world_size=2, gather_unpaired=False)
    assert kept.gathered_parameters == [] and kept.held_fraction(0) > 0.6 and held_whole(kept) == [1024]
    assert kept.collectives("forward")["all_gather"] == plan.collectives("forward")["all_gather"] - 1


class _TableEmbeddings(nn.Module):
    """A position table the module never calls: its forward slices the table's weight itself
    (as vision towers do to interpolate their positions)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 16)
        self.position_embedding = nn.Embedding(80, 16)

    def forward(self, x):
        return self.proj(x) + self.position_embedding.weight[1:x.shape[1] + 1]


class _TableModel(_Model):
    def __init__(self):
        super().__init__()
        self.embeddings = _TableEmbeddings()


def _table_on_ranks():
    torch.manual_seed(0)
    model, reference = _TableModel().double(), _TableModel().double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plan = _equal_to_unsharded(model, reference, (x,))
    return {"gathered": [(r.name, r.dim, r.size, r.module) for r in plan.gathered_parameters],
            "piece": tuple(model.embeddings.position_embedding.weight.shape),
            "whole": (full_state_dict(model)["embeddings.position_embedding.weight"],
                      reference.embeddings.position_embedding.weight.detach())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_table_never_called_is_gathered_for_the_call_that_reads_it(world_size):
    for rank, result in enumerate(run_on_ranks(_table_on_ranks, world_size, timeout=300)):
        assert result["gathered"] == [("embeddings.position_embedding.weight", 0, 80, "embeddings")]
        assert result["piece"] == (autoshard.split_sizes(80, world_size)[rank], 16)
        torch.testing.assert_close(*result["whole"], rtol=0, atol=0)
    plan = autoshard.plan(_TableModel(), example_inputs=(torch.randn(2, 64, 4),), world_size=2)
    again = autoshard.ShardingPlan.from_json(plan.to_json())
    assert again.gathered_parameters == plan.gathered_parameters
    assert again.gathered_parameters[0].module == "embeddings"


class _Positions(nn.Embedding):
    """A learned position table called with the input's shape (BART's, Blenderbot's): its forward
    makes the positions it looks up."""

    def forward(self, shape, past: int = 0):
        return super().forward(torch.arange(past, past + shape[1], device=self.weight.device))


class _PositionsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(96, 16), _Positions(64, 16)
        self.fc1, self.fc2 = nn.Linear(16, 24), nn.Linear(24, 16)
        self.head = nn.Linear(16, 96)

    def forward(self, ids):
        h = self.tokens(ids) + self.positions(ids.shape)
        return self.head(h + self.fc2(torch.relu(self.fc1(h))))


def _positions_on_ranks():
    torch.manual_seed(0)
    model, reference = _PositionsModel().double(), _PositionsModel().double()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    plan = _equal_to_unsharded(model, reference, (ids,))
    positions = plan.layer("positions")
    return {"positions": (positions.style.value, positions.reason), "forward": plan.collectives("forward")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_position_table_called_with_a_shape_is_traced_and_split_by_rows(world_size):
    for result in run_on_ranks(_positions_on_ranks, world_size, timeout=300):
        assert result["positions"] == ("vocab", "split_table")
        assert result["forward"]["all_reduce"] >= 3  # tokens, positions, the MLP


def _example() -> torch.Tensor:
    return torch.randn(2, 64, 4, generator=torch.Generator().manual_seed(1))


def _save_gathered(path: str) -> dict:
    torch.manual_seed(0)
    model = autoshard.parallelize(_Model(), example_inputs=(_example(),))
    assert [r.name for r in autoshard.core.parallel_state.state_of(model).plan.gathered_parameters] == [
        "embeddings.positions"]
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    model(_example()).pow(2).mean().backward()
    optimizer.step()
    autoshard.checkpoint.save(path, model, optimizer)
    return {n: v.clone() for n, v in full_state_dict(model).items()}


def _load_gathered(path: str, sharded: bool = True) -> dict:
    torch.manual_seed(1)
    model = _Model()
    for p in model.parameters():
        torch.nn.init.normal_(p)  # other weights than the checkpoint's
    if sharded:
        autoshard.parallelize(model, example_inputs=(_example(),))
    autoshard.checkpoint.load(path, model)
    return {n: v.clone() for n, v in (full_state_dict(model) if sharded else model.state_dict()).items()}


def test_gathered_parameters_checkpoint_on_two_ranks_reload_on_three_and_unsharded(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_gathered, 2, path, timeout=300)[0]
    torch.manual_seed(0)
    assert not torch.equal(saved["embeddings.positions"], _Model().embeddings.positions.detach())  # stepped
    for loaded in (run_on_ranks(_load_gathered, 3, path, timeout=300)[0], _load_gathered(path, sharded=False)):
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
