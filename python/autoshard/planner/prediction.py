"""The local shape of every tensor of the traced forward, as the plan predicts it, and the
integer module attributes that must become local for the sharded model to produce them.

An attribute (a head count, a feature count) is made local only when that is needed to make
the traced shapes equal the prediction: the region's module is traced with its layers at
their local sizes, and a candidate attribute is kept only if changing it lets the trace
match further; one that only happens to equal a global size (a rotary-dimension count equal
to the KV heads) changes shapes the plan did not predict to change, and is left alone. Any
shape still different refuses the plan, naming the module, the op and both shapes.
"""

from typing import Dict, List, Optional, Set, Tuple


from ..nn.head_cuts import cut_steps
from .records import HeadCut
from ..core.spec import ShardSpec
from ..core.split import split_sizes
from ..capture.capture import CapturedGraph


class ShapeMismatch(ValueError):
    """A traced tensor's shape differs from the plan's prediction."""


class FoldedBlockMismatch(ShapeMismatch):
    """A block the capture recorded as identical to another does not compute what it does."""


class Prediction:
    """Local shapes per rank of the tensors of a captured graph, from the planner's layouts."""

    def __init__(self, graph: CapturedGraph, tensors: List[dict], entries: Optional[List[dict]] = None,
                 gathers: Optional[List[dict]] = None, head_entries: Optional[List[dict]] = None,
                 unreturned_weights: Set[int] = frozenset(), exits: Optional[List[dict]] = None):
        self.graph = graph
        # The planner's records as given, which the plan's JSON document carries (to_dict).
        self._records = {"tensors": tensors, "sequence_entries": entries or [], "sequence_gathers": gathers or [],
                         "sequence_exits": exits or [], "head_entries": head_entries or []}
        # Attention weights nothing reads, which the sharded attention does not return: no call.
        self.unreturned_weights = set(unreturned_weights)
        self.layouts = {t["tensor"]: t for t in tensors}
        self.plan = None  # set once the plan exists
        self._repeat_axes: Optional[Dict[int, Tuple[int, int]]] = None
        # Sequence parallelism's cut entries: a module's first node -> the tensors its pre-hook
        # cuts to this rank's tokens (one scatter op each, traced before the module's own ops).
        self.entries: Dict[int, List[dict]] = {}
        for gather, records in ((False, entries), (True, gathers)):  # ... or gathers every rank's tokens of it
            for entry in records or ():
                self.entries.setdefault(graph.module_nodes[entry["module"]][0], []).append(dict(entry, gather=gather))
        # Gathers where a module returns its tokens: the node after the module's first call
        # -> the gathers its forward hook makes (traced before the next module's entries).
        self.exits: Dict[int, List[dict]] = {}
        for entry in exits or ():
            self.exits.setdefault(graph.module_nodes[entry["module"]][1], []).append(entry)
        # Head cuts (nn/head_cuts.py): a module's first node -> the tensors its pre-hook cuts
        # to this rank's heads.
        self.head_entries: Dict[int, List[dict]] = {}
        for entry in head_entries or ():
            self.head_entries.setdefault(graph.module_nodes[entry["module"]][0], []).append(entry)

    def to_dict(self) -> dict:
        """What the dry run's per-op check reads, as plain JSON values: the graph's nodes (op
        label, input and output tensor ids), every tensor's global shape, each module's first
        call [first, end), the layers' nodes and calls, the nodes inside layers, the folded
        blocks, and the planner's layouts and cut/gather records (see ShardingPlan.to_json)."""
        graph = self.graph
        return {"nodes": [[label, list(inputs), list(outputs)] for label, inputs, outputs in graph.nodes],
                "shapes": [list(shape) for shape in graph.shapes],
                "module_nodes": {name: list(span) for name, span in graph.module_nodes.items()},
                "layer_nodes": sorted(graph.layers), "layer_calls": sorted(graph.layer_calls),
                "inner_nodes": sorted(graph.inner_nodes), "folded": dict(graph.folded),
                **{key: list(records) for key, records in self._records.items()},
                "tensors": _table(self._records["tensors"]),
                "unreturned_weights": sorted(self.unreturned_weights)}

    @classmethod
    def from_dict(cls, data: dict, plan) -> "Prediction":
        """The prediction to_dict wrote, for `plan`. Its graph holds what the prediction reads,
        and nothing of the model (no parameters, no module inputs, no values)."""
        graph = CapturedGraph(document={}, layers=dict.fromkeys(data["layer_nodes"]), param_names=[], output_shapes=[],
                              shapes=[tuple(shape) for shape in data["shapes"]],
                              nodes=[(label, tuple(inputs), tuple(outputs)) for label, inputs, outputs in data["nodes"]],
                              module_nodes={name: tuple(span) for name, span in data["module_nodes"].items()},
                              folded=dict(data["folded"]), inner_nodes=set(data["inner_nodes"]),
                              layer_calls=set(data["layer_calls"]))
        prediction = cls(graph, _records(data["tensors"]), data["sequence_entries"], data["sequence_gathers"],
                         data["head_entries"], set(data["unreturned_weights"]), data["sequence_exits"])
        prediction.plan = plan
        return prediction

    def local_size(self, layout: dict, rank: int) -> int:
        region = self.plan.regions[layout["region"]]
        world = self.plan.world_size
        size = layout["size"]
        if layout["coarse"]:
            spec = ShardSpec(0, region.coarse_units, rank, world, units=region.coarse_units, repeat=region.repeat)
            return size // region.coarse_units * spec.local_size()
        whole = layout.get("whole", 0)  # a fused output's parts held whole on every rank
        return (size - whole) // region.units * split_sizes(region.units, world)[rank] + whole

    def repeat_axes(self) -> Dict[int, Tuple[int, int]]:
        """tensor -> (axis, region) for the axis that repeats each shared KV head for its query
        heads (repeat_kv's expand, or repeat, of a (.., kv, 1, ..) view to (.., kv, n_rep, ..)), as
        the planner found it (a layout's "repeat_axis"): its local size is the query heads per KV
        head on the rank, not the global n_rep."""
        if self._repeat_axes is None:
            self._repeat_axes = {tensor: (layout["repeat_axis"], layout["region"])
                                 for tensor, layout in self.layouts.items()
                                 if layout.get("repeat_axis", -1) >= 0 and layout["region"] in self.plan.regions}
        return self._repeat_axes

    def local_shape(self, tensor: int, rank: int, tokens: bool = True) -> Tuple[int, ...]:
        """The tensor's shape on `rank`; with `tokens` False, as if no token axis were split."""
        shape = list(self.graph.shapes[tensor])
        layout = self.layouts.get(tensor)
        if layout is not None and layout.get("sequence"):
            if tokens:
                shape[layout["axis"]] = split_sizes(layout["size"], self.plan.world_size)[rank]
        elif layout is not None and layout["region"] in self.plan.regions:
            shape[layout["axis"]] = layout["outer"] * self.local_size(layout, rank)
        repeat = self.repeat_axes().get(tensor)
        if repeat is not None:
            axis, region = repeat
            shape[axis] = self.plan.regions[region].local_repeat(rank, self.plan.world_size)
        return tuple(shape)

    def nodes(self, rank: int, first: int = 0, end: Optional[int] = None,
              tokens: bool = True) -> List[Tuple[str, List[tuple], Optional[int]]]:
        """(label, predicted local output shapes, where the model may go on instead) of the
        graph's nodes [first, end), with sequence parallelism's cut and gather ops where a module
        receives its tokens (unless `tokens` is False). The third field is None, or the index in
        the returned list past an op, or a run of reshapes, broadcasts and copies, that starts
        here and ends at its first input's own local shape: the model may skip it on this rank
        (repeat_kv with one query head per KV head returns its input)."""
        end = len(self.graph.nodes) if end is None else end
        local = {}
        shape_of = lambda t: local.setdefault(t, self.local_shape(t, rank, tokens))
        rows, start_of = [], {}  # start_of: graph index -> its first row (its cut/gather ops first)
        exit_rows = lambda index: [("autoshard.all_gather_from_sequence.default", [self.graph.shapes[e["tensor"]]], None)
                                   for e in (self.exits.get(index, ()) if tokens else ())]
        for index in range(first, end):
            start_of[index] = len(rows)
            if index > first:
                rows += exit_rows(index)
            for entry in self.entries.get(index, ()) if tokens else ():
                shape = list(self.graph.shapes[entry["tensor"]])
                if entry["gather"]:
                    rows.append(("autoshard.all_gather_from_sequence.default", [tuple(shape)], None))
                    continue
                shape[entry["dim"]] = split_sizes(shape[entry["dim"]], self.plan.world_size)[rank]
                rows.append(("autoshard.scatter_to_parallel.default", [tuple(shape)], None))
            # After the token hooks (registered first); a module traced alone from its recorded
            # inputs gets them already cut (tokens False).
            for entry in self.head_entries.get(index, ()) if tokens or index != first else ():
                units = self.plan.regions[entry["region"]].units
                for op, shape in cut_steps(self.graph.shapes[entry["tensor"]], _head_cut(entry), units, rank,
                                           self.plan.world_size):
                    rows.append((op, [shape], None))
            if index in self.graph.inner_nodes or index in self.unreturned_weights:
                continue  # inside a layer whose call the trace sees as one node, or no call
            label, inputs, outputs = self.graph.nodes[index]
            layer = index in self.graph.layers or index in self.graph.layer_calls
            shapes = [shape_of(t) for t in outputs]
            rows.append(("layer" if layer else label, shapes, None if layer else self._skippable(index, end, shape_of)))
        rows += exit_rows(end) if end > first else []
        start_of[end] = len(rows)
        return [(label, shapes, None if skip is None else start_of[skip]) for label, shapes, skip in rows]

    def _skippable(self, index: int, end: int, shape_of) -> Optional[int]:
        """The graph index past a run the model may skip that starts at `index`, or None."""
        label, inputs, outputs = self.graph.nodes[index]
        if len(inputs) != 1 or len(outputs) != 1:
            return None
        start = shape_of(inputs[0])
        if shape_of(outputs[0]) == start:
            return index + 1  # any op giving its input's own local shape (a no-op reshape)
        if op_kind(label) not in _SHAPE_ONLY:
            return None
        for j in range(index, end):
            label, inputs, outputs = self.graph.nodes[j]
            if j > index and (len(inputs) != 1 or len(outputs) != 1 or op_kind(label) not in _SHAPE_ONLY
                              or inputs[0] != self.graph.nodes[j - 1][2][0]):
                return None
            if shape_of(outputs[0]) == start:
                return j + 1
        return None

    def module_nodes(self, module: str, rank: int, tokens: bool = True) -> List[Tuple[str, List[tuple], Optional[int]]]:
        first, end = self.graph.module_nodes.get(module, (0, -1))
        return self.nodes(rank, first, max(end, first), tokens)


