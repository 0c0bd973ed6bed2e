"""sequence_parallel="auto" (planner/sequence_choice.py): sequence parallelism where it pays, from
the backend's cost of the reduce-scatter + all-gather pair and the step's predicted peak against
a memory budget, with the reason in the plan; and parallelize applying the choice exactly."""

import pytest
import torch
from torch import nn

import autoshard
from autoshard.planner import sequence_choice
from checks import expect_errors
from hf_models import build
from multirank import run_on_ranks


def _peak(model, sequence_parallel: bool, world_size: int = 3) -> int:
    return autoshard.plan(model, world_size=world_size, sequence_parallel=sequence_parallel).memory().largest().peak


def _splits_tokens(plan) -> bool:
    return any(layer.sequence for layer in plan.layers)


def test_on_gloo_at_three_ranks_it_is_on_only_where_the_budget_needs_it():
    # gloo's pair costs a little more than the all-reduce at 3 ranks and more.
    model = build("llama")
    without, with_tokens_split = _peak(model, False), _peak(model, True)
    assert with_tokens_split < without  # what there is to gain
    plain = autoshard.plan(model, world_size=3, sequence_parallel="auto")
    assert not _splits_tokens(plain) and f"{sequence_choice.pair_cost('gloo', 3):g}x" in plain.sequence_choice and "memory_budget=" in plain.sequence_choice
    roomy = autoshard.plan(model, world_size=3, sequence_parallel="auto", memory_budget=without)
    assert not _splits_tokens(roomy) and "is within" in roomy.sequence_choice
    tight = autoshard.plan(model, world_size=3, sequence_parallel="auto", memory_budget=without - 1)
    assert _splits_tokens(tight) and "exceeds" in tight.sequence_choice and "within it" in tight.sequence_choice
    too_tight = autoshard.plan(model, world_size=3, sequence_parallel="auto", memory_budget=with_tokens_split - 1)
    assert _splits_tokens(too_tight) and "still over it" in too_tight.sequence_choice
    # The chosen plans are the plans asked for by hand, and the reason is printed and kept in JSON.
    assert tight.to_json().replace(tight.sequence_choice, "") == autoshard.plan(
        model, world_size=3, sequence_parallel=True).to_json()
    assert tight.sequence_choice in str(tight)
    assert autoshard.ShardingPlan.from_json(tight.to_json()).sequence_choice == tight.sequence_choice


def test_where_the_pair_costs_what_the_all_reduce_costs_it_is_on():
    model = build("llama")
    for backend, world_size in (("nccl", 2), ("nccl", 3), ("gloo", 2)):
        on, why = sequence_choice.choose(model, world_size, None, None, None, backend)
        assert on and f"{sequence_choice.pair_cost(backend, world_size):g}x" in why, (backend, world_size, why)
    # Without a budget, on gloo at 3 ranks and on a backend nobody measured: off.
    assert not sequence_choice.choose(model, 3, None, None, None, "gloo")[0]
    assert not sequence_choice.choose(model, 2, None, None, None, "mpi")[0]
    measured = [sequence_choice.pair_cost(backend, world_size) for backend in ("nccl", "gloo") for world_size in (2, 3)]
    assert sequence_choice.pair_cost("mpi", 2) >= max(measured)


def test_a_model_without_a_token_wise_region_has_nothing_to_choose():
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    plan = autoshard.plan(model, world_size=2, example_inputs=(torch.randn(2, 5, 8),), sequence_parallel="auto",
                          memory_budget=1)
    assert not _splits_tokens(plan) and "none possible" in plan.sequence_choice


def test_backend_of_reads_the_device_and_the_group():
    assert sequence_choice.backend_of(nn.Linear(2, 2)) == "gloo"


def test_bad_arguments_are_named():
    model = build("llama")
    expect_errors([
        (lambda: autoshard.plan(model, world_size=2, sequence_parallel="yes"), ValueError, ["sequence_parallel", "auto"]),
        (lambda: autoshard.plan(model, world_size=2, memory_budget=10), ValueError, ["memory_budget", "\"auto\""]),
        (lambda: autoshard.plan(model, world_size=2, sequence_parallel="auto", memory_budget=0), ValueError,
         ["memory_budget", "positive int"]),
        (lambda: autoshard.parallelize(model, sequence_parallel=None), ValueError, ["parallelize", "sequence_parallel"]),
    ])


def _parallelize_auto(budget: int) -> dict:
    reference, model = build("llama").train(), build("llama").train()
    autoshard.parallelize(model, sequence_parallel="auto", memory_budget=budget)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(4))
    with autoshard.CommCounter() as counter:
        loss = model(input_ids=ids, labels=ids).loss
    want = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    plan = model.autoshard_state.plan
    return {"choice": plan.sequence_choice, "reduce_scatter": counter.counts.get("reduce_scatter", 0)}


def test_parallelize_applies_the_choice():
    # At 3 gloo ranks the budget decides.
    without = _peak(build("llama"), False)
    tight = run_on_ranks(_parallelize_auto, 3, without - 1)[0]
    assert tight["choice"].startswith("sequence parallelism on") and tight["reduce_scatter"] > 0, tight
    roomy = run_on_ranks(_parallelize_auto, 3, without)[0]
    assert roomy["choice"].startswith("sequence parallelism off") and roomy["reduce_scatter"] == 0, roomy
    # At 2 gloo ranks the pair costs no more than the all-reduce: on, whatever the budget.
    two = run_on_ranks(_parallelize_auto, 2, _peak(build("llama"), False, 2))[0]
    assert two["choice"].startswith("sequence parallelism on: on gloo at 2 ranks") and two["reduce_scatter"] > 0, two


def test_cli_chooses_with_the_budget_at_the_batch_given(capsys):
    from autoshard.__main__ import main

    config = ["--set", "num_hidden_layers=2", "--set", "hidden_size=48", "--set", "intermediate_size=70",
              "--set", "num_attention_heads=6", "--set", "num_key_value_heads=3", "--set", "vocab_size=101"]
    common = ["plan", "--model-type", "llama", "--world-size", "3", *config, "--batch", "4", "--seq", "64",
              "--sequence-parallel", "auto", "--backend", "gloo"]
    assert main(common + ["--memory-budget", "0.0001"]) == 0
    assert "sequence parallelism on: without it the step's predicted peak" in capsys.readouterr().out
    assert main(common + ["--memory-budget", "64"]) == 0
    assert "sequence parallelism off: without it the step's predicted peak" in capsys.readouterr().out
    assert main(common[:-2] + ["--backend", "nccl"]) == 0
    assert "sequence parallelism on: on nccl" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model-type", "llama", "--world-size", "2", "--memory-budget", "1"])
    assert "--sequence-parallel auto" in capsys.readouterr().err
