"""The automatic sharding plan: capture a model's dataflow on meta, plan it in C++."""

import fnmatch
import json
import re
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from ..nn.multihead_attention import IN_PROJECTION
from ..core.styles import OVERRIDE_STYLES, Style
from ..capture.capture import CapturedGraph, capture
from .holdings import IMBALANCE, fullest_fraction, imbalance_warning, inventory
from .parameter_reasons import whole_reasons
from .local_attributes import localize_attributes
from .prediction import Prediction, ShapeMismatch
from .records import (
    AdapterFactors,
    Collective,
    GatheredParameter,
    HeadCut,
    HeadParameter,
    PartialGradientBucket,
    ReturnedAttentionWeights,
    SplitNorm,
    SummedOutput,
    TokenCut,
)
from .layer_plan import LayerPlan, RegionPlan
from .sharding_plan import ShardingPlan



def _element_size(model: nn.Module) -> int:
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def _parse(document: str, graph: CapturedGraph, world_size: int, element_size: int) -> ShardingPlan:
    """The planner's JSON document (csrc/plan/emit_json.cpp) as a ShardingPlan."""
    data = json.loads(document)
    if data.get("version") != 2:
        raise RuntimeError(f"plan: the planner answered with document version {data.get('version')!r}, "
                           f"this layer reads version {2}; rebuild the extension")
    names = graph.param_names
    # The planner names parameters by index in its notes (csrc/plan/head_params.cpp).
    named = lambda text: re.sub(r"parameter #(\d+)", lambda m: f"parameter {names[int(m.group(1))]!r}", text)
    layers = []
    for record in data["layers"]:
        info = graph.layers[record["node"]]
        shape = info.construct.weight_shape(info)
        style = Style(record["style"])
        units, parts = info.construct.stored_layout(info, record["units"] if style.is_split else 0, record["parts"])
        layers.append(LayerPlan(
            module=info.name, kind=info.kind, style=style, weight=names[info.weight_param],
            bias=names[info.bias_param] if info.bias_param >= 0 else None, weight_shape=shape,
            transposed=info.transposed, units=units, parts=parts,
            whole_parts=record["whole_parts"], summed_parts=record["summed_parts"],
            region=record["region"], copy_group=record["copy_group"],
            deferred_copy=record.get("deferred_copy", False), note=named(record["note"]),
            equation=info.equation, letter=record["letter"], repeat=record["repeat"], reason=record["reason"],
            bias_axes=info.bias_axes,
            sequence=record["sequence"], sequence_dim=record["sequence_dim"],
            sequence_region=record["sequence_region"], sequence_note=named(record["sequence_note"]),
            whole_units=record["whole_units"],
        ))
    comm = [Collective(c["phase"], c["kind"], c["count"], c["elements"] * element_size) for c in data["comm"]]
    partial = [PartialGradientBucket([names[i] for i in bucket["params"]], bucket["elements"] * element_size)
               for bucket in data["partial_gradients"]]
    region_plans = {}
    for record in data["regions"]:
        region = record["id"]
        region_plans[region] = RegionPlan(units=record["units"], module=record["module"],
                                          repeat=record["repeat"], coarse_units=record["coarse_units"],
                                          coarse_sizes=record["coarse_localize"], localize=record["localize"])
    _attention_copies(region_plans, data["regions"], graph)
    norms = []
    for record in data.get("norms", []):
        node = graph.document["nodes"][record["node"]]
        weight, bias = node.get("weight_param", -1), node.get("bias_param", -1)
        norms.append(SplitNorm(node["label"], names[weight] if weight >= 0 else None, record["features"],
                               region_plans[record["region"]].units, record["region"],
                               bias=names[bias] if bias >= 0 else None, centered=bool(node.get("centered")),
                               per_channel=bool(node.get("per_channel")),
                               running_stats=bool(node.get("running_stats"))))
    token_cut = lambda e: TokenCut(e["module"], e["leaf"], e["dim"], e["region"])
    head_cut = lambda e: HeadCut(e["module"], e["axis"], e["outer"], e["size"], e["region"], e.get("leaf", 0))
    result = ShardingPlan(world_size=world_size, layers=layers, regions=region_plans, comm=comm,
                          partial_gradients=partial,
                          sequence_entries=[token_cut(e) for e in data["sequence_entries"]],
                          sequence_gathers=[token_cut(e) for e in data["sequence_gathers"]],
                          sequence_exits=[token_cut(e) for e in data["sequence_exits"]],
                          head_entries=[head_cut(e) for e in data.get("head_entries", [])],
                          head_outputs=[head_cut(e) for e in data.get("head_outputs", [])],
                          attention_weights=[ReturnedAttentionWeights(graph.nodes[w["node"]][0], w["used"])
                                             for w in data.get("attention_weights", [])],
                          norms=norms,
                          head_parameters=[HeadParameter(names[p["param"]], p["axis"], p["size"], p["region"],
                                                         graph.layers[p["layer"]].name if p.get("layer", -1) >= 0 else "",
                                                         list(p.get("parts", [])))
                                           for p in data.get("head_params", [])],
                          gathered_parameters=[GatheredParameter(names[p["param"]], p["axis"], p["size"],
                                                                 p["elements"], graph.gather_calls.get(p["param"], ""))
                                               for p in data.get("gathered_params", [])],
                          adapters=[AdapterFactors(graph.layers[a["node"]].name, [names[i] for i in a["split"]],
                                                   [names[i] for i in a["whole"]]) for a in data.get("adapters", [])],
                          summed_outputs=[SummedOutput(graph.layers[s["node"]].name, s["elements"])
                                          for s in data.get("summed_outputs", [])],
                          example={"description": graph.description, "inputs": graph.example_inputs,
                                   "output_shapes": [list(s) for s in graph.output_shapes]})
    result.prediction = Prediction(graph, data["tensors"], data["sequence_entries"], data["sequence_gathers"],
                                    data.get("head_entries", []),
                                    {w["node"] for w in data.get("attention_weights", []) if not w["used"]},
                                    data["sequence_exits"])
    result.prediction.plan = result
    return result


