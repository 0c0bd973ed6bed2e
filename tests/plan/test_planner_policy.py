"""The policy's decisions (csrc/plan/policy.cpp, the plan_policy op) on hand-written facts, at
their boundaries: the imbalance a rank may hold, when a plan gathering what cannot be paired is
made and kept, the collectives' pair cost by backend and world size, sequence_parallel="auto";
and questions it refuses, naming the field."""

import json

import pytest
import torch

import autoshard  # noqa: F401  (loads the compiled library)
from autoshard.planner import policy


def ask(**question):
    return json.loads(torch.ops.autoshard.plan_policy(json.dumps(question)))


def test_a_rank_at_exactly_its_share_plus_the_allowance_is_not_imbalanced():
    # 6/10 == 1/2 + 0.10 in floating point, as the plan's fractions are compared.
    assert 6 / 10 == 1 / 2 + 0.10
    at_limit = ask(ask="imbalance", world_size=2, parameters=10, fullest=6)
    assert at_limit == {"imbalanced": False, "limit": 1 / 2 + 0.10}
    assert ask(ask="imbalance", world_size=2, parameters=1000, fullest=601)["imbalanced"]
    assert not ask(ask="imbalance", world_size=4, parameters=1000, fullest=350)["imbalanced"]
    assert ask(ask="imbalance", world_size=4, parameters=1000, fullest=351)["imbalanced"]
    # One rank holds everything by definition; no parameters counted, nothing to say.
    assert not ask(ask="imbalance", world_size=1, parameters=10, fullest=10)["imbalanced"]
    assert not ask(ask="imbalance", world_size=2, parameters=0, fullest=0)["imbalanced"]


def test_a_second_plan_gathering_what_cannot_be_paired_only_past_the_allowance():
    facts = {"ask": "gather_unpaired", "world_size": 2, "parameters": 10, "largest_weight": 8000}
    at_limit = ask(**facts, fullest=6)
    assert at_limit["keep"] == "fewest_collectives" and "need" not in at_limit and "60.0%" in at_limit["why"]
    facts.update(parameters=1000, fullest=601)
    over = ask(**facts)
    assert over["need"] == "gathered_fullest" and over["gather_unpaired"] == 8000 // 8
    assert "60.1%" in over["why"] and "1000 weight elements" in over["why"]
    assert ask(**facts, gathered_fullest=600)["keep"] == "gathered"
    # A gathered plan no better (or worse) than the first: the first, with its fewer collectives.
    for gathered in (601, 700):
        kept = ask(**facts, gathered_fullest=gathered)
        assert kept["keep"] == "fewest_collectives" and "not kept" in kept["why"]
    # A model of small weights still gathers from one element; one rank never plans again.
    assert ask(**{**facts, "largest_weight": 7})["gather_unpaired"] == 1
    assert ask(**{**facts, "world_size": 1, "fullest": 1000})["keep"] == "fewest_collectives"


def test_decide_measures_only_what_the_policy_asks_for():
    asked = []

    def gathered_fullest(answer):
        asked.append(answer["gather_unpaired"])
        return 550

    facts = {"ask": "gather_unpaired", "world_size": 2, "parameters": 1000, "largest_weight": 80}
    assert policy.decide({**facts, "fullest": 600}, {"gathered_fullest": gathered_fullest})["keep"] == "fewest_collectives"
    assert asked == []
    assert policy.decide({**facts, "fullest": 700}, {"gathered_fullest": gathered_fullest})["keep"] == "gathered"
    assert asked == [10]


@pytest.mark.parametrize("backend, world_size, cost, measured", [
    ("nccl", 1, 1.0, True), ("nccl", 2, 1.0, True), ("nccl", 3, 1.0, True), ("nccl", 8, 1.0, True),
    ("gloo", 1, 0.9, True), ("gloo", 2, 0.9, True), ("gloo", 3, 1.05, True), ("gloo", 8, 1.05, True),
    # An unmeasured backend's pair is never assumed cheaper than the costliest measured.
    ("mpi", 2, 1.05, False), ("ucc", 4, 1.05, False),
])
def test_pair_cost_by_backend_and_world_size(backend, world_size, cost, measured):
    assert ask(ask="pair_cost", backend=backend, world_size=world_size) == {"pair_cost": cost, "measured": measured}


