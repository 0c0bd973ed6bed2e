"""The plan autoshard.plan() returns is the plan that runs: the README's way
(`plan = autoshard.plan(model)`, then `parallelize(model, plan)`) runs every model that
`parallelize(model)` runs, with the same plan, and equals the unsharded model.

CTRL's attention views its heads with a size written into the model: planned from the dataflow
alone, its dry run on a meta copy computes [2, 4, 32] where the plan predicts [2, 8, 32], and a
plan handed to parallelize used to be refused there, while parallelize(model) planned again."""

import os
import sys

import pytest
import torch

import autoshard
from autoshard.planner import plan_json
from autoshard.core.parallel_state import state_of
from checks import worst_gradient_difference
from multirank import run_on_ranks

SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "sweep")
if SWEEP not in sys.path:
    sys.path.insert(0, SWEEP)
import catalogue  # noqa: E402


def _model_and_inputs(name: str):
    torch.manual_seed(0)
    model = catalogue.build(catalogue.by_name(name)).double()
    return model, catalogue.autoshard_inputs(model, torch.Generator().manual_seed(0))


def _offline_plan_holds_ctrl_attention_whole():
    model, inputs = _model_and_inputs("ctrl:causal")
    plan = autoshard.plan(model, world_size=2, example_inputs=inputs)
    return {layer.module: layer.reason for layer in plan.layers if not layer.style.is_split}


def test_offline_plan_is_repaired_and_says_why():
    whole = _offline_plan_holds_ctrl_attention_whole()
    # What the meta copy computed otherwise is held whole, with the dry run's finding as reason.
    assert whole, "the plan held nothing whole: CTRL's attention cannot be split by its dataflow alone"
    assert set(whole.values()) == {"dry_run_mismatch"}, whole
    assert all(".multi_head_attention." in name for name in whole), whole


def _readme_way_against_parallelize_alone(world_size: int):
    rank = torch.distributed.get_rank()
    model, inputs = _model_and_inputs("ctrl:causal")
    reference, _ = _model_and_inputs("ctrl:causal")
    auto_model, _ = _model_and_inputs("ctrl:causal")
    printed = autoshard.plan(model, example_inputs=inputs)
    autoshard.parallelize(model, printed, example_inputs=inputs)  # refused before: shapes differed
    autoshard.parallelize(auto_model, example_inputs=inputs)
    ran = state_of(auto_model).plan
    same_plan = plan_json.dumps(printed, input_values=False) == plan_json.dumps(ran, input_values=False)
    # Only rank 0 plans again here: plan() makes no collective, so one rank alone may print it.
    if rank == 0:
        alone = plan_json.dumps(autoshard.plan(reference, world_size=world_size, example_inputs=inputs),
                                input_values=False)
        same_plan = same_plan and alone == plan_json.dumps(printed, input_values=False)
    torch.distributed.barrier()
    # Float64 throughout (a loss of the labels is computed in float32 by transformers).
    want = reference(**inputs).logits
    weights = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(2))
    (want * weights).sum().backward()
    worst = 0.0
    for candidate in (model, auto_model):
        out = candidate(**inputs).logits
        (out * weights).sum().backward()
        worst = max(worst, (out - want).abs().max().item(), worst_gradient_difference(candidate, reference))
    return same_plan, worst


@pytest.mark.parametrize("world_size", [2, 3])
def test_readme_way_runs_what_parallelize_runs(world_size):
    for same_plan, worst in run_on_ranks(_readme_way_against_parallelize_alone, world_size, world_size, timeout=300):
        assert same_plan, "the printed plan is not the plan parallelize(model) runs"
        assert worst < 1e-10, worst
