"""The automatic plan, offline (no process group): styles, whole heads, and the collectives
it predicts, on Hugging Face models built on the meta device."""

import copy
import dataclasses
import json
import pickle
import re

import pytest
import torch
from torch import nn

from autoshard.planner.sharding_plan import ShardingPlan
from autoshard.planner.api import plan
from autoshard.core.styles import Style
from hf_models import CONFIGS, HEADS, build, layer_count

KINDS = sorted(CONFIGS)


def linear_layers(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_plan_reaches_megatron_minimum(kind, world_size):
    model = build(kind, device="meta")
    p = plan(model, world_size=world_size, sequence_parallel=False)
    blocks = layer_count(kind)
    forward, backward = p.collectives("forward"), p.collectives("backward")
    # Sequence parallelism turns some of those all-reduces into reduce-scatters, one for one.
    split = plan(model, world_size=world_size).collectives("forward")
    assert split.get("all_reduce", 0) + split.get("reduce_scatter", 0) == forward.get("all_reduce", 0)
    # Two all-reduces per block and one for the token embedding; the head gathers once. A model
    # whose plan would leave a rank much more than its share gathers its large unpaired layers
    # (BERT's masked-LM transform), one all-gather each, none of them inside the blocks, and
    # splits its large position tables by rows, one all-reduce each.
    unpaired = [layer.module for layer in p.layers if layer.reason == "gathered_unpaired"]
    assert not [name for name in unpaired if re.search(r"\.(layer|layers|h)\.\d+\.", name)]
    tables = [layer.module for layer in p.layers if layer.reason == "split_table"]
    assert all(p.layer(name).style == "vocab" for name in tables)
    assert forward.get("all_reduce", 0) + forward.get("all_gather", 0) <= 2 * blocks + 2 + len(unpaired) + len(tables)
    # A KV projection whose heads are shared by several ranks adds the all-reduce of its gradient.
    shared_kv = sum(1 for layer in p.layers if layer.repeat)
    assert shared_kv == 0 or world_size == 4  # 3 KV heads: shared only on 4 ranks
    # So does a fused layer holding its one KV head whole on every rank (GPT-BigCode's c_attn).
    whole_kv = sum(1 for layer in p.layers if layer.summed_parts)
    assert whole_kv == (blocks if kind == "gpt_bigcode" else 0)
    assert backward.get("all_reduce", 0) <= 2 * blocks + 1 + shared_kv + whole_kv + len(unpaired)
    assert forward.get("all_gather", 0) == 1 + len(unpaired)
    # Strictly fewer than gathering after every Linear.
    assert sum(forward.values()) < len(linear_layers(model))
    styles = {layer.style for layer in p.layers}
    assert {"column", "row", "vocab"} <= styles


@pytest.mark.parametrize("kind", KINDS)
def test_attention_is_split_on_whole_heads(kind):
    model = build(kind, device="meta")
    p = plan(model, world_size=2)
    heads = HEADS[kind]
    attention = [layer for layer in p.layers if layer.style in ("column", "row") and layer.units in heads]
    assert attention, "no layer was split on heads"
    for layer in attention:
        dim = layer.weight_dim()
        for rank in range(2):
            spec = layer.weight_spec(rank, 2)
            for index, ((start, length), part) in enumerate(zip(spec.local_ranges(), spec.part_sizes())):
                if index in layer.whole_parts:  # held whole (one KV head beside the query heads)
                    assert (start, length) == (sum(spec.part_sizes()[:index]), part)
                    continue
                head = part // layer.units
                assert start % head == 0 and length % head == 0, (layer.module, start, length, head)
        split = sum(size for i, size in enumerate(layer.parts or [layer.weight_shape[dim]]) if i not in layer.whole_parts)
        assert split % layer.units == 0


def test_gpt2_fused_qkv_is_split_part_by_part():
    p = plan(build("gpt2", device="meta"), world_size=3)
    c_attn = p.layer("transformer.h.0.attn.c_attn")
    assert c_attn.style == "column" and c_attn.parts == [60, 60, 60] and c_attn.units == 5
    # 5 heads of 12 over 3 ranks: 2, 2, 1 heads of each of q, k and v.
    assert [c_attn.weight_spec(r, 3).local_size() for r in range(3)] == [72, 72, 36]
    assert c_attn.weight_dim() == 1  # Conv1D stores [in, out]
    assert p.regions[c_attn.region].attributes.get("split_size") == 60


@pytest.mark.parametrize("kind", ["gemma", "gpt2", "bert"])
def test_tied_embeddings_stay_tied(kind):
    model = build(kind, device="meta")
    p = plan(model, world_size=3)
    by_weight = {}
    for layer in p.layers:
        by_weight.setdefault(layer.weight, []).append(layer)
    tied = [layers for layers in by_weight.values() if len(layers) > 1]
    assert tied, "the model's input and output embeddings should share one weight"
    for layers in tied:
        specs = {tuple(layer.weight_spec(r, 3).local_ranges()) for layer in layers for r in range(1)}
        assert len(specs) == 1
        assert {layer.style for layer in layers} == {"vocab", "column_gather"}


def test_fewer_kv_heads_than_ranks_replicate_kv_heads_not_attention():
    model = build("llama", device="meta")  # 6 query heads over 3 KV heads
    p = plan(model, world_size=4)
    q, k = p.layer("model.layers.0.self_attn.q_proj"), p.layer("model.layers.0.self_attn.k_proj")
    assert (q.style, q.units, q.repeat) == ("column", 6, 0)
    assert (k.style, k.units, k.repeat) == ("column", 3, 2)
    # Query heads 0-1, 2-3, 4, 5 use KV heads 0, 1, 2, 2 (8 features each).
    assert [k.weight_spec(r, 4).local_ranges() for r in range(4)] == [[(0, 8)], [(8, 8)], [(16, 8)], [(16, 8)]]
    # On 3 ranks, as before: 3 units of 2 query heads and 1 KV head.
    p2 = plan(model, world_size=3)
    assert (p2.layer("model.layers.0.self_attn.k_proj").units, p2.layer("model.layers.0.self_attn.k_proj").repeat) == (3, 0)


def test_plan_json_round_trip_and_table():
    p = plan(build("llama", device="meta"), world_size=2)
    again = ShardingPlan.from_json(p.to_json())
    assert again.to_json() == p.to_json()
    assert json.loads(p.to_json())["world_size"] == 2
    # Styles are typed on both sides of the round trip, and plain words in the JSON.
    assert [layer.style for layer in again.layers] == [layer.style for layer in p.layers]
    assert all(isinstance(layer.style, Style) for layer in again.layers + p.layers)
    assert {record["style"] for record in json.loads(p.to_json())["layers"]} <= {s.value for s in Style}
    table = str(p)
    # The two identical blocks print once, their index as a range.
    assert "model.layers.0-1.self_attn.q_proj" in table and "column" in table and "all_reduce" in table
    assert "model.layers.1.self_attn" not in table


def test_plan_json_is_versioned_and_keeps_what_the_dry_run_reads():
    p = plan(build("llama", device="meta"), world_size=3)
    document = json.loads(p.to_json())
    assert document["version"] == 1
    again = ShardingPlan.from_json(p.to_json())
    # The predicted local shapes of every op on every rank, and the inputs the dry run replays.
    assert [again.prediction.nodes(r) for r in range(3)] == [p.prediction.nodes(r) for r in range(3)]
    assert again.prediction.graph.folded == p.prediction.graph.folded == {"model.layers.1": "model.layers.0"}
    got, want = again.input_values, p.input_values
    assert got[0] == want[0] and got[1].keys() == want[1].keys()
    assert all(torch.equal(got[1][k], want[1][k]) and got[1][k].dtype == want[1][k].dtype for k in want[1])
    # A small model's plan stays small (its prediction is most of it).
    assert len(p.to_json()) < 64 * 1024

    with pytest.raises(ValueError, match=r"plan document version 2 is not supported; this autoshard reads version 1"):
        ShardingPlan.from_json(json.dumps({**document, "version": 2}))
    # Written before versions: read, with a warning that it holds no prediction.
    old = {k: v for k, v in document.items() if k not in ("version", "prediction", "input_values")}
    with pytest.warns(UserWarning, match=r"no \"version\".*not every op"):
        unversioned = ShardingPlan.from_json(json.dumps(old))
    assert unversioned.layers == p.layers and unversioned.prediction is None


def test_a_built_plan_cannot_be_changed():
    p = plan(build("llama", device="meta"), world_size=2)
    for built in (p, ShardingPlan.from_json(p.to_json())):
        layer = built.layers[0]
        parts = [(built, "world_size", 3), (layer, "style", Style.REPLICATE), (layer, "sequence", "reduce_scatter"),
                 (next(iter(built.regions.values())), "units", 1), (built.comm[0], "count", 9),
                 (next(iter(built.parameters.values())), "whole_reason", "x")]
        for part, attr, value in parts:
            before = getattr(part, attr)
            with pytest.raises(AttributeError, match="cannot be changed once it is built"):
                setattr(part, attr, value)
            assert getattr(part, attr) == before
        region = next(iter(built.regions.values()))
        for change in (lambda: built.layers.append(layer), lambda: built.comm.pop(), lambda: built.norms.clear(),
                       lambda: built.regions.pop(next(iter(built.regions))), lambda: built.parameters.clear(),
                       lambda: built.example.update(x=1), lambda: built.overrides.setdefault("x", "replicate"),
                       lambda: layer.parts.append(1), lambda: layer.weight_shape.__setitem__(0, 1),
                       lambda: region.attributes.update(num_heads=1), lambda: region.localize.append(1)):
            with pytest.raises(AttributeError, match="cannot be changed once it is built"):
                change()
        # Every attribute of the plan and of each part is a declared field: nothing is attached.
        for part in (built, *built.layers, *built.regions.values(), *built.parameters.values(), *built.comm):
            assert set(vars(part)) - {"_sealed"} == {f.name for f in dataclasses.fields(part)}, type(part).__name__
        assert copy.deepcopy(built).to_json() == built.to_json() == pickle.loads(pickle.dumps(built)).to_json()
        assert built.to_json() == p.to_json()


def test_plan_json_input_values():
    from autoshard.planner.plan_json import decode_inputs, encode_inputs

    ids, scale = torch.tensor([[3, 1], [4, 1]]), torch.tensor([0.1, float("inf")], dtype=torch.bfloat16)
    encoded = json.loads(json.dumps(encode_inputs(((ids, None), {"scale": scale, "n": 2}))))
    (ids_again, none), kwargs = decode_inputs(encoded)
    assert torch.equal(ids_again, ids) and ids_again.dtype == torch.int64 and none is None
    assert torch.equal(kwargs["scale"], scale) and kwargs["scale"].dtype == torch.bfloat16 and kwargs["n"] == 2
    # Inputs JSON cannot hold, or too many values: none kept (the dry run makes inputs of their shapes).
    assert encode_inputs(((torch.zeros(2, dtype=torch.complex64),), {})) is None
    assert encode_inputs(((object(),), {})) is None
    assert encode_inputs(((torch.zeros(1 << 17),), {})) is None


def test_overrides():
    model = build("llama", device="meta")
    p = plan(model, world_size=2, overrides={"*.mlp.*": "replicate"})
    assert all(layer.style == "replicate" for layer in p.layers if ".mlp." in layer.module)
    assert p.layer("model.layers.0.self_attn.o_proj").style == "row"
    assert p.collectives("forward")["all_reduce"] == 2 + 1
    with pytest.raises(ValueError, match="names no layer"):
        plan(model, world_size=2, overrides={"*.nothing_here": "replicate"})
    with pytest.raises(ValueError, match="must be one of"):
        plan(model, world_size=2, overrides={"lm_head": "row"})


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(10, 11)
        self.down = nn.Linear(11, 7)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_own_model_with_example_inputs():
    p = plan(MLP(), world_size=3, example_inputs=(torch.randn(2, 3, 10),))
    assert p.layer("up").style == "column" and p.layer("down").style == "row"
    assert p.collectives("forward") == {"all_reduce": 1}
    # `up` reads the model's input, which needs no gradient: no backward all-reduce at all.
    assert p.collectives("backward") == {}


def test_bad_input():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.up(x) + y

    # One input tensor is inferred from the first layer (tests/plan/test_plan_inputs.py); two are not.
    with pytest.raises(ValueError, match=r"requires 2 arguments \('x', 'y'\).*pass example_inputs"):
        plan(TwoInputs(), world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan(MLP(), world_size=0, example_inputs=(torch.randn(2, 10),))
    with pytest.raises(ValueError, match="world_size=50 is larger than every dimension"):
        plan(MLP(), world_size=50, example_inputs=(torch.randn(2, 10),))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        plan("gpt2", world_size=2)

    class NeedsWeightValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * float(self.scale.sum())  # a weight's value, which meta tensors do not hold

    with pytest.raises(RuntimeError, match="forward failed on the meta device .*depend on more than the example"):
        plan(NeedsWeightValues(), world_size=2, example_inputs=(torch.randn(3),))


def test_planning_leaves_a_real_model_untouched():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan(model, world_size=2, example_inputs=(torch.randn(4, 10),))
    assert all(p.device.type == "cpu" for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert not model._forward_hooks and not model.up._forward_pre_hooks


def test_cli_prints_plan_and_cost(capsys):
    from autoshard.__main__ import main

    assert main(["plan", "--model-type", "llama", "--world-size", "2", "--set", "num_hidden_layers=2",
                 "--set", "hidden_size=64", "--set", "intermediate_size=96", "--set", "num_attention_heads=4",
                 "--set", "vocab_size=100"]) == 0
    out = capsys.readouterr().out
    assert "ShardingPlan for 2 ranks" in out and "model.layers.0-1.mlp.down_proj" in out
    # The embedding's all-reduce; the row layers' four are reduce-scatters (sequence parallelism).
    assert re.search(r"forward +all_reduce +x1 ", out) and re.search(r"forward +reduce_scatter +x4 ", out)
    assert "planned in" in out
    assert "sequence parallel (tokens split over the ranks)" in out


def test_one_rank_plans_no_collectives():
    p = plan(build("gpt2", device="meta"), world_size=1)
    assert p.comm == []
    assert p.layer("transformer.h.0.mlp.c_fc").style == "column"
