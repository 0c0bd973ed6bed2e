"""The automatic sharding plan: capture a model's dataflow on meta, plan it in C++."""

import fnmatch
import json
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from ..nn.multihead_attention import IN_PROJECTION
from ..core.styles import OVERRIDE_STYLES, Style
from ..capture.capture import CapturedGraph, capture
from .holdings import fullest_holding, imbalance_warning, inventory, nothing_split_error
from .parameter_reasons import whole_reasons
from . import policy
from .local_attributes import localize_attributes
from .prediction import ShapeMismatch
from .read_answer import element_size, read_answer
from .sharding_plan import ShardingPlan



def _split_together(graph: CapturedGraph) -> List[List[int]]:
    """The planner's "together" pairs (csrc/plan/graph.h): the q/k/v projection and out_proj of
    each nn.MultiheadAttention, which ParallelMultiheadAttention splits only by heads together."""
    nodes = {info.name: node for node, info in graph.layers.items()}
    modules = dict(graph.shadow.named_modules())
    # By the module's class, not the layers' names: Mamba's mixer has an in_proj and an out_proj too.
    return [[node, nodes[owner + ".out_proj"]] for name, node in nodes.items()
            for owner, _, child in [name.rpartition(".")] if child == IN_PROJECTION and owner + ".out_proj" in nodes
            and isinstance(modules.get(owner), nn.MultiheadAttention)]


def check_plain_parameters(model: nn.Module, caller: str) -> None:
    """Refuses a model holding a parameter of a tensor subclass (a torchao quantized weight, an
    FSDP DTensor): autoshard splits plain tensors, and a subclass's own data and scales would be
    cut without it knowing. Raised before anything is changed."""
    for name, param in model.named_parameters():
        if type(param) not in (nn.Parameter, torch.Tensor):
            kind = type(param)
            raise TypeError(
                f"{caller}: parameter {name!r} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass (a "
                "quantized weight, a DTensor), whose data autoshard cannot split; parallelize the model with plain "
                "weights, and quantize (torchao's quantize_) or shard over data parallelism (FSDP) after it only "
                "where the documentation says that composes (docs/with-other-tools.md)")


