"""What the plan says each rank holds, against the parameters a parallelized model really holds
on 2 and 3 gloo ranks (local numel, tied parameters once), and the warning for a model that
stays mostly whole."""

import json
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.planner.sharding_plan import ShardingPlan
from hf_models import build
from multirank import run_on_ranks

# gpt2: fused c_attn (Conv1D), 5 heads; llama: 6 query over 3 KV heads; llama_kv2: 6 over 2 KV
# heads, shared by several ranks on 3; gemma: tied embeddings; bert: row biases, position and
# type tables, a layer kept whole by a LayerNorm.
MODELS = {"gpt2": ("gpt2", {}), "llama": ("llama", {}), "llama_kv2": ("llama", {"num_key_value_heads": 2}),
          "gemma": ("gemma", {}), "bert": ("bert", {})}


class EinsumModel(nn.Module):
    """Einsum layers with biases split with their weight (bias_axes holding the split letter)."""

    def __init__(self):
        super().__init__()
        self.p = autoshard.nn.EinsumDense("btd,dnh->btnh", (None, 5, 4), input_shape=(None, 10), bias_axes="nh")
        self.q = autoshard.nn.EinsumDense("btnh,nhd->btd", (None, 10), input_shape=(None, 5, 4), bias_axes="d")
        self.norm = nn.LayerNorm(10)

    def forward(self, x):
        return self.norm(x + self.q(torch.tanh(self.p(x))))


def _make(name: str):
    if name == "einsum":
        torch.manual_seed(0)
        return EinsumModel(), (torch.randn(2, 3, 10),)
    kind, overrides = MODELS[name]
    return build(kind, **overrides), None


