"""The local shape of every tensor of the traced forward, as the plan predicts it, and the
integer module attributes that must become local for the sharded model to produce them.

An attribute (a head count, a feature count) is made local only when that is needed to make
the traced shapes equal the prediction: the region's module is traced with its layers at
their local sizes, and a candidate attribute is kept only if changing it lets the trace
match further; one that only happens to equal a global size (a rotary-dimension count equal
to the KV heads) changes shapes the plan did not predict to change, and is left alone. Any
shape still different refuses the plan, naming the module, the op and both shapes.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..nn.spec import ShardSpec
from ..split import split_sizes
from .capture import CapturedGraph, trace_shapes
from .layers import describe_layer


class ShapeMismatch(ValueError):
    """A traced tensor's shape differs from the plan's prediction."""


class Prediction:
    """Local shapes per rank of the tensors of a captured graph, from the planner's layouts."""

    def __init__(self, graph: CapturedGraph, tensors: List[dict], entries: Optional[List[dict]] = None,
                 gathers: Optional[List[dict]] = None):
        self.graph = graph
        self.layouts = {t["tensor"]: t for t in tensors}
        self.plan = None  # set once the plan exists
        # Sequence parallelism's cut entries: a module's first node -> the tensors its pre-hook
        # cuts to this rank's tokens (one scatter op each, traced before the module's own ops).
        self.entries: Dict[int, List[dict]] = {}
        for entry in entries or ():
            first = graph.module_nodes[entry["module"]][0]
            self.entries.setdefault(first, []).append(dict(entry, gather=False))
        for entry in gathers or ():  # ... or gathers every rank's tokens of it
            first = graph.module_nodes[entry["module"]][0]
            self.entries.setdefault(first, []).append(dict(entry, gather=True))

    def local_size(self, layout: dict, rank: int) -> int:
        region = self.plan.regions[layout["region"]]
        world = self.plan.world_size
        size = layout["size"]
        if layout["coarse"]:
            spec = ShardSpec(0, region.coarse_units, rank, world, units=region.coarse_units, repeat=region.repeat)
            return size // region.coarse_units * spec.local_size()
        return size // region.units * split_sizes(region.units, world)[rank]

    def local_shape(self, tensor: int, rank: int, tokens: bool = True) -> Tuple[int, ...]:
        """The tensor's shape on `rank`; with `tokens` False, as if no token axis were split."""
        shape = list(self.graph.shapes[tensor])
        layout = self.layouts.get(tensor)
        if layout is not None and layout.get("sequence"):
            if tokens:
                shape[layout["axis"]] = split_sizes(layout["size"], self.plan.world_size)[rank]
        elif layout is not None and layout["region"] in self.plan.regions:
            shape[layout["axis"]] = layout["outer"] * self.local_size(layout, rank)
        return tuple(shape)

    def nodes(self, rank: int, first: int = 0, end: Optional[int] = None,
              tokens: bool = True) -> List[Tuple[str, List[tuple], bool]]:
        """(label, predicted local output shapes, whether it is a no-op on this rank) of the
        graph's nodes [first, end): a reshape or broadcast to its input's own local shape
        (repeat_kv with one query head per KV head) may be skipped by the model."""
        end = len(self.graph.nodes) if end is None else end
        nodes = []
        for index in range(first, end):
            for entry in self.entries.get(index, ()) if tokens else ():
                shape = list(self.graph.shapes[entry["tensor"]])
                if entry["gather"]:
                    nodes.append(("autoshard.all_gather_from_sequence.default", [tuple(shape)], False))
                    continue
                shape[entry["dim"]] = split_sizes(shape[entry["dim"]], self.plan.world_size)[rank]
                nodes.append(("autoshard.scatter_to_parallel.default", [tuple(shape)], False))
            label, inputs, outputs = self.graph.nodes[index]
            layer = index in self.graph.layers
            shapes = [self.local_shape(t, rank, tokens) for t in outputs]
            noop = (not layer and len(inputs) == 1 and len(outputs) == 1
                    and self.local_shape(inputs[0], rank, tokens) == shapes[0])
            nodes.append(("layer" if layer else label, shapes, noop))
        return nodes

    def module_nodes(self, module: str, rank: int, tokens: bool = True) -> List[Tuple[str, List[tuple], bool]]:
        first, end = self.graph.module_nodes.get(module, (0, -1))
        return self.nodes(rank, first, max(end, first), tokens)


