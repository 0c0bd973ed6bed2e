"""parallelize() on Hugging Face models and a model of our own, on 2, 3 and 4 gloo ranks:
logits, collectives and one SGD step against the unsharded model."""

import json
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from gathered import forward_backward_as_planned, nonzero_counts, sgd_step_as_unsharded
from hf_models import CONFIGS, build
from multirank import run_on_ranks

KINDS = sorted(CONFIGS)


def _check_model(kind: str) -> dict:
    world = dist.get_world_size()
    reference = build(kind, seed=0)
    model = build(kind, seed=0)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, world_size=world)
    document = plan.to_json()
    autoshard.parallelize(model, plan)
    # Nothing is written into the plan: what parallelize decided lives on model.autoshard_state.
    assert plan.to_json() == document and model.autoshard_state.plan is plan
    forward, backward = forward_backward_as_planned(model, reference, plan, lambda m: m(input_ids=ids).logits,
                                                    rtol=1e-4, atol=1e-4)

    sgd_step_as_unsharded(model, reference, rtol=1e-4, atol=1e-5)
    styles = sorted({layer.style for layer in plan.layers})
    unpaired = sum(1 for layer in plan.layers if layer.reason == "gathered_unpaired")
    return {"kind": kind, "styles": styles, "forward": forward, "backward": backward, "unpaired": unpaired}


def _check_all_models():
    return [_check_model(kind) for kind in KINDS]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_hf_models_equal_unsharded(world_size):
    results = run_on_ranks(_check_all_models, world_size, timeout=600)
    for summary in results[0]:
        # The output head's; with sequence parallelism (Llama, Gemma) also one gather of the
        # tokens per row layer's reduce-scatter, and one before the output head; and one per
        # large layer that cannot be paired (BERT's masked-LM transform).
        split = summary["forward"].get("reduce_scatter", 0)
        assert summary["forward"].get("all_gather") == 1 + (split + 1 if split else 0) + summary["unpaired"], summary
        if world_size < 4 or summary["kind"] not in ("llama", "gemma"):
            assert "column" in summary["styles"] and "row" in summary["styles"], summary


class OwnModel(nn.Module):
    """Written with nn.Linear and EinsumDense; no names autoshard could key on."""

    def __init__(self):
        super().__init__()
        self.p = autoshard.nn.EinsumDense("btd,dnh->btnh", (None, 5, 4), input_shape=(None, 10), bias_axes="nh")
        self.q = autoshard.nn.EinsumDense("btnh,nhd->btd", (None, 10), input_shape=(None, 5, 4), bias_axes="d")
        self.a = nn.Linear(10, 22)
        self.b = nn.Linear(22, 10)
        self.norm = nn.LayerNorm(10)
        self.c = nn.Linear(10, 7)

    def forward(self, x):
        h = x + self.q(torch.tanh(self.p(x)))
        h = self.norm(h + self.b(torch.nn.functional.gelu(self.a(h))))
        return self.c(h)


