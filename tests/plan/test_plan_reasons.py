"""One table of reason codes and their words (csrc/plan/reasons.cpp): every code a plan gives,
from the planner or around it, has its words there, and print(plan) says them."""

import json
import warnings

import pytest
import torch

import autoshard
from autoshard.planner import holdings, parameter_reasons
from hf_models import build


def test_table_comes_from_the_planner():
    table = json.loads(torch.ops.autoshard.plan_reasons())
    assert holdings.REASONS == table
    assert all(isinstance(words, str) and words for words in table.values())
    # The codes given around the planner are in the same table.
    assert {parameter_reasons.CONVOLUTION, parameter_reasons.FUNCTIONAL_LAYER, parameter_reasons.NOT_CALLED,
            "attention_unpaired", "shape_mismatch",
            "dry_run_mismatch", "not_a_layer", "row_bias", "position_table", "unsplit", "adapter_factor"} <= set(table)


@pytest.mark.parametrize("kind", ["bert", "llama", "gpt2"])
def test_every_code_of_a_plan_has_words_and_is_printed(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(build(kind, device="meta"), world_size=3,
                              overrides={"*.0.mlp*": "replicate"} if kind == "llama" else None)
    codes = {layer.reason for layer in plan.layers if layer.reason} | {item.reason for item in plan.replicated()}
    assert codes and codes <= set(holdings.REASONS), codes - set(holdings.REASONS)
    text = str(plan)
    for item in plan.replicated():
        assert holdings.REASONS[item.reason] in text