def _head_cut(entry: dict) -> HeadCut:
    """The planner's head entry record (with its tensor) as the plan's typed record."""
    return HeadCut(entry["module"], entry["axis"], entry["outer"], entry["size"], entry["region"], entry["leaf"])


def _table(records: List[dict]) -> dict:
    """The layouts as {"fields", "rows"}, one short row each; a field a record lacks (a layout's
    "repeat_axis", given only where there is one) is null in its row."""
    fields: List[str] = []
    for record in records:
        fields += [f for f in record if f not in fields]
    return {"fields": fields, "rows": [[record.get(f) for f in fields] for record in records]}


def _records(table: dict) -> List[dict]:
    return [{f: value for f, value in zip(table["fields"], row) if value is not None} for row in table["rows"]]


_SAME_OP = {"_unsafe_view": "view", "_reshape_alias": "view", "reshape": "view"}
# Ops that keep their input's values and layout (a repeat axis passes through them).
_LAYOUT_COPIES = {"clone", "contiguous", "_to_copy", "alias", "detach"}
# Ops a model may leave out where they would return their input's shape on a rank.
_SHAPE_ONLY = {"view", "unsqueeze", "squeeze", "expand", "flatten", "unflatten", "slice"} | _LAYOUT_COPIES


def op_kind(label: str) -> str:
    """An op label up to what the tensor's memory layout decides (reshape gives a view of a
    contiguous tensor and a copy of another): the sharded model may differ there."""
    parts = label.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else label
    return _SAME_OP.get(name, name)