def _check_own_model():
    torch.manual_seed(0)
    reference = OwnModel()
    model = OwnModel()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(3))
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    with autoshard.CommCounter() as forward:
        out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)
    assert nonzero_counts(forward) == plan.collectives("forward") == {"all_reduce": 2, "all_gather": 1}
    with autoshard.CommCounter() as backward:
        out.pow(2).sum().backward()
    # p reads the model input, which needs no gradient: only a and c all-reduce theirs.
    assert nonzero_counts(backward) == plan.collectives("backward") == {"all_reduce": 2}, (nonzero_counts(backward), plan.collectives("backward"), str(plan))
    reference(x).pow(2).sum().backward()
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    got = autoshard.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    return [type(getattr(model, name)).__name__ for name in "pqabc"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_own_model(world_size):
    names = run_on_ranks(_check_own_model, world_size)[0]
    assert names == ["ShardedEinsumDense", "ShardedEinsumDense", "ColumnParallelLinear", "RowParallelLinear",
                     "ColumnParallelLinear"]


def _bad_plans():
    model = build("llama", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = []
    wrong_world = autoshard.plan(model, world_size=dist.get_world_size() + 1)
    for bad in (wrong_world, "plan"):
        try:
            autoshard.parallelize(model, bad)
        except (ValueError, TypeError) as error:
            errors.append(str(error))
    try:
        autoshard.parallelize(model, partition_optimizer_state="yes")
    except TypeError as error:
        errors.append(str(error))
    plan = autoshard.plan(model, world_size=dist.get_world_size())
    # A plan edited by hand (in its JSON document: a built plan cannot be changed in place).
    document = json.loads(plan.to_json())
    document["regions"][str(plan.layer("model.layers.0.self_attn.q_proj").region)]["attributes"]["head_dim"] = 8
    plan = autoshard.ShardingPlan.from_json(json.dumps(document))
    try:
        autoshard.parallelize(model, plan)
    except ValueError as error:
        errors.append(str(error))
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    untouched = all(type(m).__name__ != "ColumnParallelLinear" for m in model.modules())
    return errors, unchanged and untouched


def _plans_compared_across_ranks():
    rank = dist.get_rank()
    # Example inputs of the same shapes and other values on each rank give the same plan.
    model = build("llama", seed=0)
    plan = autoshard.plan(model, world_size=2, example_inputs={"input_ids": torch.full((2, 8), 3 + rank)})
    autoshard.parallelize(model, plan)
    # Plans that differ (rank 1 replicates the MLPs) are refused on every rank.
    other = build("llama", seed=0)
    plan = autoshard.plan(other, world_size=2, overrides={"*.mlp.*": "replicate"} if rank else None)
    try:
        autoshard.parallelize(other, plan)
    except ValueError as error:
        return str(error)
    return None


def test_ranks_compare_their_plans_but_not_their_example_values():
    for message in run_on_ranks(_plans_compared_across_ranks, 2):
        assert message is not None and "the ranks did not build the same model and plan" in message, message


def _dry_run_refused_on_one_rank():
    """parallelize's dry run shards a meta copy for its own rank only; where it refuses the plan
    on one rank (at 3 ranks one rank's heads may divide otherwise), every rank plans again."""
    module = sys.modules["autoshard.parallelize"]
    real = module.dry_run

    def refusing(model, plan, group, example_inputs, apply):
        if group.rank() == 1 and plan.layer("model.layers.0.self_attn.q_proj").style.is_split:
            error = ValueError("parallelize: on a meta copy of the model, rank 1 computed other shapes; the plan "
                               "was refused and the model left unchanged")
            error.module = "model.layers.0.self_attn"
            raise error
        return real(model, plan, group, example_inputs, apply)

    module.dry_run = refusing
    try:
        model = autoshard.parallelize(build("llama", seed=0))
    finally:
        module.dry_run = real
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    sharded = model(input_ids=ids).logits
    whole = build("llama", seed=0)(input_ids=ids).logits
    styles = {layer.module: layer.style.value for layer in model.autoshard_state.plan.layers}
    return styles, torch.allclose(sharded, whole, atol=1e-5)


def test_a_dry_run_refused_on_one_rank_is_planned_again_on_every_rank():
    results = run_on_ranks(_dry_run_refused_on_one_rank, 3)
    styles = [r[0] for r in results]
    assert styles[0] == styles[1] == styles[2]
    assert styles[0]["model.layers.0.self_attn.q_proj"] == "replicate"
    assert styles[0]["model.layers.0.mlp.up_proj"] == "column"  # what no rank refused stays split
    assert all(r[1] for r in results)


class _TablesInProcessOrder(nn.Module):
    """Makes two tables in an order that differs between processes (as a forward iterating over a
    set of strings does, Gemma 4's rotary tables per layer type), then an MLP reads them."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        order = ("cos", "sin") if dist.get_rank() % 2 == 0 else ("sin", "cos")
        tables = {name: getattr(torch, name)(x) for name in order}
        return self.down(torch.relu(self.up(tables["cos"] * tables["sin"] + x)))


def _plans_whose_traces_number_tensors_otherwise():
    torch.manual_seed(0)
    model = _TablesInProcessOrder()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    want = _TablesInProcessOrder()
    want.load_state_dict(model.state_dict())
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    made_here = autoshard.parallelize(_TablesInProcessOrder(), example_inputs=(x,)).autoshard_state.plan
    return torch.allclose(model(x), want(x), atol=1e-6), made_here.layer("up").style.value


def test_plans_agree_though_their_traces_number_tensors_in_another_order():
    for same, style in run_on_ranks(_plans_whose_traces_number_tensors_otherwise, 2):
        assert same and style == "column"


def test_bad_plans_leave_the_model_untouched():
    errors, untouched = run_on_ranks(_bad_plans, 2)[0]
    assert untouched
    assert len(errors) == 4
    assert "world_size=3" in errors[0] and "2 ranks" in errors[0]
    assert "plan must be a ShardingPlan" in errors[1]
    assert "partition_optimizer_state must be a bool, got str" in errors[2]
    assert "meta copy" in errors[3] and "left unchanged" in errors[3]