_SAME_OP = {"_unsafe_view": "view", "_reshape_alias": "view", "reshape": "view"}


def _op(label: str) -> str:
    """An op label up to what the tensor's memory layout decides (reshape gives a view of a
    contiguous tensor and a copy of another): the sharded model may differ there."""
    parts = label.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else label
    return _SAME_OP.get(name, name)


def _first_difference(got, want, stop_at_other_ops: bool = False) -> Optional[Tuple[int, str]]:
    """Where a trace first differs from the prediction: (how many traced ops matched, why);
    None if it matches. Predicted no-ops the trace skipped are passed over."""
    i = j = 0
    while i < len(want) and j < len(got):
        label, shapes, noop = want[i]
        traced_label, traced = got[j]
        same_op = _op(label) == _op(traced_label)
        if same_op and [tuple(s) for s in shapes] == [tuple(s) for s in traced]:
            i, j = i + 1, j + 1
        elif noop:
            i += 1
        elif not same_op and _op(traced_label) in ("clone", "contiguous"):
            j += 1  # a copy the layout needs here (reshape of a non-contiguous local tensor)
        elif not same_op:
            return None if stop_at_other_ops else (j, f"op {traced_label} where the plan traced {label}", i)
        else:
            return j, (f"op {traced_label} gives shapes {[list(s) for s in traced]}, the plan predicts "
                       f"{[list(s) for s in shapes]}"), i
    while i < len(want) and want[i][2]:
        i += 1
    if i < len(want) or j < len(got):
        return None if stop_at_other_ops else (j, f"{len(got)} ops where the plan traced {len(want)}", i)
    return None


class _LocalModule:
    """A meta copy of a region's module with its planned layers at one rank's local sizes."""

    def __init__(self, plan, module_name: str, module: nn.Module, rank: int):
        self.module = copy.deepcopy(module)
        prefix = module_name + "." if module_name else ""
        world = plan.world_size
        # Regions nested inside this module (an attention inside a block) with their attributes
        # already made local, as the sharded model will have them.
        for region in plan.regions.values():
            if region.module.startswith(prefix) and region.module != module_name and region.attributes:
                owner = self.module.get_submodule(region.module[len(prefix):])
                for attr, value in region.attributes.items():
                    setattr(owner, attr, region.local_value(value, rank, world))
        self.supported = True
        for layer in plan.layers:
            if not layer.module.startswith(prefix) or layer.style == "replicate":
                continue
            if layer.kind != "linear":
                self.supported = False  # einsum layers: no local stand-in
                continue
            spec = layer.weight_spec(rank, world)
            out_features, in_features = (layer.weight_shape[::-1] if layer.transposed else layer.weight_shape)
            if layer.style == "column":
                out_features = spec.local_size()
            elif layer.style == "row":
                in_features = spec.local_size()
            relative = layer.module[len(prefix):]
            parent, _, child = relative.rpartition(".")
            # The original layer's dtype: a module that casts its input to its layer's dtype (T5's
            # feed-forward) must trace the same ops as it did in the capture.
            original = getattr(self.module.get_submodule(relative), "weight", None)
            dtype = original.dtype if isinstance(original, torch.Tensor) else None
            stand_in = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=dtype)
            setattr(self.module.get_submodule(parent) if parent else self.module, child, stand_in)

    def trace(self, args, kwargs, attributes: Dict[str, int]):
        for attr, value in attributes.items():
            setattr(self.module, attr, value)
        return trace_shapes(self.module, args, kwargs, lambda m: describe_layer("", m, {}) is not None)