def first_difference(got, want) -> Optional[Tuple[int, str]]:
    """Where a trace first differs from the prediction: (how many traced ops matched, why);
    None if it matches. Runs of predicted ops the model may skip on this rank, and that the
    trace skipped, are passed over."""
    i = j = 0
    while i < len(want) and j < len(got):
        label, shapes, skip = want[i]
        traced_label, traced = got[j]
        same_op = op_kind(label) == op_kind(traced_label)
        if same_op and [tuple(s) for s in shapes] == [tuple(s) for s in traced]:
            i, j = i + 1, j + 1
        elif skip is not None:
            i = skip
        elif not same_op and op_kind(traced_label) in ("clone", "contiguous"):
            j += 1  # a copy the layout needs here (reshape of a non-contiguous local tensor)
        elif not same_op:
            return j, f"op {traced_label} where the plan traced {label}", i
        else:
            return j, (f"op {traced_label} gives shapes {[list(s) for s in traced]}, the plan predicts "
                       f"{[list(s) for s in shapes]}"), i
    while i < len(want) and want[i][2] is not None:
        i = want[i][2]
    if i < len(want) or j < len(got):
        return j, f"{len(got)} ops where the plan traced {len(want)}", i
    return None


def check_model_trace(prediction: Prediction, got: List[Tuple[str, List[tuple]]], rank: int) -> None:
    """Compares the trace of a whole sharded model (on meta) with the prediction, op by op: the
    same ops (up to the runs a rank may skip) with the predicted shapes. It also catches a block
    the capture folded (see folding.py) that does not compute what its first block computes."""
    graph = prediction.graph
    found = first_difference(got, prediction.nodes(rank))
    if found is None:
        return
    _, why, index = found
    index = min(index, len(graph.nodes) - 1)
    owner = _pre_hooked(graph, index) or _owners(graph).get(index, "<model>")
    folded = [block for block in graph.folded if owner == block or owner.startswith(block + ".")]
    if folded:
        why += (f" ({folded[0]!r} was recorded as identical to {graph.folded[folded[0]]!r} without being run, and "
                "computes something else: parallelize(model) without a plan plans such a model running every block)")
    error = (FoldedBlockMismatch if folded else ShapeMismatch)(f"in module {owner!r} on rank {rank}, {why}")
    error.module = owner  # where a plan made again holds the layers whole (plan_until_it_runs)
    raise error


def _pre_hooked(graph: CapturedGraph, index: int) -> Optional[str]:
    """The module whose call starts right after node `index` where that module has forward
    pre-hooks of the model's own (torch.nn.utils.weight_norm computes the weight in one): the op
    is the hook's, run before the module's call records anything, so the module is where it
    differs; None otherwise."""
    shadow = getattr(graph, "shadow", None)
    if shadow is None:
        return None
    starting = [(end - first, name) for name, (first, end) in graph.module_nodes.items() if first == index + 1]
    for _, name in sorted(starting, reverse=True):  # the outermost: the hook runs before its inner calls
        try:
            module = shadow.get_submodule(name) if name else None
        except AttributeError:  # a recorded call that is no module (an attention's q/k/v projection)
            continue
        if module is not None and module._forward_pre_hooks:
            return name
    return None


def _owners(graph: CapturedGraph) -> Dict[int, str]:
    """Node index -> the innermost module whose first call recorded it."""
    owner = {}
    for name, (first, end) in sorted(graph.module_nodes.items(), key=lambda kv: kv[1][1] - kv[1][0]):
        for index in range(first, max(end, first)):
            owner.setdefault(index, name)
    return owner
