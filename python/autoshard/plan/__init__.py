"""The automatic sharding plan: capture a model's dataflow on meta, plan it in C++."""

import fnmatch
from typing import Dict, Optional

import torch
from torch import nn

from .capture import CapturedGraph, capture, trace_text
from .sharding_plan import OVERRIDE_STYLES, LayerPlan, RegionPlan, ShardingPlan

__all__ = ["LayerPlan", "RegionPlan", "ShardingPlan", "plan"]


def _element_size(model: nn.Module) -> int:
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def _common_module(names) -> str:
    paths = [n.split(".") for n in names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    # The layers' own names are not their parent module.
    if len(paths) == 1 or any(len(common) == len(p) for p in paths):
        common = common[:-1]
    return ".".join(common)


def _localized_attributes(graph: CapturedGraph, module_name: str, region: RegionPlan, values,
                          world_size: int) -> Dict[str, int]:
    """The integer attributes of `module_name` that hold one of `values` and that shape its
    computation: changing one changes the module's traced graph (or breaks it)."""
    module = graph.shadow.get_submodule(module_name)
    if module_name not in graph.module_inputs:
        return {}
    args, kwargs = graph.module_inputs[module_name]
    baseline = None
    found = {}
    for attr, value in list(vars(module).items()):
        if type(value) is not int or value not in values or value <= 1:
            continue
        local = next((v for r in range(world_size) if (v := region.local_value(value, r, world_size)) != value), value)
        if local == value:
            continue
        if baseline is None:
            baseline = trace_text(module, args, kwargs)
        setattr(module, attr, local)
        try:
            changed = trace_text(module, args, kwargs) != baseline
        except Exception:
            changed = True
        finally:
            setattr(module, attr, value)
        if changed:
            found[attr] = value
    return found


def _parse(text: str, graph: CapturedGraph, world_size: int, element_size: int) -> ShardingPlan:
    layers, regions, comm = [], {}, []
    localize: Dict[int, list] = {}
    kv: Dict[int, tuple] = {}
    for line in text.splitlines():
        words = line.split()
        if words[0] == "layer":
            node, style, region, units, group = int(words[1]), words[2], int(words[3]), int(words[4]), int(words[5])
            count = int(words[7])
            parts = [int(w) for w in words[8:8 + count]]
            letter = int(words[9 + count])
            repeat = int(words[11 + count])
            note = line.split(" note ", 1)[1].strip() if " note " in line else ""
            info = graph.layers[node]
            if info.kind == "linear":
                shape = [info.in_features, info.out_features] if info.transposed else [info.out_features, info.in_features]
            elif info.kind == "einsum":
                shape = list(info.weight_shape)
            else:
                shape = [info.num_embeddings, info.embedding_dim]
            names = graph.param_names
            layers.append(LayerPlan(
                module=info.name, kind=info.kind, style=style, weight=names[info.weight_param],
                bias=names[info.bias_param] if info.bias_param >= 0 else None, weight_shape=shape,
                transposed=info.transposed, units=units if style != "replicate" else 0, parts=parts,
                region=region, copy_group=group, note=note,
                equation=info.equation, letter=chr(letter) if letter else "", repeat=repeat,
            ))
        elif words[0] == "region":
            count = int(words[4])
            localize[int(words[1])] = [int(w) for w in words[5:5 + count]]
            rest = words[6 + count:]
            kv[int(words[1])] = (int(rest[0]), int(rest[1]), [int(w) for w in rest[3:3 + int(rest[2])]])
            regions[int(words[1])] = int(words[2])
        elif words[0] == "comm":
            comm.append({"phase": words[1], "kind": words[2], "count": int(words[3]),
                         "bytes": int(words[4]) * element_size})
    region_plans = {}
    for region, units in regions.items():
        members = [layer.module for layer in layers if layer.region == region]
        module = _common_module(members)
        repeat, coarse_units, coarse_sizes = kv[region]
        region_plan = RegionPlan(units=units, module=module, repeat=repeat, coarse_units=coarse_units,
                                 coarse_sizes=coarse_sizes)
        values = set(localize[region]) | set(coarse_sizes) | ({repeat} if repeat else set())
        if world_size > 1:
            region_plan.attributes = _localized_attributes(graph, module, region_plan, values, world_size)
        region_plans[region] = region_plan
    return ShardingPlan(world_size=world_size, layers=layers, regions=region_plans, comm=comm,
                        example={"description": graph.description, "inputs": graph.example_inputs,
                                 "output_shapes": [list(s) for s in graph.output_shapes]})


def plan(model: nn.Module, world_size: Optional[int] = None, example_inputs=None,
         overrides: Optional[Dict[str, str]] = None) -> ShardingPlan:
    """The sharding plan for `model` on `world_size` ranks, derived from its dataflow.

    With world_size given no process group is needed, so plans can be inspected offline.
    `overrides` maps name patterns (fnmatch, on module or parameter names) to "replicate" or
    "column_gather", and the plan is made again around them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if world_size is None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise ValueError("plan: world_size is required when torch.distributed is not initialised")
        from ..comm import world_size as group_world_size

        world_size = group_world_size()
    if type(world_size) is not int or world_size <= 0:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    graph = capture(model, example_inputs)
    forced = []
    for pattern, style in (overrides or {}).items():
        if style not in OVERRIDE_STYLES:
            raise ValueError(f"plan: override for {pattern!r} must be one of {OVERRIDE_STYLES}, got {style!r}")
        hits = [node for node, info in graph.layers.items()
                if fnmatch.fnmatchcase(info.name, pattern) or fnmatch.fnmatchcase(graph.param_names[info.weight_param], pattern)]
        if not hits:
            raise ValueError(f"plan: override pattern {pattern!r} names no layer or parameter of the model")
        for node in hits:
            if style == "column_gather" and graph.layers[node].kind != "linear":
                raise ValueError(f"plan: override {pattern!r}: only Linear layers can be column_gather")
            forced.append(f"force {node} {style}")
    text = torch.ops.autoshard.plan_graph(graph.text + "\n".join(forced) + "\n", world_size)
    result = _parse(text, graph, world_size, _element_size(model))
    too_small = [layer for layer in result.layers if "whole unit(s)" in layer.note]
    if too_small and all(layer.style == "replicate" for layer in result.layers):
        raise ValueError(f"plan: world_size={world_size} is larger than every dimension autoshard could split "
                         f"(e.g. {too_small[0].module}: {too_small[0].note.split(': ', 1)[1]})")
    result.overrides = dict(overrides or {})
    return result