def _representative_ranks(plan, region) -> List[int]:
    """One rank per distinct local configuration of the region (split sizes differ by one)."""
    seen, ranks = set(), []
    for rank in range(plan.world_size):
        key = (split_sizes(region.units, plan.world_size)[rank],
               ShardSpec(0, region.coarse_units, rank, plan.world_size, units=region.coarse_units,
                         repeat=region.repeat).local_size() if region.repeat else 0)
        if key not in seen:
            seen.add(key)
            ranks.append(rank)
    return ranks


def _candidates(module: nn.Module, region, values, world_size: int) -> Dict[str, Dict[int, int]]:
    """Integer attributes holding one of `values`, with their local value per rank."""
    found = {}
    for attr, value in vars(module).items():
        if type(value) is not int or value not in values or value <= 1:
            continue
        local = {r: region.local_value(value, r, world_size) for r in range(world_size)}
        if any(v != value for v in local.values()):
            found[attr] = local
    return found


def _cache_key(plan, prediction: Prediction, module_name: str, module: nn.Module, region, rank: int, values):
    """What the choice of attributes depends on: the module's class and candidate attributes,
    its parameters' and inputs' shapes, its planned layers, and the ops and shapes the plan
    predicts for its call. Identical blocks (every attention of a model) share one key; a
    wrong reuse would still be caught by parallelize's shape check."""
    args, kwargs = prediction.graph.module_inputs[module_name]
    shapes = lambda v: [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in torch.utils._pytree.tree_flatten(v)[0]]
    attrs = tuple(sorted((k, v) for k, v in vars(module).items() if type(v) is int and v in values))
    params = tuple((k, tuple(p.shape)) for k, p in module.named_parameters())
    prefix = module_name + "." if module_name else ""
    nested = tuple(sorted((r.module[len(prefix):], tuple(sorted(r.attributes.items()))) for r in plan.regions.values()
                          if r.module.startswith(prefix) and r.module != module_name and r.attributes))
    prefix = module_name + "." if module_name else ""
    layers = tuple((l.module[len(prefix):], l.style, l.units, tuple(l.parts), l.repeat) for l in plan.layers
                   if l.module.startswith(prefix))
    nodes = tuple((label, tuple(map(tuple, outs)), noop)
                  for label, outs, noop in prediction.module_nodes(module_name, rank, tokens=False))
    return (type(module), attrs, params, nested, tuple(shapes(args)), tuple(shapes(kwargs)), layers, nodes,
            region.units, region.repeat, region.coarse_units, tuple(region.coarse_sizes))


def localize_attributes(plan, prediction: Prediction, cache: Optional[dict] = None) -> None:
    """Sets each region's `attributes`: the integer attributes of its module that must hold
    local sizes for the traced shapes to equal the prediction on every rank."""
    graph = prediction.graph
    cache = {} if cache is None else cache
    for region in plan.regions.values():
        region.attributes = {}
    # Innermost modules first, so that a block sees its attention's attributes already local.
    for region in sorted(plan.regions.values(), key=lambda r: -len(r.module.split(".")) if r.module else 0):
        name = region.module
        if name not in graph.module_inputs or name not in graph.module_nodes:
            continue
        module = graph.shadow.get_submodule(name)
        values = set(getattr(region, "_localize", ())) | set(region.coarse_sizes) | ({region.repeat} if region.repeat else set())
        ranks = _representative_ranks(plan, region)
        key = _cache_key(plan, prediction, name, module, region, ranks[0], values)
        if key in cache:
            region.attributes = dict(cache[key])
            continue
        region.attributes = _choose(plan, prediction, name, module, region, values, ranks)
        cache[key] = dict(region.attributes)


