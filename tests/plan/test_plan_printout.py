"""print(plan) for deep models: identical blocks once, a summary first, every layer accounted for."""

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import autoshard
from autoshard.planner.name_ranges import fold, fold_names


def _expand(name: str) -> list:
    """The names a folded name stands for (ground truth for the fold: the plan's own list)."""
    parts = name.split(".")
    names = [[]]
    for part in parts:
        if re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", part) and ("-" in part or "," in part):
            indices = []
            for run in part.split(","):
                a, _, b = run.partition("-")
                indices += list(range(int(a), int(b or a) + 1))
            names = [n + [str(i)] for n in names for i in indices]
        else:
            names = [n + [part] for n in names]
    return [".".join(n) for n in names]


def test_fold_keeps_blocks_planned_differently_apart():
    entries = [(f"m.layers.{i}.q", "replicate" if i == 2 else "column") for i in range(6)]
    assert fold(entries) == [("m.layers.0-1,3-5.q", 5, "column"), ("m.layers.2.q", 1, "replicate")]
    # Experts inside blocks fold first, then the blocks around them; a lone block keeps its name.
    names = [f"m.layers.{i}.experts.{e}.w" for i in range(3) for e in range(4)] + ["m.layers.3.experts.0.w"]
    assert fold_names(names) == ["m.layers.0-2.experts.0-3.w", "m.layers.3.experts.0.w"]
    assert sorted(n for f in fold_names(names) for n in _expand(f)) == sorted(names)
    # Indices inside a name that are not whole path components never fold.
    assert fold_names(["h0.w", "h1.w"]) == ["h0.w", "h1.w"]


@pytest.mark.parametrize("layers", [4, 32])
def test_deep_llama_prints_each_block_once_with_a_summary(layers):
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = autoshard.plan(model, world_size=3)
    text = str(plan)
    lines = text.splitlines()
    assert len(lines) < 60, text
    assert lines[0] == "ShardingPlan for 3 ranks"
    summary = "\n".join(lines[1:6])
    assert f"the fullest rank holds {max(plan.held_fraction(r) for r in range(3)):.1%}" in summary
    forward = ", ".join(f"{k} x{v}" for k, v in plan.collectives("forward").items())
    assert f"collectives per step, forward: {forward}" in summary
    assert f"identical blocks shown once: model.layers.0-{layers - 1} ({layers})" in summary
    # Every layer of the plan is on some row of the table, with its style.
    table = lines[lines.index(next(l for l in lines if l.startswith("layer "))) + 2:]
    shown = {}
    for row in table:
        if row.startswith(" ") or ":" in row.split()[0]:
            break  # the lines after the table
        name, style = row.split()[:2]
        shown.update({n: style for n in _expand(name)})
    assert shown == {layer.module: layer.style for layer in plan.layers}