def _split_together(graph: CapturedGraph) -> List[List[int]]:
    """The planner's "together" pairs (csrc/plan/graph.h): the q/k/v projection and out_proj of
    each nn.MultiheadAttention, which ParallelMultiheadAttention splits only by heads together."""
    nodes = {info.name: node for node, info in graph.layers.items()}
    modules = dict(graph.shadow.named_modules())
    # By the module's class, not the layers' names: Mamba's mixer has an in_proj and an out_proj too.
    return [[node, nodes[owner + ".out_proj"]] for name, node in nodes.items()
            for owner, _, child in [name.rpartition(".")] if child == IN_PROJECTION and owner + ".out_proj" in nodes
            and isinstance(modules.get(owner), nn.MultiheadAttention)]


def _attention_copies(region_plans: Dict[int, RegionPlan], records, graph: CapturedGraph) -> None:
    """A region spanning several attentions (see part_modules in csrc/plan/region_modules.cpp)
    has no one module the model calls whose attributes it could make local: each attention the
    model calls gets a copy of the region under an id of its own (negative, named by no layer or
    tensor), whose module is that attention, for its attributes alone."""
    for record in records:
        region = region_plans[record["id"]]
        if region.module in graph.module_nodes:
            continue
        for module in record["part_modules"]:
            if module not in graph.module_nodes:
                continue
            copy = RegionPlan(units=region.units, module=module, repeat=region.repeat,
                              coarse_units=region.coarse_units, coarse_sizes=list(region.coarse_sizes),
                              localize=list(region.localize))
            region_plans[min(min(region_plans), 0) - 1] = copy


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
            result = _parse(document, graph, world_size, _element_size(model))
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

    # The fewest collectives first (Megatron's pairs, what cannot be paired held whole). Where
    # that leaves a rank more than its share plus 10% of the parameters, the large layers that
    # cannot be paired are split and their outputs gathered instead (reason gathered_unpaired).
    result = settled(gather_unpaired=0)
    if gather_unpaired and fullest_fraction(result) > 1 / world_size + IMBALANCE:
        gathered = settled(gather_unpaired=_gathered_layer_elements(model))
        if fullest_fraction(gathered) < fullest_fraction(result):
            result = gathered
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


def _gathered_layer_elements(model: nn.Module) -> int:
    """The weight elements from which a layer that cannot be paired is gathered rather than held
    whole: an eighth of the model's largest parameter outside its vocabulary (its token tables,
    and a head over them, which the plan splits anyway). A router or a small gate stays whole."""
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    largest = max((p.numel() for p in model.parameters() if p.dim() >= 2 and p.shape[0] != vocab), default=0)
    return max(1, largest // 8)


def within(name: str, pattern: str) -> bool:
    """Whether module `name` is a module matching `pattern` or inside one ("" is the model)."""
    return pattern == "" or fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def _warn_if_mostly_whole(result: ShardingPlan) -> None:
    """One warning per plan when a rank would hold more than 1/N + 10% of the parameters (on
    the first rank only, when the ranks plan together)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    message = imbalance_warning(result)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)
