"""Identical blocks are run once during the capture and recorded again for the others: the plan
must be exactly the plan of a capture that runs every block, and a block that only looks
identical (it computes otherwise) must not give a plan that computes something else."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from gathered import assert_equals_unsharded
from hf_models import build
from multirank import run_on_ranks

from autoshard.planner.make_plan import plan_keeping_whole



def _plans(model, world_size, example_inputs=None):
    """(folded plan, plan of every block run): JSON document (less the prediction) and every rank's predicted nodes."""
    result = []
    for fold in (True, False):
        p = plan_keeping_whole(model, world_size, example_inputs, None, True, {}, fold_blocks=fold)
        # The prediction's graph numbers its tensors in the order they were recorded, which
        # folding changes; what it predicts is compared node by node.
        document = json.loads(p.to_json())
        document.pop("prediction")
        result.append((document, [p.prediction.nodes(r) for r in range(world_size)],
                       dict(p.prediction.graph.folded)))
    return result


@pytest.mark.parametrize("kind,layers,folded", [("llama", 4, 3), ("gpt2", 3, 2), ("bert", 3, 2), ("opt", 3, 2)])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_folded_plan_equals_the_plan_of_every_block(kind, layers, folded, world_size):
    key = {"gpt2": "n_layer"}.get(kind, "num_hidden_layers")
    model = build(kind, device="meta", **{key: layers})
    (doc, nodes, folds), (doc_all, nodes_all, folds_all) = _plans(model, world_size)
    assert len(folds) == folded and folds_all == {}
    assert doc == doc_all
    assert nodes == nodes_all


def test_blocks_of_two_kinds_fold_onto_their_own_first():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", hidden_size=48, intermediate_size=70, num_hidden_layers=4,
                                  num_attention_heads=6, num_key_value_heads=3, head_dim=8, vocab_size=101,
                                  sliding_window=4)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    (doc, nodes, folds), (doc_all, nodes_all, _) = _plans(model, 3)
    assert folds == {"model.layers.2": "model.layers.0", "model.layers.3": "model.layers.1"}
    assert doc == doc_all and nodes == nodes_all


class Block(nn.Module):
    def __init__(self, index: int, flip_at: int = -1):
        super().__init__()
        self.layer_idx = index
        self.flip_at = flip_at  # the same in every block: the blocks look identical
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 12)

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.layer_idx == self.flip_at:  # computes otherwise, from its index alone
            h = h.flip(-1)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, flip_at: int = -1, narrow_second: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, flip_at) for i in range(3))
        self.narrow_second = narrow_second

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.cat([block(x[:, :3]), x[:, 3:]], 1) if self.narrow_second and i == 1 else block(x)
        return x


def test_a_block_called_with_other_shapes_is_run():
    (doc, nodes, folds), (doc_all, nodes_all, _) = _plans(Stack(narrow_second=True), 2, (torch.zeros(2, 5, 12),))
    assert folds == {"blocks.2": "blocks.0"}  # blocks.1 saw a (2, 3, 12) input: it ran
    assert doc == doc_all and nodes == nodes_all


def _parallelize_stack_that_flips():
    torch.manual_seed(0)
    model, reference = Stack(flip_at=1), Stack(flip_at=1)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    refusal = None
    # The plan of the dataflow alone, before any dry run: block 1 recorded as block 0.
    folded = plan_keeping_whole(model, dist.get_world_size(), (x,), None, True, {})
    try:  # given explicitly: refused with the folded block named
        autoshard.parallelize(Stack(flip_at=1), folded)
    except ValueError as error:
        refusal = str(error)
    # autoshard.plan, as parallelize(model), plans again running every block: the plan that runs.
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    assert_equals_unsharded(model, reference, (x,), rtol=1e-5, atol=1e-6)
    return (dict(folded.prediction.graph.folded), refusal, dict(plan.prediction.graph.folded),
            model.autoshard_state.plan.layer("blocks.1.up").style)


def test_a_block_that_only_looks_identical_is_never_planned_as_its_first():
    folds, refusal, folds_that_run, style = run_on_ranks(_parallelize_stack_that_flips, 2)[0]
    assert folds == {"blocks.1": "blocks.0", "blocks.2": "blocks.0"}
    assert refusal is not None and "'blocks.1' was recorded as identical to 'blocks.0'" in refusal, refusal
    assert folds_that_run == {}, folds_that_run
    # The flip reads the whole feature axis: planned from its own trace, block 1 is not paired
    # there (held whole, or gathered where the plan would otherwise be imbalanced).
    assert style in ("replicate", "column_gather"), style


class _MLP(nn.Module):
    """segment-anything's mask decoder MLP: a ModuleList of Linears, the first two alike."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class _Hypernetworks(nn.Module):
    """Identical blocks (MLPs) holding identical blocks (Linears), as its output_hypernetworks_mlps."""

    def __init__(self):
        super().__init__()
        self.mlps = nn.ModuleList([_MLP() for _ in range(3)])

    def forward(self, x):
        return torch.stack([mlp(x[:, i]) for i, mlp in enumerate(self.mlps)], dim=1)


def test_identical_blocks_inside_identical_blocks_fold_to_the_plan_of_every_block():
    (doc, nodes, folds), (doc_all, nodes_all, _) = _plans(_Hypernetworks(), 2, (torch.ones(2, 3, 8),))
    assert folds == {"mlps.1": "mlps.0", "mlps.2": "mlps.0"}, folds
    assert doc == doc_all and nodes == nodes_all


def _nested_blocks_exact():
    torch.manual_seed(0)
    reference = _Hypernetworks().double()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model = autoshard.parallelize(_Hypernetworks().double(), example_inputs=(x,))
    assert_equals_unsharded(model, reference, (x,), rtol=1e-10, atol=1e-10)
    return sorted(layer.module for layer in model.autoshard_state.plan.layers if layer.style.is_split)


def test_identical_blocks_inside_identical_blocks_train_exactly():
    for split in run_on_ranks(_nested_blocks_exact, 2, timeout=300):
        assert "mlps.2.layers.1" in split, split  # a block folded inside a folded block is split too
