"""Module attributes made local: for each region, the integer attributes of its module (head
counts, split sizes, config fields) whose local values make the sharded module compute the
shapes the plan predicts on every rank, chosen by tracing the module on meta with candidates."""

import copy
from itertools import combinations
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..constructs import record_constructs
from ..nn.head_cuts import cut_leaf
from ..core.spec import ShardSpec
from ..nn.view_sizes import ViewSize, ViewSizeHooks, local_sizes, region_view_sizes
from ..core.split import split_sizes
from ..capture.layers import is_layer_module
from .prediction import Prediction, ShapeMismatch, first_difference, op_kind
from ..capture.shape_trace import trace_shapes, trace_text
from ..core.module_attributes import CONFIG, set_attribute


class _LocalModule:
    """A meta copy of a region's module with its planned layers at one rank's local sizes."""

    def __init__(self, plan, module_name: str, module: nn.Module, rank: int, values=None):
        self.module = copy.deepcopy(module)
        self.values = values
        prefix = module_name + "." if module_name else ""
        world = plan.world_size
        # Regions nested inside this module (an attention inside a block) with their attributes
        # and view sizes already made local, as the sharded model will have them.
        for region in plan.regions.values():
            if region.module.startswith(prefix) and region.module != module_name:
                owner = self.module.get_submodule(region.module[len(prefix):])
                for attr in region.attributes:
                    set_attribute(owner, attr, region.local_attribute(attr, rank, world))
                if region.view_sizes:
                    ViewSizeHooks(owner, region_view_sizes(region, rank, world))
        # Split norms, parameters split with their heads, embeddings whose output is cut to the
        # heads: as this rank holds them.
        for construct in record_constructs():
            construct.stand_in(self.module, prefix, plan, rank)
        self.supported = True
        # The stand-ins that change the module in place (a split nn.MultiheadAttention becomes the
        # ParallelMultiheadAttention of `rank`) first, with the names of the layers they stand for.
        done = set()
        for layer in plan.layers:
            if layer.style.is_split and layer.module.startswith(prefix):
                done |= layer.construct.stand_in_within(self.module, prefix, plan, layer, rank)
        for layer in plan.layers:
            if not layer.module.startswith(prefix) or not layer.style.is_split or layer.module in done:
                continue
            relative = layer.module[len(prefix):]
            parent, _, child = relative.rpartition(".")
            stand_in = layer.construct.stand_in(layer, self.module.get_submodule(relative), rank, world)
            if stand_in is None:
                self.supported = False  # a construct with no local stand-in (einsum layers)
                continue
            setattr(self.module.get_submodule(parent) if parent else self.module, child, stand_in)

    def trace(self, args, kwargs, attributes: Dict[str, int], layer_inputs: Sequence[int] = (),
              view_sizes: Optional[dict] = None, seen: Optional[list] = None):
        """The module's trace (trace_shapes) with `attributes` set and its calls' `view_sizes`
        (as LocalViewSizes takes them) made local; `seen` gets its view calls."""
        for attr, value in attributes.items():
            set_attribute(self.module, attr, value)
        hooks = ViewSizeHooks(self.module, view_sizes or {}, seen)
        try:
            return trace_shapes(self.module, args, kwargs, is_layer_module, self.values, layer_inputs)
        finally:
            hooks.remove()


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


# A module's configuration object (Hugging Face's `self.config`, shared by every module of the
# model), whose sizes a module may read in forward (Phi-3 slices q, k and v at
# `config.num_attention_heads * head_dim`).
def _integer_attributes(module: nn.Module, module_name: str, plan, values):
    """(dotted name, value) of the integer attributes holding one of `values`: the module's own,
    then those of its submodules that no nested region or planned layer owns (RemBERT keeps
    `all_head_size` on the attention's `self` while the region is the attention)."""
    prefix = module_name + "." if module_name else ""
    owned = [r.module[len(prefix):] for r in plan.regions.values()
             if r.module.startswith(prefix) and r.module != module_name]
    owned += [l.module[len(prefix):] for l in plan.layers if l.module.startswith(prefix)]
    found = []
    for sub_name, sub in module.named_modules():
        if sub_name and any(sub_name == o or sub_name.startswith(o + ".") for o in owned):
            continue
        here = f"{sub_name}." if sub_name else ""
        for attr, value in vars(sub).items():
            if type(value) is int and value in values:
                found.append((here + attr, value))
        config = vars(sub).get(CONFIG)
        if config is not None and not isinstance(config, nn.Module) and hasattr(config, "__dict__"):
            for attr, value in vars(config).items():
                if type(value) is int and value in values:
                    found.append((f"{here}{CONFIG}.{attr}", value))
    return found