def _sequence(**facts):
    return ask(ask="sequence_parallel", **{"token_wise_region": True, "memory_budget": None, **facts})


def test_sequence_parallelism_where_the_pair_costs_no_more_than_the_all_reduce():
    nothing = _sequence(backend="nccl", world_size=2, token_wise_region=False, memory_budget=1)
    assert nothing == {"sequence_parallel": False, "why": "sequence parallelism: none possible (no token-wise region "
                                                          "between a row and a column layer)"}
    on = _sequence(backend="nccl", world_size=4)
    assert on["sequence_parallel"] and "on nccl at 4 ranks" in on["why"] and "cost 1x" in on["why"]
    assert "1/4 per rank" in on["why"]
    assert _sequence(backend="gloo", world_size=2)["sequence_parallel"]
    assert "cost 0.9x" in _sequence(backend="gloo", world_size=2)["why"]


def test_sequence_parallelism_on_a_costlier_backend_follows_the_budget():
    off = _sequence(backend="gloo", world_size=3)
    assert not off["sequence_parallel"] and "cost 1.05x" in off["why"] and "give memory_budget=" in off["why"]
    assert not _sequence(backend="mpi", world_size=2)["sequence_parallel"]
    budget = 3 * 2**30
    assert _sequence(backend="gloo", world_size=3, memory_budget=budget) == {"need": "peak_without"}
    within = _sequence(backend="gloo", world_size=3, memory_budget=budget, peak_without=budget)
    assert not within["sequence_parallel"]
    assert within["why"] == ("sequence parallelism off: without it the step's predicted peak, 3.00 GiB per rank, is "
                             "within the memory budget of 3.00 GiB per rank, and on gloo at 3 ranks its reduce-scatter "
                             "+ all-gather cost 1.05x the all-reduce they replace")
    over = {"backend": "gloo", "world_size": 3, "memory_budget": budget, "peak_without": budget + 1}
    assert _sequence(**over) == {"need": "peak_with"}
    fits = _sequence(**over, peak_with=budget)
    assert fits == {"sequence_parallel": True, "why": "sequence parallelism on: without it the step's predicted peak, "
                    "3.00 GiB per rank, exceeds the memory budget of 3.00 GiB per rank; with it 3.00 GiB, within it"}
    still_over = _sequence(**over, peak_with=budget + 1)
    assert still_over["sequence_parallel"] and "still over it: more ranks or a smaller batch" in still_over["why"]
    small = _sequence(backend="mpi", world_size=2, memory_budget=1536, peak_without=512)
    assert "512 B per rank, is within the memory budget of 1.50 KiB" in small["why"]
    assert "3.50 MiB" in _sequence(backend="gloo", world_size=4, memory_budget=1, peak_without=7 * 2**19,
                                   peak_with=1)["why"]


@pytest.mark.parametrize("question, named", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ({"world_size": 2}, '"ask"'),
    ({"ask": "everything"}, '"ask"'),
    ({"ask": "imbalance", "parameters": 10, "fullest": 6}, '"world_size"'),
    ({"ask": "imbalance", "world_size": 0, "parameters": 10, "fullest": 6}, '"world_size"'),
    ({"ask": "imbalance", "world_size": "2", "parameters": 10, "fullest": 6}, '"world_size"'),
    ({"ask": "imbalance", "world_size": 2, "parameters": -1, "fullest": 6}, '"parameters"'),
    ({"ask": "imbalance", "world_size": 2, "parameters": 10, "fullest": 6, "fuller": 7}, '"fuller"'),
    ({"ask": "gather_unpaired", "world_size": 2, "parameters": 10, "fullest": 6}, '"largest_weight"'),
    ({"ask": "pair_cost", "backend": 3, "world_size": 2}, '"backend"'),
    ({"ask": "sequence_parallel", "backend": "gloo", "world_size": 2, "token_wise_region": 1}, '"token_wise_region"'),
    ({"ask": "sequence_parallel", "backend": "gloo", "world_size": 3, "token_wise_region": True, "memory_budget": 0},
     '"memory_budget"'),
])
def test_a_malformed_question_is_refused_naming_the_field(question, named):
    text = question if isinstance(question, str) else json.dumps(question)
    with pytest.raises(ValueError, match="plan_policy") as refused:
        torch.ops.autoshard.plan_policy(text)
    assert named in str(refused.value)