def _choose(plan, prediction, name, module, region, values, ranks) -> Dict[str, int]:
    args, kwargs = prediction.graph.module_inputs[name]
    candidates = _candidates(module, region, values, plan.world_size)
    chosen: Dict[str, int] = {}

    def attempt(rank: int, attrs: Dict[str, int]):
        local = _LocalModule(plan, name, module, rank)
        # Head counts are chosen on the tensor-parallel shapes: a region's module is traced from
        # its recorded, whole inputs, so split tokens would only differ there.
        want = prediction.module_nodes(name, rank, tokens=False)
        got, error = local.trace(args, kwargs, {a: candidates[a][rank] for a in attrs})
        found = _first_difference(got, want)
        if error is not None:
            index = found[0] if found is not None and found[0] < len(got) else len(got)
            return index, f"{type(error).__name__}: {error}"
        return None if found is None else found[:2]

    # Einsum layers have no local stand-in, and with KV heads shared (repeat) the prediction
    # does not yet follow the repeat axis that repeat_kv localises: both keep the former rule.
    if region.repeat or not _LocalModule(plan, name, module, ranks[0]).supported:
        return _fallback(prediction.graph, name, module, candidates)
    progress = lambda result: float("inf") if result is None else result[0]
    # A candidate is kept when it lets the trace match further on some rank and no less far
    # on any: one that only happens to equal a global size changes shapes the plan keeps.
    current = [progress(attempt(r, chosen)) for r in ranks]
    improved = True
    while any(p != float("inf") for p in current) and improved:
        improved = False
        for attr in candidates:
            if attr in chosen:
                continue
            trial = [progress(attempt(r, {**chosen, attr: 0})) for r in ranks]
            if all(t >= c for t, c in zip(trial, current)) and any(t > c for t, c in zip(trial, current)):
                chosen[attr] = 0
                current, improved = trial, True
    for r in ranks:
        result = attempt(r, chosen)
        if result is not None:
            index, why = result
            where = f"op {index} of its call"
            raise ShapeMismatch(f"plan: on rank {r} of {plan.world_size}, module {name!r} does not compute the shapes "
                                f"the plan predicts ({where}: {why}); local attributes tried: {sorted(chosen)}")
    return {attr: getattr(module, attr) for attr in chosen}


def _fallback(graph, name, module, candidates) -> Dict[str, int]:
    """Regions with einsum layers: the attributes whose change changes the module's trace."""
    from .capture import trace_text

    args, kwargs = graph.module_inputs[name]
    baseline = trace_text(module, args, kwargs)
    found = {}
    for attr, local in candidates.items():
        value = getattr(module, attr)
        setattr(module, attr, next(v for v in local.values() if v != value))
        try:
            changed = trace_text(module, args, kwargs) != baseline
        except Exception:
            changed = True
        finally:
            setattr(module, attr, value)
        if changed:
            found[attr] = value
    return found


def check_model_trace(prediction: Prediction, got: List[Tuple[str, List[tuple]]], rank: int) -> None:
    """Compares the trace of a whole sharded model (on meta) with the prediction, op by op,
    as far as both run the same ops."""
    graph = prediction.graph
    if any(region.repeat for region in prediction.plan.regions.values()):
        return  # KV heads shared: the repeat axis is not predicted yet (see _choose)
    found = _first_difference(got, prediction.nodes(rank), stop_at_other_ops=True)
    if found is None:
        return
    _, why, index = found
    owner = _owners(graph).get(min(index, len(graph.nodes) - 1), "<model>")
    raise ShapeMismatch(f"in module {owner!r} on rank {rank}, {why}")


def _owners(graph: CapturedGraph) -> Dict[int, str]:
    """Node index -> the innermost module whose first call recorded it."""
    owner = {}
    for name, (first, end) in sorted(graph.module_nodes.items(), key=lambda kv: kv[1][1] - kv[1][0]):
        for index in range(first, max(end, first)):
            owner.setdefault(index, name)
    return owner
