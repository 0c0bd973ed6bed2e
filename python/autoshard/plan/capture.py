"""Records a model's dataflow on meta tensors, as the graph the C++ planner reads.

Linear-like layers, embeddings and einsum layers are recorded as single nodes (the planner
decides how to split them and parallelize() swaps them); everything else is recorded at the
ATen level and reduced to the few kinds of op that matter for following a sharded axis.
Nothing is materialised: a model on a real device is shadowed by a meta copy first.
"""

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..nn.multihead_attention import (AttentionCalls, ParallelMultiheadAttention, average_over_heads, multihead_attention,
                                      unsupported)
from .folding import BlockFolder
from .index_lists import ConsecutiveIndexLists
from .inputs import example_inputs_for, missing_decoder_inputs
from .computed_tensors import computed_tensors
from .layers import LayerInfo, describe_layer, experts_weights, in_projection_layer, is_linear_like, rms_norm_form
from .meta_autocast import meta_autocast
from .meta_values import KnownValues

aten = torch.ops.aten

_VIEWS = {
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.unsqueeze, aten.squeeze,
    aten.flatten, aten.unflatten, aten.view_as, aten.alias, aten.lift_fresh,
}
_PERMUTES = {aten.t, aten.transpose, aten.permute, aten.numpy_T, aten.swapaxes, aten.movedim}
_SOFTMAX = {aten._softmax, aten.softmax, aten._safe_softmax, aten._log_softmax, aten.log_softmax, aten.cumsum}
_REDUCE_DIMS = {
    aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean, aten.std_mean,
    aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.max, aten.min, aten.argmax, aten.argmin, aten.any, aten.all,
    aten.prod,
}
_NORMS = {aten.native_layer_norm, aten.layer_norm}
_SPLITS = {aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk, aten.unsafe_split_with_sizes}
_ATTENTION_PREFIX = "_scaled_dot_product"
# What an experts module may do with its 3-D weights: take experts and views of them, and
# multiply them by activations (per expert, batched or grouped).
_EXPERT_WEIGHT_VIEWS = {
    aten.select, aten.index, aten.index_select, aten.transpose, aten.t, aten.permute, aten.view, aten._unsafe_view,
    aten.reshape, aten.unsqueeze, aten.squeeze, aten.slice, aten.expand, aten.alias, aten.detach, aten._to_copy,
    aten.clone, aten.contiguous, aten.unbind, aten.lift_fresh,
}
_EXPERT_WEIGHT_PRODUCTS = {aten.mm, aten.bmm, aten._grouped_mm, aten.addmm, aten.baddbmm, aten.matmul, aten.linear}
# Ops after an experts module's out projection that are linear in its (then partial) outputs:
# a sum over the ranks after them equals them applied to the sum.
_PRODUCTS_OF_TWO = {aten.mul, aten.mul_, aten.div, aten.div_, aten.bmm, aten.mm, aten.matmul}
_LINEAR_IN_PARTIAL_SUMS = _EXPERT_WEIGHT_VIEWS | _PRODUCTS_OF_TWO | {
    aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_, aten.index_put, aten.index_put_,
    aten.add, aten.add_, aten.sum, aten.cat, aten.stack, aten.copy_, aten.to, aten.neg, aten.zeros_like,
    aten.empty_like, aten.new_zeros, aten.masked_fill, aten.where, aten.split, aten.split_with_sizes, aten.chunk,
    aten.flatten, aten.unflatten, aten.as_strided, aten.view_as, aten.sub, aten.sub_, aten.narrow,
}
_COPIES = {
    aten.clone, aten._to_copy, aten.detach, aten.copy_, aten.native_dropout, aten.dropout, aten.contiguous,
    aten.where, aten.masked_fill, aten.type_as, aten.to,
    # Tensors made "like" another (dropout masks) take its local shape, so they follow its layout.
    aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
    aten.bernoulli, aten.bernoulli_, aten.uniform_, aten.normal_, aten.fill_, aten.zero_,
}


@dataclass
class CapturedGraph:
    document: Dict[str, Any]  # the planner's input, a versioned graph document (see csrc/plan/graph.h)
    layers: Dict[int, LayerInfo]  # planner node index -> the layer module it stands for
    param_names: List[str]  # parameter index -> a qualified name
    output_shapes: List[Tuple[int, ...]]
    shadow: nn.Module = None  # the meta model that ran
    module_inputs: Dict[str, Tuple[tuple, dict]] = field(default_factory=dict)  # first call of each module
    description: str = ""
    example_inputs: Optional[Dict[str, Any]] = None  # shapes and dtypes, to make them again
    shapes: List[Tuple[int, ...]] = field(default_factory=list)  # tensor id -> global shape
    nodes: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=list)  # (op label, input ids, output ids)
    module_nodes: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # first call: [first, end) nodes
    # The values of the tensors computed from the inputs (module_inputs' among them), for replays.
    values: Optional[KnownValues] = None
    # The example inputs (args, kwargs) with their values on the CPU (None where too large to keep).
    input_values: Optional[Tuple[tuple, dict]] = None
    folded: Dict[str, str] = field(default_factory=dict)  # block recorded without running -> the block it copies
    inner_nodes: set = field(default_factory=set)  # nodes inside a layer, which no trace sees
    layer_calls: set = field(default_factory=set)  # nodes a trace sees as a layer's call
    # Each module called once (the model itself left out): (leaf, tensor id) of the recorded
    # tensors it returned, leaf being the place among the flattened outputs.
    module_exits: Dict[str, List[Tuple[int, int]]] = field(default_factory=dict)
    # Per tensor id: whether it is floating-point (or complex), so that a gradient can reach it.
    floating: List[bool] = field(default_factory=list)