def _candidates(module: nn.Module, module_name: str, plan, region, values) -> Dict[Tuple[str, str], Dict[int, int]]:
    """Integer attributes holding one of `values`, with their local value per rank, keyed by
    (attribute, role): "repeat" for a count of query heads per KV head, "size" for any other
    size. A value that is both (4 query heads over 2 KV heads: 2) gives both candidates."""
    found = {}
    for attr, value in _integer_attributes(module, module_name, plan, values):
        if value <= 1:
            continue
        roles = {}
        if region.repeat and value == region.repeat:
            roles["repeat"] = {r: region.local_repeat(r, plan.world_size) for r in range(plan.world_size)}
        if "repeat" not in roles or value in region.coarse_sizes:
            roles["size"] = {r: region.local_value(value, r, plan.world_size) for r in range(plan.world_size)}
        for role, local in roles.items():
            if any(v != value for v in local.values()):
                found[(attr, role)] = local
    return found


def _cache_key(plan, prediction: Prediction, module_name: str, module: nn.Module, region, rank: int, values):
    """What the choice of attributes depends on: the module's class and candidate attributes,
    its parameters' and inputs' shapes, its planned layers, and the ops and shapes the plan
    predicts for its call. Identical blocks (every attention of a model) share one key; a
    wrong reuse would still be caught by parallelize's shape check."""
    args, kwargs = prediction.graph.module_inputs[module_name]
    shapes = lambda v: [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in torch.utils._pytree.tree_flatten(v)[0]]
    attrs = tuple(sorted(_integer_attributes(module, module_name, plan, values)))
    params = tuple((k, tuple(p.shape)) for k, p in module.named_parameters())
    prefix = module_name + "." if module_name else ""
    nested = tuple(sorted((r.module[len(prefix):], tuple(sorted(r.attributes.items()))) for r in plan.regions.values()
                          if r.module.startswith(prefix) and r.module != module_name and r.attributes))
    layers = tuple((l.module[len(prefix):], l.style, l.units, tuple(l.parts), l.repeat) for l in plan.layers
                   if l.module.startswith(prefix))
    nodes = tuple((label, tuple(map(tuple, outs)), noop)
                  for label, outs, noop in prediction.module_nodes(module_name, rank, tokens=False))
    return (type(module), attrs, params, nested, tuple(shapes(args)), tuple(shapes(kwargs)), layers, nodes,
            region.units, region.repeat, region.coarse_units, tuple(region.coarse_sizes))


def localize_attributes(plan, prediction: Prediction, cache: Optional[dict] = None,
                        failures: Optional[Dict[int, ShapeMismatch]] = None) -> None:
    """Sets each region's `attributes`: the integer attributes of its module that must hold
    local sizes for the traced shapes to equal the prediction on every rank. A region whose
    module computes other shapes whatever its attributes raises ShapeMismatch, or, with
    `failures` given, is entered there (region id -> the error) and the others go on."""
    graph = prediction.graph
    cache = {} if cache is None else cache
    region_ids = {id(region): index for index, region in plan.regions.items()}
    failed: Dict[int, ShapeMismatch] = {}

    def fail(region, error):
        if failures is None:
            raise error
        failed[id(region)] = failures[region_ids[id(region)]] = error
    for region in plan.regions.values():
        region.attributes, region.repeat_attributes, region.view_sizes = {}, [], []
    by_module = {region.module: region for region in plan.regions.values()}
    members: Dict[str, list] = {}  # a region's module -> the planned layers inside it
    for layer in plan.layers:
        parts = layer.module.split(".")
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix in by_module:
                members.setdefault(prefix, []).append(layer)
    done = set()
    # Innermost modules first, so that a block sees its attention's attributes already local.
    for region in sorted(plan.regions.values(), key=lambda r: -len(r.module.split(".")) if r.module else 0):
        name = region.module
        first = by_module.get(_in_first_block(graph.folded, name))
        if first is not None and id(first) in done and _same_region(members, first, region):
            # A folded block's region: its first block's choice.
            region.attributes, region.repeat_attributes = dict(first.attributes), list(first.repeat_attributes)
            region.view_sizes = [list(v) for v in first.view_sizes]
            done.add(id(region))
            if id(first) in failed:
                fail(region, failed[id(first)])
            continue
        done.add(id(region))
        if name not in graph.module_inputs or name not in graph.module_nodes:
            continue
        module = graph.shadow.get_submodule(name)
        values = set(region.localize) | set(region.coarse_sizes) | ({region.repeat} if region.repeat else set())
        ranks = _representative_ranks(plan, region)
        key = _cache_key(plan, prediction, name, module, region, ranks[0], values)
        if key in cache:
            if isinstance(cache[key], ShapeMismatch):
                fail(region, cache[key])
            else:
                region.attributes, region.repeat_attributes = dict(cache[key][0]), list(cache[key][1])
                region.view_sizes = [list(v) for v in cache[key][2]]
            continue
        try:
            region.attributes, region.repeat_attributes, region.view_sizes = _choose(plan, prediction, name, module,
                                                                                    region, values, ranks)
        except ShapeMismatch as error:
            cache[key] = error
            fail(region, error)
            continue
        cache[key] = (dict(region.attributes), list(region.repeat_attributes), [list(v) for v in region.view_sizes])