def plan_keeping_whole(model: nn.Module, world_size: int, example_inputs, overrides: Optional[Dict[str, str]],
                       sequence_parallel: bool, whole: Dict[str, str], fold_blocks: bool = True,
                       sequence_choice: str = "", gather_unpaired: bool = True) -> ShardingPlan:
    """plan() with the layers under each module pattern of `whole` (fnmatch on module names)
    held whole for the reason given: modules whose sharded forward did not compute what the
    plan predicted on a meta copy (see parallelize), planned again without them. With
    `fold_blocks` identical blocks are run once and recorded again for the others (folding.py)."""
    graph = capture(model, example_inputs, fold_blocks)
    forced = []
    for pattern, style in (overrides or {}).items():
        if style not in OVERRIDE_STYLES:
            raise ValueError(f"plan: override for {pattern!r} must be one of {tuple(s.value for s in OVERRIDE_STYLES)}, "
                             f"got {style!r}")
        hits = [node for node, info in graph.layers.items()
                if fnmatch.fnmatchcase(info.name, pattern) or fnmatch.fnmatchcase(graph.param_names[info.weight_param], pattern)]
        if not hits:
            raise ValueError(f"plan: override pattern {pattern!r} names no layer or parameter of the model")
        for node in hits:
            if style == Style.COLUMN_GATHER and not graph.layers[node].construct.column_gather_override:
                raise ValueError(f"plan: override {pattern!r}: only Linear layers can be column_gather")
            forced.append({"node": node, "style": style})
    # Layers replicated because their region's module computes other shapes than the plan
    # predicts on some rank (a size written into the model as a constant): node -> why.
    held_whole: Dict[int, str] = {node: why for node, info in graph.layers.items()
                                  for pattern, why in whole.items() if within(info.name, pattern)}
    together = _split_together(graph)

    def settled(gather_unpaired: int) -> ShardingPlan:
        mismatched = dict(held_whole)
        while True:
            # What the model was seen to compute with these layers split: the planner holds them
            # whole and says why.
            observations = [{"node": node, "kind": "dry_run_mismatch" if node in held_whole else "shape_mismatch",
                             "detail": why} for node, why in mismatched.items()]
            document = torch.ops.autoshard.plan_graph(
                json.dumps({**graph.document, "forced": forced, "observations": observations,
                            "sequence_parallel": sequence_parallel, "together": together,
                            "gather_unpaired": gather_unpaired}),
                world_size)
            result = read_answer(document, graph, world_size, element_size(model))
            too_small = [layer for layer in result.layers if layer.reason == "too_few_units"]
            if too_small and not any(layer.style.is_split for layer in result.layers):
                raise ValueError(f"plan: world_size={world_size} is larger than every dimension autoshard could "
                                 f"split (e.g. {too_small[0].module}: only {too_small[0].whole_units} whole unit(s) "
                                 f"(heads) to split across {world_size} ranks)")
            if world_size <= 1:
                break
            failures: Dict[int, ShapeMismatch] = {}
            localize_attributes(result, result.prediction, failures=failures)
            if not failures:
                break
            found = {node: str(failures[layer.region]) for node, info in graph.layers.items()
                     for layer in [result.layer(info.name)]
                     if layer.style.is_split and layer.region in failures and node not in mismatched}
            if not found:
                raise next(iter(failures.values()))
            mismatched.update(found)
        result.parameters = inventory(graph.shadow)
        whole_reasons(result.parameters, graph)
        return result

    # The fewest collectives first; where that leaves a rank too much of the parameters, the policy
    # asks for a plan with the large layers that cannot be paired split and gathered instead
    # (reason gathered_unpaired), and says which to keep.
    plans = {"fewest_collectives": settled(gather_unpaired=0)}

    def gathered_fullest(answer: dict) -> int:
        plans["gathered"] = settled(gather_unpaired=answer["gather_unpaired"])
        return fullest_holding(plans["gathered"])[0]

    keep = "fewest_collectives"
    if gather_unpaired:
        fullest, total = fullest_holding(plans["fewest_collectives"])
        keep = policy.decide({"ask": "gather_unpaired", "world_size": world_size, "parameters": total,
                              "fullest": fullest, "largest_weight": _largest_weight_outside_vocabulary(model)},
                             {"gathered_fullest": gathered_fullest})["keep"]
    result = plans[keep]
    # The modules' recorded inputs are views of the model's own tensors (its buffers): kept, they
    # would hold those tensors' use counts up, and load_pretrained could not give them storage in
    # place. Only the attribute choice above replays them.
    graph.module_inputs.clear()
    graph.values = None
    result.input_values = graph.input_values  # the dry run in parallelize() replays these
    result.overrides = dict(overrides or {})
    result.sequence_choice = sequence_choice
    result._seal()
    _warn_if_mostly_whole(result)
    return result


def _largest_weight_outside_vocabulary(model: nn.Module) -> int:
    """The elements of the model's largest weight outside its vocabulary (its token tables, and a
    head over them, which the plan splits anyway): what the policy sizes the layers that cannot
    be paired and are still gathered by."""
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    return max((p.numel() for p in model.parameters() if p.dim() >= 2 and p.shape[0] != vocab), default=0)


def within(name: str, pattern: str) -> bool:
    """Whether module `name` is a module matching `pattern` or inside one ("" is the model)."""
    return pattern == "" or fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def _warn_if_mostly_whole(result: ShardingPlan) -> None:
    """One warning per plan when a rank would hold more of the parameters than the policy allows
    (on the first rank only, when the ranks plan together). A plan that splits nothing is not
    warned of: parallelize refuses it (holdings.nothing_split_error) and print(plan) shows it."""
    if nothing_split_error(result):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    message = imbalance_warning(result)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)