def _narrows(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a cast rounds floating-point values to a narrower dtype."""
    return x.is_floating_point() and out.is_floating_point() and out.element_size() < x.element_size()


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@dataclass
class ExpertReads:
    """What an experts module's call has read so far (see _Recorder.follow_expert_weights)."""
    tracked: Dict[int, torch.Tensor]  # its weights and the views taken of them
    out_weight: Dict[int, torch.Tensor]  # the out weight and its views
    partial: Dict[int, torch.Tensor] = field(default_factory=dict)  # what follows linearly from out products
    refusals: List[str] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, param_index: Dict[int, int]):
        super().__init__()
        self.param_index = param_index
        self.ids: Dict[int, int] = {}
        self.keep: List[torch.Tensor] = []  # holds every recorded tensor so ids stay unique
        self.tensors: List[Dict[str, Any]] = []  # the graph document's tensor records, by id
        self.node_records: List[Dict[str, Any]] = []  # and its node records
        self.shapes: List[Tuple[int, ...]] = []
        self.nodes: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = []
        self.node_count = 0
        self.layer_depth = 0
        # What was recorded, in order: ("tensor", id) and ("node", kind, label, inputs, outputs,
        # fields), so that a call of a block can be recorded again for an identical block.
        self.log: List[tuple] = []
        # Nodes a layer stands for without a traced op of their own (an experts module's inner
        # nodes), and nodes a trace sees as one layer call (its combining node); see Prediction.
        self.inner_nodes = set()
        self.layer_calls = set()
        # Within an experts module's call: (id -> its weights and their views, ops refused).
        self.experts_reads = None
        # Tensors a layer's call gave: an RMS norm called on one is one node (see norm_calls).
        self.layer_outputs = set()

    def layer_output(self, t: torch.Tensor, linear: bool = True) -> int:
        """t's id, remembered as a Linear-like layer's output where `linear` (not an embedding's)."""
        index = self.tensor_id(t)
        if linear:
            self.layer_outputs.add(index)
        return index

    def tensor_id(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self.ids:
            self.ids[key] = self.declare(t.shape)
            self.keep[-1] = t
            if key in self.param_index:
                self.tensors[-1]["param"] = self.param_index[key]
        return self.ids[key]

    def declare(self, shape) -> int:
        """A new tensor id of the given shape (a tensor of a block that is not run)."""
        index = len(self.keep)
        self.keep.append(None)
        self.shapes.append(tuple(int(s) for s in shape))
        self.tensors.append({"shape": list(self.shapes[-1])})
        self.log.append(("tensor", index))
        return index

    def fresh(self, like: torch.Tensor) -> int:
        stand_in = torch.empty(like.shape, device="meta")
        return self.tensor_id(stand_in)

    def node(self, kind: str, label: str, inputs: Sequence[int], outputs: Sequence[int],
             fields: Optional[Dict[str, Any]] = None, traced: str = "") -> int:
        """traced: "" for an op a trace sees, "inner" for a node inside a layer, "call" for the
        node a trace sees as the layer's call."""
        fields = dict(fields or {})
        self.node_records.append({"kind": kind, "label": label, "inputs": list(inputs), "outputs": list(outputs),
                                  **fields})
        self.nodes.append((label, tuple(inputs), tuple(outputs)))
        self.log.append(("node", kind, label, tuple(inputs), tuple(outputs), fields, traced))
        if traced == "inner":
            self.inner_nodes.add(self.node_count)
        elif traced == "call":
            self.layer_calls.add(self.node_count)
        self.node_count += 1
        return self.node_count - 1

    def experts_nodes(self, info: LayerInfo, output: torch.Tensor, layers: Dict[int, LayerInfo]) -> None:
        """An experts module's call as the planner reads it: every token through one gated MLP
        of Linear-like nodes on the FFN axis ("in", the gate/up split and product, "out"), whose
        output a routing-weighted combine (opaque: the routing is not followed) turns into the
        module's output. What the ranks compute per expert is exactly this MLP on the FFN
        slice each holds, so its splits are the MLP's."""
        x = info.input
        tokens = tuple(x.shape[:-1])
        in_side, out_side = info.experts_side("in"), info.experts_side("out")
        fused = self.declare(tokens + (in_side.out_features,))
        node = self.node("linear", info.name, [self.tensor_id(x)], [fused], in_side.planner_fields(x, output), "inner")
        layers[node] = in_side.record_call(x, output)
        hidden = fused
        if info.parts == 2:
            gate, up = self.declare(tokens + (out_side.in_features,)), self.declare(tokens + (out_side.in_features,))
            self.node("split", info.name + ".gate_up", [fused], [gate, up], {"dim": len(tokens)}, "inner")
            hidden = self.declare(tokens + (out_side.in_features,))
            self.node("pointwise", info.name + ".gate", [gate, up], [hidden], None, "inner")
        else:
            hidden = self.declare(tokens + (out_side.in_features,))
            self.node("pointwise", info.name + ".act", [fused], [hidden], None, "inner")
        down = self.declare(tokens + (out_side.out_features,))
        node = self.node("linear", info.name, [hidden], [down], out_side.planner_fields(x, output), "inner")
        layers[node] = out_side.record_call(x, output)
        routing = [t for t in info.inputs[1:] if isinstance(t, torch.Tensor)]
        self.node("opaque", info.name + ".combine", [down] + [self.tensor_id(t) for t in routing],
                  [self.tensor_id(output)], {"routing_floating": [t.is_floating_point() for t in routing]}, "call")

    def document(self, outputs: Sequence[int] = ()) -> Dict[str, Any]:
        """The planner's graph document, version 1 (csrc/plan/graph.h)."""
        tensors = [dict(t) for t in self.tensors]
        for t in outputs:
            tensors[t]["output"] = True
        return {"version": 1, "tensors": tensors, "nodes": _mark_partitions(self.node_records, tensors)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer_depth == 0:
            self.record(func, args, kwargs, out)
        elif self.experts_reads is not None:
            self.follow_expert_weights(func, args, kwargs, out)
        return out

    def follow_expert_weights(self, func, args, kwargs, out) -> None:
        """Inside an experts module's call: its weights (and the views and experts taken of them)
        may only be multiplied by activations. Anything else (a norm over a weight's FFN axis)
        would compute otherwise than split experts: the module is then kept whole. The products
        with the out weight are partial sums once the experts are split over their FFN axis:
        only ops linear in them (views, copies, sums, a product with a routing weight) may follow
        before the module's output; a norm of each expert's output would normalise a partial sum."""
        reads = self.experts_reads
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        read = [t for t in flat if id(t) in reads.tracked]
        packet = func.overloadpacket
        if read:
            of_out_weight = any(id(t) in reads.out_weight for t in read)
            if packet in _EXPERT_WEIGHT_VIEWS:
                for o in outs:
                    reads.tracked[id(o)] = o
                    if of_out_weight:
                        reads.out_weight[id(o)] = o
            elif packet not in _EXPERT_WEIGHT_PRODUCTS:
                reads.refusals.append(str(func))
            elif of_out_weight:
                reads.partial.update((id(o), o) for o in outs)
            return
        partial = [t for t in flat if id(t) in reads.partial]
        if not partial:
            return
        if packet not in _LINEAR_IN_PARTIAL_SUMS or (packet in _PRODUCTS_OF_TWO and len(partial) > 1):
            reads.refusals.append(f"{func} of an expert's output before the experts' outputs are summed")
            return
        reads.partial.update((id(o), o) for o in outs)

    def record(self, func, args, kwargs, out) -> None:
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        flat_out = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not flat_out:
            return
        packet = func.overloadpacket
        label = str(func).replace(" ", "")
        inputs = [self.tensor_id(t) for t in flat_in]
        if not inputs:
            self.node("source", label, [], [self.tensor_id(o) for o in flat_out])
            return
        x = flat_in[0]
        if packet in _VIEWS and len(flat_in) == 1:
            self.node("view", label, inputs, [self.tensor_id(flat_out[0])])
        elif packet in _PERMUTES:
            self.node("permute", label, inputs[:1], [self.tensor_id(flat_out[0])],
                      {"permutation": self.permutation(packet, x, args)})
        elif packet is aten.expand:
            self.node("expand", label, inputs[:1], [self.tensor_id(flat_out[0])])
        elif packet in (aten.mm, aten.bmm):
            self.node("matmul", label, inputs[:2], [self.tensor_id(flat_out[0])])
        elif packet in (aten.addmm, aten.baddbmm):
            product = self.fresh(flat_out[0])
            self.node("matmul", label, inputs[1:3], [product])
            self.node("pointwise", label, [inputs[0], product], [self.tensor_id(flat_out[0])])
        elif packet.__name__.startswith(_ATTENTION_PREFIX):
            self.node("attention", label, inputs, [self.tensor_id(o) for o in flat_out])
        elif packet in _SOFTMAX:
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": [_normalize_dim(args[1], x.dim())]})
        elif packet in _REDUCE_DIMS:
            # A norm's order comes before its dims (DoRA's weight norm: aten.norm(w, 2.0, [1])).
            dim_args = (args[0],) + tuple(args[2:]) if packet in (aten.norm, aten.linalg_vector_norm) else args
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": self.reduced_dims(dim_args, kwargs, x)})
        elif packet in _NORMS or packet.__name__.endswith("rms_norm"):
            normalized = len(args[1]) if isinstance(args[1], (list, tuple)) else 1
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": list(range(x.dim() - normalized, x.dim()))})
        elif packet in _SPLITS:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            self.node("split", label, inputs[:1], [self.tensor_id(o) for o in flat_out], {"dim": _normalize_dim(dim, x.dim())})
        elif packet is aten.stack:
            self.record_stack(label, args, kwargs, flat_in, inputs, flat_out[0])
        elif packet is aten.repeat:
            self.record_repeat(label, args[1], x, inputs[0], flat_out[0])
        elif packet is aten.view_as_complex:
            # [..., n, 2] real pairs -> [..., n] complex: the last axis folds away, as if reduced.
            self.node("reduce", label, inputs, [self.tensor_id(flat_out[0])], {"axes": [x.dim() - 1]})
        elif packet is aten.view_as_real:
            # [..., n] complex -> [..., n, 2]: a trailing axis of 1, broadcast to the pair.
            pairs = self.declare(tuple(x.shape) + (1,))
            self.node("view", label, inputs, [pairs])
            self.node("expand", label, [pairs], [self.tensor_id(flat_out[0])])
        elif packet is aten.cat:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            # cat drops empty 1-d tensors, which may come with any shape.
            kept = [i for i, t in zip(inputs, flat_in) if t.dim() == flat_out[0].dim()]
            self.node("cat", label, kept, [self.tensor_id(flat_out[0])], {"dim": _normalize_dim(dim, flat_out[0].dim())})
        elif packet in (aten.slice, aten.narrow, aten.select):
            self.node("slice", label, inputs[:1], [self.tensor_id(flat_out[0])], self.slice_fields(packet, x, args))
        elif packet in _COPIES or torch.Tag.pointwise in func.tags:
            # The planner keeps narrowing casts of parameters out of sequence regions.
            narrowing = packet in (aten._to_copy, aten.to) and _narrows(x, flat_out[0])
            self.node("pointwise", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"narrowing": True} if narrowing else None)
        else:
            self.node("opaque", label, inputs, [self.tensor_id(o) for o in flat_out])

    def record_stack(self, label, args, kwargs, flat_in, inputs, out) -> None:
        """stack is a cat of its inputs, each given a new axis of 1 at `dim`."""
        dim = _normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
        unsqueezed = []
        for tensor, source in zip(flat_in, inputs):
            shape = list(tensor.shape)
            shape.insert(dim, 1)
            unsqueezed.append(self.declare(shape))
            self.node("view", label, [source], [unsqueezed[-1]])
        self.node("cat", label, unsqueezed, [self.tensor_id(out)], {"dim": dim})

    def record_repeat(self, label, repeats, x, source, out) -> None:
        """repeat as the broadcast it is: an axis of 1 repeated is expanded; an axis longer than
        1 is tiled, which is a view giving it an axis of 1 in front, expanded, then merged (so
        a sharded axis repeated whole becomes an outer factor, and one left alone passes)."""
        repeats = [int(r) for r in repeats]
        shape = [1] * (len(repeats) - x.dim()) + list(x.shape)
        tiled = [i for i, (r, s) in enumerate(zip(repeats, shape)) if r > 1 and s > 1]
        if not tiled:
            self.node("expand", label, [source], [self.tensor_id(out)])
            return
        spread, grown = [], []
        for i, (r, s) in enumerate(zip(repeats, shape)):
            if i in tiled:
                spread += [1, s]
                grown += [r, s]
            else:
                spread.append(s)
                grown.append(r * s)
        before = self.declare(spread)
        after = self.declare(grown)
        self.node("view", label, [source], [before])
        self.node("expand", label, [before], [after])
        self.node("view", label, [after], [self.tensor_id(out)])

    @staticmethod
    def permutation(packet, x, args) -> List[int]:
        n = x.dim()
        order = list(range(n))
        if packet in (aten.t, aten.numpy_T):
            return order[::-1]
        if packet in (aten.transpose, aten.swapaxes):
            a, b = _normalize_dim(args[1], n), _normalize_dim(args[2], n)
            order[a], order[b] = order[b], order[a]
            return order
        if packet is aten.permute:
            return [_normalize_dim(d, n) for d in args[1]]
        source, destination = args[1], args[2]  # movedim with ints
        order.remove(_normalize_dim(source, n))
        order.insert(_normalize_dim(destination, n), _normalize_dim(source, n))
        return order

    @staticmethod
    def reduced_dims(args, kwargs, x) -> List[int]:
        dims = args[1] if len(args) > 1 and not isinstance(args[1], bool) else kwargs.get("dim")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return list(range(x.dim()))
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [_normalize_dim(d, x.dim()) for d in dims]

    @staticmethod
    def slice_fields(packet, x, args) -> Dict[str, Any]:
        dim = _normalize_dim(args[1] if len(args) > 1 else 0, x.dim())
        size = x.shape[dim]
        if packet is aten.select:
            index = args[2] % size if size else 0
            return {"dim": dim, "start": index, "stop": index + 1, "drop_dim": True}
        if packet is aten.narrow:
            return {"dim": dim, "start": args[2], "stop": args[2] + args[3], "drop_dim": False}
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        stop = args[3] if len(args) > 3 and args[3] is not None else size
        step = args[4] if len(args) > 4 else 1
        start, stop = max(min(start + size if start < 0 else start, size), 0), max(min(stop + size if stop < 0 else stop, size), 0)
        if step != 1:
            stop = start  # a strided slice is never a whole axis
        return {"dim": dim, "start": start, "stop": stop, "drop_dim": False}


def _mark_partitions(nodes: List[Dict[str, Any]], tensors: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The nodes, with each group of slices of one tensor along one axis that cover the axis in
    order without overlap (q, k and v sliced from a fused projection) given its "partition"
    (the slices' sizes by position) and each slice its "part": the planner takes them for a
    split."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for index, node in enumerate(nodes):
        if node["kind"] == "slice" and not node["drop_dim"] and node["stop"] > node["start"]:
            groups.setdefault((node["inputs"][0], node["dim"]), []).append(index)
    marked = list(nodes)
    for (tensor, dim), members in groups.items():
        ranges = sorted({(nodes[i]["start"], nodes[i]["stop"]) for i in members})
        length = tensors[tensor]["shape"][dim]
        covers = len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == length and all(
            a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if not covers:
            continue
        sizes = [stop - start for start, stop in ranges]
        for i in members:
            part = ranges.index((nodes[i]["start"], nodes[i]["stop"]))
            marked[i] = {**nodes[i], "partition": sizes, "part": part}
    return marked


def norm_calls(root: nn.Module, recorder: "_Recorder", record, is_layer) -> list:
    """Hooks on root's RMS norm modules (rms_norm_form) that are no layer: a call on a tensor a
    Linear-like layer's call gave (OLMo 2's q_norm over q_proj's output) is recorded by `record(name,
    module, x, out)` as one node instead of its ops, so that the planner can split it with the
    layer's features. A norm called on anything else (the residual stream) is left to be
    recorded op by op. Returns the hook handles."""
    handles = []
    for name, module in root.named_modules():
        if is_layer(module) or rms_norm_form(module) is None:
            continue
        calls = []

        def pre(mod, inputs, calls=calls):
            x = inputs[0] if len(inputs) == 1 else None
            ours = (recorder.layer_depth == 0 and isinstance(x, torch.Tensor)
                    and recorder.ids.get(id(x), -1) in recorder.layer_outputs)
            calls.append(x if ours else None)
            if ours:
                recorder.layer_depth += 1

        def post(mod, inputs, output, calls=calls, name=name):
            x = calls.pop() if calls else None
            if x is None:
                return
            recorder.layer_depth -= 1
            if isinstance(output, torch.Tensor):
                record(name, mod, x, output)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def attention_calls(root: nn.Module, recorder: "_Recorder", record_layer,
                    record_weights=None) -> contextlib.AbstractContextManager:
    """While active, the calls of root's nn.MultiheadAttention modules compute their attention
    with multihead_attention (the sharded module's own computation), their q/k/v projection
    recorded by `record_layer(module name, module, x, out)` as one layer, their out_proj
    called as the module it is and the weights they return with need_weights recorded by
    `record_weights(module name, weights, returned, average)` as one node (by default as a
    trace sees ReturnedWeights: one layer call). Calls it does not compute are left to torch."""
    record_weights = record_weights or _weights_as_layer(recorder)
    owners = {id(m.in_proj_weight): (name, m) for name, m in root.named_modules()
              if isinstance(m, nn.MultiheadAttention) and not isinstance(m, ParallelMultiheadAttention)
              and m.in_proj_weight is not None}
    if not owners:
        return contextlib.nullcontext()

    def attend(arguments):
        owner = owners.get(id(arguments["in_proj_weight"]))
        if owner is None or recorder.layer_depth != 0 or unsupported(arguments) is not None:
            return None
        name, module = owner

        def project(x):
            recorder.layer_depth += 1
            try:
                out = F.linear(x, arguments["in_proj_weight"], arguments["in_proj_bias"])
            finally:
                recorder.layer_depth -= 1
            record_layer(name, module, x, out)
            return out

        def returned_weights(weights, average):
            recorder.layer_depth += 1
            try:
                returned = average_over_heads(weights, average)
                if returned is weights:
                    returned = weights.view(weights.shape)  # a tensor of its own, the node's output
            finally:
                recorder.layer_depth -= 1
            record_weights(name, weights, returned, average)
            return returned

        return multihead_attention(arguments, project, module.out_proj, returned_weights)

    return AttentionCalls(attend)


def record_attention_weights(recorder: "_Recorder", name: str, weights: torch.Tensor, returned: torch.Tensor,
                             average: bool) -> None:
    """The planner's node for the weights an nn.MultiheadAttention named `name` returns (heads
    on axis 1 of `weights`): a trace sees it as the call of ReturnedWeights."""
    recorder.node("attention_weights", name, [recorder.tensor_id(weights)], [recorder.tensor_id(returned)],
                  {"dim": 1, "average": bool(average)}, "call")


def _weights_as_layer(recorder: "_Recorder"):
    """record_weights for attention_calls in a trace: one "layer" node, as ReturnedWeights is."""
    return lambda name, weights, returned, average: recorder.nodes.append(
        ("layer", (), (recorder.tensor_id(returned),)))


def meta_shadow(model: nn.Module, always_copy: bool = False) -> nn.Module:
    """The model itself if it is already on meta (unless always_copy), else a meta copy that
    shares no storage with it."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not always_copy and all(t.device.type == "meta" for t in tensors):
        return model
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for t in computed_tensors(model, memo):
        memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)


def split_inputs(example_inputs) -> Tuple[tuple, dict]:
    """example_inputs as (args, kwargs): a dict is keyword arguments, a tuple or list positional
    arguments, anything else the one positional argument."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def inputs_on_meta(model: nn.Module, example_inputs, values: KnownValues) -> Tuple[tuple, dict]:
    """The example inputs (made for `model` if None) on meta, their values known to `values`."""
    if example_inputs is None:
        args, kwargs = example_inputs_for(model)
    else:
        args, kwargs = split_inputs(example_inputs)
    return values.to_meta(args), values.to_meta(kwargs)


def capture(model: nn.Module, example_inputs=None, fold_blocks: bool = True) -> CapturedGraph:
    shadow = meta_shadow(model)
    values = KnownValues()
    args, kwargs = inputs_on_meta(shadow, example_inputs, values)
    input_values = tree_map(lambda t: _clone(values.twin(t)) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    if any(v is None for v, t in zip(tree_flatten(input_values)[0], tree_flatten((args, kwargs))[0])
           if isinstance(t, torch.Tensor)):
        input_values = None  # too large to keep: the dry run makes zeros of their shapes

    param_names: List[str] = []
    param_index: Dict[int, int] = {}
    for name, p in shadow.named_parameters(remove_duplicate=True):
        param_index[id(p)] = len(param_names)
        param_names.append(name)

    recorder = _Recorder(param_index)
    layers: Dict[int, LayerInfo] = {}
    layer_by_module: Dict[int, LayerInfo] = {}
    handles = []
    module_inputs: Dict[str, Tuple[tuple, dict]] = {}
    module_nodes: Dict[str, Tuple[int, int]] = {}
    module_entries: Dict[str, List[Tuple[int, int]]] = {}
    module_exits: Dict[str, List[Tuple[int, int]]] = {}
    called_again = set()
    folder = BlockFolder(shadow, recorder, param_index, layers, module_inputs, module_nodes, enabled=fold_blocks,
                         replayable=lambda a, kw: (_replayable(a), _replayable(dict(kw))), module_entries=module_entries)
    for name, module in shadow.named_modules():
        def remember(mod, a, kw, name=name):
            if name not in module_nodes:
                # A block to be folded takes its first block's inputs (see BlockFolder), unless it runs.
                if name not in folder.folds:
                    module_inputs[name] = (_replayable(a), _replayable(dict(kw)))
                module_nodes[name] = (recorder.node_count, -1)
                # Where each recorded tensor enters the call, for the planner's "entry" records.
                leaves = tree_flatten((tuple(a), dict(kw)))[0]
                module_entries[name] = [(i, recorder.ids[id(t)]) for i, t in enumerate(leaves)
                                        if isinstance(t, torch.Tensor) and id(t) in recorder.ids]
            else:
                # A hook on the output of a module called again would act on every call.
                called_again.add(name)

        def finished(mod, a, out, name=name):
            if name in module_nodes and module_nodes[name][1] < 0:
                module_nodes[name] = (module_nodes[name][0], recorder.node_count)
                # Where each recorded tensor leaves the call, for gathers at a module's output.
                leaves = tree_flatten(out)[0]
                module_exits[name] = [(i, recorder.ids[id(t)]) for i, t in enumerate(leaves)
                                      if isinstance(t, torch.Tensor) and id(t) in recorder.ids]

        handles.append(module.register_forward_pre_hook(remember, with_kwargs=True))
        handles.append(module.register_forward_hook(finished))
    for name, module in shadow.named_modules(remove_duplicate=False):
        info = describe_layer(name, module, param_index)
        if info is None:
            continue
        if id(module) in layer_by_module:  # a module reachable under two names is one layer
            continue
        layer_by_module[id(module)] = info

        def pre(mod, inputs, info=info):
            if recorder.layer_depth == 0:
                info.input = inputs[0] if inputs else None
                info.inputs = tuple(inputs)
                if info.kind == "experts":
                    out_weight = getattr(mod, experts_weights(mod)[1])
                    recorder.experts_reads = ExpertReads({id(p): p for p in mod._parameters.values() if p is not None},
                                                         {id(out_weight): out_weight})
            recorder.layer_depth += 1

        def post(mod, inputs, output, info=info):
            recorder.layer_depth -= 1
            if info.kind == "experts" and recorder.layer_depth == 0:
                refusals = recorder.experts_reads.refusals
                recorder.experts_reads = None
                if (not refusals and isinstance(info.input, torch.Tensor) and isinstance(output, torch.Tensor)
                        and output.shape == info.input.shape):
                    recorder.experts_nodes(info, output, layers)
                else:
                    # Its weights used otherwise than multiplied by its inputs (a norm over the
                    # FFN axis), or a call of another form: one opaque call, its weights whole.
                    received = [t for t in tree_flatten(info.inputs)[0] if isinstance(t, torch.Tensor)]
                    made = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)]
                    recorder.node("opaque", info.name or "<model>", [recorder.tensor_id(t) for t in received],
                                  [recorder.tensor_id(o) for o in made], {"routing_floating": []}, "call")
            elif recorder.layer_depth == 0 and isinstance(info.input, torch.Tensor) and isinstance(output, torch.Tensor):
                node = recorder.node(info.kind, info.name or "<model>", [recorder.tensor_id(info.input)],
                                     [recorder.layer_output(output, info.kind in ("linear", "einsum"))],
                                     info.planner_fields(info.input, output))
                layers[node] = info.record_call(info.input, output)
            info.input = None
            info.inputs = ()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    def record_in_projection(name, module, x, out):
        info = in_projection_layer(name, module, param_index)
        node = recorder.node(info.kind, info.name, [recorder.tensor_id(x)], [recorder.layer_output(out)],
                             info.planner_fields(x, out))
        layers[node] = info.record_call(x, out)

    def record_norm(name, module, x, out):
        weight = module.weight
        recorder.node("norm", name, [recorder.tensor_id(x), recorder.tensor_id(weight)], [recorder.tensor_id(out)],
                      {"weight_param": param_index.get(id(weight), -1)}, "call")

    handles += norm_calls(shadow, recorder, record_norm, lambda m: describe_layer("", m, {}) is not None)
    example = describe_inputs(args, kwargs)
    try:
        with torch.no_grad(), meta_autocast(), values, recorder, folder, ConsecutiveIndexLists(), attention_calls(
                shadow, recorder, record_in_projection, functools.partial(record_attention_weights, recorder)):
            outputs = shadow(*args, **kwargs)
    except Exception as error:
        hint = ""
        if example_inputs is not None and missing_decoder_inputs(shadow, kwargs):
            hint = (f"; {type(shadow).__name__} is an encoder-decoder model and example_inputs has no "
                    "decoder_input_ids (nor decoder_inputs_embeds or labels): add decoder_input_ids to the dict, "
                    "or leave example_inputs=None to have every input made from the config")
        raise RuntimeError(
            f"plan: the model's forward failed on the meta device ({type(error).__name__}: {error}){hint}; autoshard "
            "plans by running the forward on meta tensors, so the model must support them and example_inputs must "
            "fit it"
        ) from error
    finally:
        for h in handles:
            h.remove()

    if hasattr(outputs, "to_tuple"):
        outputs = outputs.to_tuple()
    flat = [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor)]
    # A tensor a module's first call received, where sequence parallelism may cut it to this
    # rank's tokens: {"tensor", "first", "end" (the call's nodes), "leaf" (its place among the
    # call's flattened inputs), "module"}.
    entries = [{"tensor": tensor, "first": module_nodes[name][0], "end": module_nodes[name][1], "leaf": leaf,
                "module": name}
               for name, received in module_entries.items() if name and module_nodes[name][1] >= module_nodes[name][0]
               for leaf, tensor in received]
    return CapturedGraph(
        document={**recorder.document([recorder.tensor_id(o) for o in flat]), "entries": entries},
        layers=layers,
        param_names=param_names,
        output_shapes=[tuple(o.shape) for o in flat],
        shadow=shadow,
        module_inputs=module_inputs,
        description=input_shapes(args, kwargs),
        example_inputs=example if all(a is not None for a in example["args"]) else None,
        shapes=recorder.shapes,
        nodes=recorder.nodes,
        module_nodes=module_nodes,
        values=values,
        input_values=input_values,
        folded={name: folder.folds[name] for name in folder.folded},
        inner_nodes=recorder.inner_nodes,
        layer_calls=recorder.layer_calls,
        module_exits={name: left for name, left in module_exits.items() if name and name not in called_again},
        floating=[t is None or t.is_floating_point() or t.is_complex() for t in recorder.keep],
    )


def _clone(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if value is None else value.clone()


def describe_inputs(args, kwargs) -> Dict[str, Any]:
    """The shapes and dtypes of example inputs, as a plan records them."""
    return {"args": [_describe(a) for a in args],
            "kwargs": {k: _describe(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}


def _describe(value):
    if not isinstance(value, torch.Tensor):
        return None
    return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}


class StateAtCall:
    """A stateful input (a key/value cache that grows with each call) as it was when a module
    was first called: each replay gets a fresh copy of it, so that the replay traces the ops
    the capture traced (a sliding window's slices of the cache) and leaves no trace behind."""

    def __init__(self, state):
        self._state = _copy_structure(state)

    def fresh(self):
        return _copy_structure(self._state)

    # Identical blocks are given caches of the same kind; what they hold of earlier blocks is
    # not what a block's own call reads.
    def __eq__(self, other):
        return isinstance(other, StateAtCall) and type(other._state) is type(self._state)

    def __hash__(self):
        return hash(type(self._state))


def _copy_structure(state):
    """A deep copy of `state` that shares its tensors: the containers and objects that a cache
    rebinds as it grows are copied, while meta tensors, which hold no data to change, are not
    (copying them would make the capture's cost grow with the square of the layer count)."""
    memo, seen, stack = {}, set(), [state]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            memo[id(value)] = value
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend(vars(value).values())
    return copy.deepcopy(state, memo)


def _replayable(value):
    """A module's inputs with stateful objects kept as they were at the call (StateAtCall),
    or None for one that cannot be copied."""
    if isinstance(value, (torch.Tensor, int, float, bool, str, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_replayable(v) for v in value)
    if isinstance(value, dict):
        return {k: _replayable(v) for k, v in value.items()}
    try:
        return StateAtCall(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is replayed as None
        return None


def replay_inputs(value):
    """Recorded inputs ready for one replay: every StateAtCall replaced by a fresh copy."""
    return tree_map(lambda v: v.fresh() if isinstance(v, StateAtCall) else v, value)


def input_shapes(args, kwargs) -> str:
    """The example inputs' shapes in words: "input_ids (2, 8), ..."."""
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in _named_tensors(args, kwargs))


def _named_tensors(args, kwargs):
    named = [(f"input {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(k, v) for k, v in named if isinstance(v, torch.Tensor)]


def trace_text(module: nn.Module, args: tuple, kwargs: dict, values: Optional[KnownValues] = None) -> str:
    """The ATen-level graph of one module call, for comparing two variants of a module."""
    recorder = _Recorder({})
    args, kwargs = replay_inputs((args, kwargs))
    with torch.no_grad(), meta_autocast(), values or contextlib.nullcontext(), recorder, ConsecutiveIndexLists(), \
            attention_calls(module, recorder, _as_layer(recorder)):
        module(*args, **kwargs)
    return repr((recorder.tensors, recorder.node_records))


def _as_layer(recorder: _Recorder):
    """record_layer for attention_calls in a trace: the projection is one "layer" node."""
    return lambda name, module, x, out: recorder.nodes.append(("layer", (), (recorder.layer_output(out),)))


def trace_shapes(module: nn.Module, args: tuple, kwargs: dict, is_layer, values: Optional[KnownValues] = None):
    """(op label, output shapes) of every node of one call of `module`, recorded as capture()
    records them: the modules for which `is_layer(module)` holds are one node each (labelled
    "layer"); and the error that stopped the call, or None. `values` answers reads of input values."""
    recorder = _Recorder({})
    handles = []
    for sub in module.modules():
        if sub is module or not is_layer(sub):
            continue

        def pre(mod, inputs):
            recorder.layer_depth += 1

        def post(mod, inputs, output):
            recorder.layer_depth -= 1
            # As capture records a layer: a call whose first input is a tensor (a position table
            # called with a shape makes its own positions, which capture does not follow).
            if (recorder.layer_depth == 0 and isinstance(output, torch.Tensor) and inputs
                    and isinstance(inputs[0], torch.Tensor)):
                recorder.nodes.append(("layer", (), (recorder.layer_output(output, is_linear_like(mod)),)))

        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    handles += norm_calls(module, recorder, lambda name, mod, x, out: recorder.nodes.append(
        ("layer", (), (recorder.tensor_id(out),))), lambda m: m is module or is_layer(m))
    error = None
    args, kwargs = replay_inputs((args, kwargs))
    try:
        with torch.no_grad(), meta_autocast(), values or contextlib.nullcontext(), recorder, ConsecutiveIndexLists(), \
                attention_calls(module, recorder, _as_layer(recorder)):
            module(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the caller reports where the trace stopped
        error = e
    finally:
        for h in handles:
            h.remove()
    return [(label, [recorder.shapes[i] for i in outputs]) for label, _, outputs in recorder.nodes], error
