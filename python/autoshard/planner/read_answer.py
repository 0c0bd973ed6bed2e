"""The planner's answer (csrc/plan/emit_json.cpp) read into a ShardingPlan: its layers, regions,
collectives and records, named by module and parameter, with the shape prediction beside them.
Nothing here decides: every style, reason and note is the planner's. The records beside the
layers are read by the constructs that hold them (each construct's `read`)."""

import json
import re
from typing import Dict

from torch import nn

from ..capture.capture import CapturedGraph
from ..constructs.record_io import Reading
from ..core.styles import Style
from .layer_plan import LayerPlan, RegionPlan
from .prediction import Prediction
from .records import Collective, PartialGradientBucket, record_holders
from .sharding_plan import ShardingPlan


def element_size(model: nn.Module) -> int:
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def read_answer(document: str, graph: CapturedGraph, world_size: int, element_size: int) -> ShardingPlan:
    """The planner's JSON document (csrc/plan/emit_json.cpp) as a ShardingPlan."""
    data = json.loads(document)
    if data.get("version") != 2:
        raise RuntimeError(f"plan: the planner answered with document version {data.get('version')!r}, "
                           f"this layer reads version {2}; rebuild the extension")
    names = graph.param_names
    # The planner names parameters by index in its notes (csrc/plan/constructs/head_params.cpp).
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
    region_plans = {record["id"]: RegionPlan(units=record["units"], module=record["module"], repeat=record["repeat"],
                                             coarse_units=record["coarse_units"], coarse_sizes=record["coarse_localize"],
                                             localize=record["localize"]) for record in data["regions"]}
    _attention_copies(region_plans, data["regions"], graph)
    # Every other record is its construct's to read (constructs/record_io.py).
    reading = Reading(graph=graph, names=names, element_size=element_size, regions=region_plans, named=named)
    records = {}
    for construct in record_holders():
        records.update(construct.read(data, reading))
    result = ShardingPlan(world_size=world_size, layers=layers, regions=region_plans, comm=comm,
                          partial_gradients=partial, **records,
                          example={"description": graph.description, "inputs": graph.example_inputs,
                                   "output_shapes": [list(s) for s in graph.output_shapes]})
    result.prediction = Prediction(graph, data["tensors"], data["sequence_entries"], data["sequence_gathers"],
                                    data.get("head_entries", []),
                                    {w["node"] for w in data.get("attention_weights", []) if not w["used"]},
                                    data["sequence_exits"])
    result.prediction.plan = result
    return result


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