def _held_on_rank(name: str) -> dict:
    """On every rank: what the plan says this rank holds, and what it holds once parallelized."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, inputs = _make(name)
    plan = autoshard.plan(model, world_size=world, example_inputs=inputs)
    said = plan.held_parameters(rank)
    autoshard.parallelize(model, plan)
    # named_parameters() lists a tied parameter once, under its first name.
    real = {n: p.numel() for n, p in model.named_parameters()}
    classes = {record.module_class for record in plan.parameters.values()}
    return {"said": said, "real": real, "fraction": plan.held_fraction(rank),
            "by_class": {c: plan.held_fraction(rank, c) for c in classes},
            "class_of": {n: r.module_class for n, r in plan.parameters.items()}}


def _check_all():
    return {name: _held_on_rank(name) for name in [*MODELS, "einsum"]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_held_parameters_equal_what_parallelize_leaves(world_size):
    results = run_on_ranks(_check_all, world_size, timeout=600)
    for name in [*MODELS, "einsum"]:
        unsharded, _ = _make(name)
        full = {n: p.numel() for n, p in unsharded.named_parameters()}  # tied once
        total = sum(full.values())
        sharded_somewhere = False
        for rank, by_model in enumerate(results):
            report = by_model[name]
            assert report["said"] == report["real"], (name, rank, {
                n: (report["said"].get(n), report["real"].get(n)) for n in set(report["said"]) | set(report["real"])
                if report["said"].get(n) != report["real"].get(n)})
            assert set(report["real"]) == set(full), name
            assert report["fraction"] == pytest.approx(sum(report["real"].values()) / total, abs=1e-12)
            for cls, fraction in report["by_class"].items():
                names = [n for n, c in report["class_of"].items() if c == cls]
                want = sum(report["real"][n] for n in names) / sum(full[n] for n in names)
                assert fraction == pytest.approx(want, abs=1e-12), (name, cls)
            sharded_somewhere |= report["fraction"] < 1.0
        assert sharded_somewhere, name
        if name.startswith("llama"):
            # Norms stay whole; the MLP is split on its 70 features (35/35 or 24/23/23).
            first = results[0][name]["by_class"]
            assert first["LlamaRMSNorm"] == 1.0
            assert first["LlamaMLP"] == pytest.approx(
                autoshard.split_sizes(70, world_size)[0] / 70, abs=1e-12)


def test_printout_shows_fractions_and_reasons():
    plan = autoshard.plan(build("bert", device="meta"), world_size=2)
    text = str(plan)
    assert "parameters held per rank" in text and "rank 1" in text
    assert f"{plan.held_fraction(0):.2f}" in text.split("parameters held per rank")[1]
    assert "LayerNorm" in text and "1.00" in text
    held = text.split("held whole on every rank, by reason:")[1]
    assert "a position or type table" in held and "bert.embeddings.token_type_embeddings" in held
    # The position table, large beside this small model's layers, is split by rows instead.
    assert "bert.embeddings.position_embeddings" not in held
    positions = plan.layer("bert.embeddings.position_embeddings")
    assert (positions.style, positions.reason) == ("vocab", "split_table")
    assert "the bias of a row-parallel layer" in held
    reasons = {item.reason for item in plan.replicated()}
    assert {"position_table", "row_bias", "not_a_layer"} <= reasons
    # The masked-LM head's dense, which cannot be paired, is split and gathered instead.
    assert plan.layer("cls.predictions.transform.dense").reason == "gathered_unpaired"
    assert re.search(r"cls\.predictions\.transform\.dense +column_gather .* gathered: its output", text)
    # Round trip: the figures survive to_json / from_json.
    again = ShardingPlan.from_json(plan.to_json())
    assert again.held_parameters(1) == plan.held_parameters(1)
    assert str(again) == str(plan)


def test_gather_unpaired_false_keeps_unpaired_layers_whole():
    model = build("bert", device="meta")
    gathered = autoshard.plan(model, world_size=2)
    kept = autoshard.plan(model, world_size=2, gather_unpaired=False)
    dense = "cls.predictions.transform.dense"
    assert gathered.layer(dense).style == "column_gather" and gathered.layer(dense).reason == "gathered_unpaired"
    assert kept.layer(dense).style == "replicate" and kept.layer(dense).reason == "conflict"
    assert not [layer for layer in kept.layers if layer.reason in ("gathered_unpaired", "split_table")]
    positions = "bert.embeddings.position_embeddings"
    assert (gathered.layer(positions).style, kept.layer(positions).style) == ("vocab", "replicate")
    # One all-gather and one all-reduce (the position table's) fewer in forward, one all-reduce
    # fewer in backward; more held per rank.
    assert kept.collectives("forward")["all_gather"] == gathered.collectives("forward")["all_gather"] - 1
    assert kept.collectives("forward")["all_reduce"] == gathered.collectives("forward")["all_reduce"] - 1
    assert kept.collectives("backward")["all_reduce"] == gathered.collectives("backward")["all_reduce"] - 1
    assert kept.held_fraction(0) > 0.6 >= gathered.held_fraction(0)
    with pytest.raises(ValueError, match="gather_unpaired must be True or False, got 'no'"):
        autoshard.plan(model, world_size=2, gather_unpaired="no")


def test_held_fraction_bad_input():
    plan = autoshard.plan(build("llama", device="meta"), world_size=2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        plan.held_fraction(2)
    with pytest.raises(ValueError, match="no parameters of module class 'Nope'"):
        plan.held_fraction(0, "Nope")
    old = json.loads(plan.to_json())
    del old["parameters"]
    with pytest.raises(ValueError, match="records no parameters"):
        ShardingPlan.from_json(json.dumps(old)).held_fraction(0)


class MostlyWhole(nn.Module):
    """A wide layer whose activated output goes through a LayerNorm over its features (so it
    cannot be paired) and whose weight the forward also reads (so it cannot be gathered either),
    and a depthwise convolution: only the small output layer can be split."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 16, 5, padding=2, groups=16)
        self.wide = nn.Linear(16, 256)
        self.norm = nn.LayerNorm(256)
        self.out = nn.Linear(256, 4)

    def forward(self, x):
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.out(self.norm(torch.tanh(self.wide(h)))) * self.wide.weight.norm()


def test_warns_once_when_a_rank_would_hold_most_of_the_model():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(MostlyWhole(), world_size=2, example_inputs=(torch.randn(2, 3, 16),))
    mine = [w for w in caught if "would hold" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    message = str(mine[0].message)
    assert plan.held_fraction(0) > 0.6
    assert f"{plan.held_fraction(0):.0%}" in message and "an even split is 50%" in message
    assert "wide (" in message and "its output reaches an op that needs the whole axis" in message
    assert "conv (" in message and "a grouped or depthwise convolution whose input channels arrive whole" in message
    assert plan.layer("wide").style == "replicate" and plan.layer("out").style != "replicate"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_no_warning_for_models_that_split_well(kind, world_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(build(kind, device="meta"), world_size=world_size)
    assert not [str(w.message) for w in caught if "would hold" in str(w.message)]
    assert max(plan.held_fraction(r) for r in range(world_size)) <= 1 / world_size + 0.10