def _in_first_block(folded: Dict[str, str], name: str) -> Optional[str]:
    """The name `name` has in the block that a folded block was recorded from, or None."""
    for block, first in folded.items():
        if name == block or name.startswith(block + "."):
            return first + name[len(block):]
    return None


def _same_region(members: Dict[str, list], a, b) -> bool:
    """Whether two regions were planned alike: units, shared KV heads and layers, by relative name."""
    def layers(region):
        prefix = region.module + "." if region.module else ""
        return sorted((l.module[len(prefix):], l.style, l.units, tuple(l.parts), l.repeat)
                      for l in members.get(region.module, ()))

    return ((a.units, a.repeat, a.coarse_units, tuple(a.coarse_sizes), tuple(a.localize))
            == (b.units, b.repeat, b.coarse_units, tuple(b.coarse_sizes), tuple(b.localize))
            and layers(a) == layers(b))


def _choose(plan, prediction, name, module, region, values,
            ranks) -> Tuple[Dict[str, int], List[str], List[ViewSize]]:
    """The attributes to make local (name -> global value), those of them that count query
    heads per KV head, and the sizes of view calls to make local (nn/view_sizes.py)."""
    args, kwargs = prediction.graph.module_inputs[name]
    candidates = _candidates(module, name, plan, region, values)
    chosen: Dict[Tuple[str, str], int] = {}
    views: List[ViewSize] = []

    def attempt(rank: int, attrs: Dict[str, int], seen: Optional[list] = None):
        """None where the trace matches the prediction, else (ops matched, why, the predicted
        op there)."""
        local = _LocalModule(plan, name, module, rank, prediction.graph.values)
        # Head counts are chosen on the tensor-parallel shapes: a region's module is traced from
        # its recorded, whole inputs, so split tokens would only differ there; the inputs it
        # cuts to its heads are given to it cut.
        want = prediction.module_nodes(name, rank, tokens=False)
        call_args, call_kwargs = _cut_heads(plan, prediction, name, args, kwargs, rank)
        sizes = local_sizes(views, lambda size: region.local_value(size, rank, plan.world_size))
        got, error = local.trace(call_args, call_kwargs, {a[0]: candidates[a][rank] for a in attrs},
                                 prediction.graph.module_layer_inputs.get(name, ()), sizes, seen)
        found = first_difference(got, want)
        if error is not None:
            index = found[0] if found is not None and found[0] < len(got) else len(got)
            return index, f"{type(error).__name__}: {error}", found[2] if found is not None else len(want)
        return found

    # Einsum layers have no local stand-in: they keep the former rule.
    if not _LocalModule(plan, name, module, ranks[0]).supported:
        return (*_fallback(prediction.graph, name, module, candidates), [])
    # How many ops each rank's trace matches with `attrs` made local.
    progress = lambda attrs: [float("inf") if (found := attempt(r, attrs)) is None else found[0] for r in ranks]
    further = lambda trial: all(t >= c for t, c in zip(trial, current)) and any(t > c for t, c in zip(trial, current))
    for _ in range(_MAX_VIEW_SIZES + 1):
        # A candidate is kept when it lets the trace match further on some rank and no less far
        # on any: one that only happens to equal a global size changes shapes the plan keeps.
        current = progress(chosen)
        improved = True
        while any(p != float("inf") for p in current) and improved:
            improved = False
            for attr in candidates:
                if any(attr[0] == taken[0] for taken in chosen):
                    continue
                trial = progress({**chosen, attr: 0})
                if further(trial):
                    chosen[attr] = 0
                    current, improved = trial, True
        # A module may spell a size from two attributes at once (the query heads as
        # `num_kv_heads * (num_heads // num_kv_heads)`): made local one at a time, neither changes
        # it (3 * (4 // 3) is still 3), so where the search above leaves the trace short of the
        # prediction, pairs of the remaining candidates (the first _MAX_PAIRED) are tried together.
        improved = True
        while improved and any(p != float("inf") for p in current):
            improved = False
            left = [attr for attr in candidates if attr not in chosen][:_MAX_PAIRED]
            for a, b in combinations(left, 2):
                trial = progress({**chosen, a: 0, b: 0})
                if further(trial):
                    chosen[a] = chosen[b] = 0
                    current, improved = trial, True
                    break
        # What attributes cannot reach: a view call given a size read from a whole tensor.
        found = _view_size(plan, prediction, name, region, ranks, chosen, attempt) if any(
            p != float("inf") for p in current) else None
        if found is None:
            break
        views.extend(found)
    for r in ranks:
        result = attempt(r, chosen)
        if result is not None:
            index, why = result[:2]
            where = f"op {index} of its call"
            raise ShapeMismatch(f"plan: on rank {r} of {plan.world_size}, module {name!r} does not compute the shapes "
                                f"the plan predicts ({where}: {why}); local attributes tried: "
                                f"{sorted(a for a, _ in chosen)}")
    globals_ = dict(_integer_attributes(module, name, plan, values))
    return ({a: globals_[a] for a, _ in chosen}, sorted(a for a, role in chosen if role == "repeat"),
            [list(v) for v in views])


# The most view calls one module call may have made local: each is found by one more search.
_MAX_VIEW_SIZES = 16
# Pairs are tried among at most this many candidates (a module's integer attributes equal to
# one of the region's sizes: a handful).
_MAX_PAIRED = 12


def _view_size(plan, prediction, name, region, ranks, chosen, attempt) -> Optional[List[ViewSize]]:
    """The sizes to make local in the view call where the module's trace fails on the first of
    `ranks`: where that call asks for a global shape that does not fit its local input, and the
    plan's predicted output of the call differs from it only in sizes that are global sizes of
    the region (their local value, on every rank, is the predicted one). None where the trace
    fails otherwise."""
    seen: list = []
    result = attempt(ranks[0], chosen, seen)
    failed = next((call for call in seen if not call[3]), None)
    if result is None or failed is None:
        return None
    ordinal, _, sizes, _ = failed
    want = prediction.module_nodes(name, ranks[0], tokens=False)
    predicted = next((outs[0] for label, outs, _ in want[result[2]:result[2] + 3]
                      if op_kind(label) == "view" and outs and len(outs[0]) == len(sizes)), None)
    if predicted is None:
        return None
    positions = [p for p, size in enumerate(sizes) if size != -1 and size != predicted[p]]
    if not positions or any(region.local_value(sizes[p], ranks[0], plan.world_size) != predicted[p]
                            for p in positions):
        return None
    return [(ordinal, p, sizes[p]) for p in positions]


def _cut_heads(plan, prediction: Prediction, name: str, args, kwargs, rank: int):
    """A module's recorded inputs with those that are sharded on heads where the module receives
    them at their local shapes: tensors sharded where they are made (a position bias passed on
    from another attention), and those the plan cuts as the module receives them (nn/head_cuts.py)."""
    for entry in prediction.graph.document.get("entries", ()):
        layout = prediction.layouts.get(entry["tensor"])
        if entry["module"] != name or layout is None or layout.get("sequence"):
            continue
        local = lambda x, t=entry["tensor"]: torch.empty(prediction.local_shape(t, rank, tokens=False),
                                                         dtype=x.dtype, device="meta")
        args, kwargs = cut_leaf(args, kwargs, entry["leaf"], local, name)
    for construct in record_constructs():
        args, kwargs = construct.cut_inputs(plan, name, args, kwargs, rank)
    return args, kwargs


def _fallback(graph, name, module, candidates) -> Tuple[Dict[str, int], List[str]]:
    """Regions with einsum layers: the attributes whose change changes the module's trace."""
    args, kwargs = graph.module_inputs[name]
    baseline = trace_text(module, args, kwargs, graph.values)
    found = {}
    for (attr, role), local in candidates.items():
        if "." in attr or role != "size":
            continue  # the module's own attributes only, as this rule always took
        value = getattr(module, attr)
        setattr(module, attr, next(v for v in local.values() if v != value))
        try:
            changed = trace_text(module, args, kwargs, graph.values) != baseline
        except Exception:
            changed = True
        finally:
            setattr(module, attr, value)
        if changed:
            found[attr] = value
    return found, []
