"""The dispatch-mode recorder that turns a meta forward into the planner's graph: each ATen
op reduced to the few kinds that matter for following a sharded axis, layers as single nodes."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..nn.gathered_parameters import gathering
from ..constructs.layer_info import LayerInfo
from .op_classes import (
    ATTENTION_PREFIX,
    COPIES,
    EXPERT_WEIGHT_PRODUCTS,
    EXPERT_WEIGHT_VIEWS,
    KEEP_VALUES,
    LINEAR_IN_PARTIAL_SUMS,
    SUMS_OF_TERMS,
    ZERO_MAKERS,
    NORMS,
    PERMUTES,
    PRODUCTS_OF_TWO,
    REDUCE_DIMS,
    SOFTMAX,
    SPLITS,
    VIEWS,
)

aten = torch.ops.aten


def _narrows(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a cast rounds floating-point values to a narrower dtype."""
    return x.is_floating_point() and out.is_floating_point() and out.element_size() < x.element_size()


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _depthwise(args) -> bool:
    """aten.convolution's args describe a depthwise convolution: groups equal to the input's
    channels and the weight's, one input channel per group, not transposed."""
    if len(args) < 9:
        return False
    x, weight, groups, transposed = args[0], args[1], args[8], args[6]
    return (not transposed and x.dim() >= 3 and weight.dim() == x.dim() and weight.shape[1] == 1
            and groups == x.shape[1] == weight.shape[0])


@dataclass
class ExpertReads:
    """What an experts module's call has read so far (see Recorder.follow_expert_weights)."""
    tracked: Dict[int, torch.Tensor]  # its weights and the views taken of them
    out_weight: Dict[int, torch.Tensor]  # the out weight and its views
    partial: Dict[int, torch.Tensor] = field(default_factory=dict)  # what follows linearly from out products
    # Each bias and its views, by side ("in" or "out"): gpt-oss's per-expert biases.
    biases: Dict[int, str] = field(default_factory=dict)
    refusals: List[str] = field(default_factory=list)
    zeros: Dict[int, torch.Tensor] = field(default_factory=dict)  # tensors of zeros made in the call


class Recorder(TorchDispatchMode):
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
        # The model's own grad mode at each op (model_grad_mode.py), where the trace follows it.
        self.grad_mode = None
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
        # Within the call of an embedding whose forward takes no index tensor (a learned position
        # table given the input's shape, making its positions itself): the id of its weight, and
        # the indices it looks up, the input of its node.
        self.lookup_weight: Optional[int] = None
        self.lookup_indices: Optional[torch.Tensor] = None
        # Linear layers by their weight's id, whose weight the model may multiply itself (Mamba's
        # `self.dt_proj.weight @ x`; None in a trace, which records such a product as a "layer"
        # node as it records a layer's call); the capture's layer of each recorded node; and
        # the transposes of such a weight not yet read by anything but that product (see
        # record_weight_product), recorded only once something else reads them.
        self.linear_weights: Dict[int, Optional[LayerInfo]] = {}
        self.layers: Dict[int, LayerInfo] = {}
        self.weight_transposes: Dict[int, tuple] = {}

    def layer_output(self, t: torch.Tensor, linear: bool = True) -> int:
        """t's id, remembered as a Linear-like layer's output where `linear` (not an embedding's)."""
        index = self.tensor_id(t)
        if linear:
            self.layer_outputs.add(index)
        return index

    def tensor_id(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self.ids and key in self.weight_transposes:
            func, weight, label, _ = self.weight_transposes.pop(key)
            self.node("permute", label, [self.tensor_id(weight)], [self.tensor_id(t)], {"permutation": [1, 0]})
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
        if self.grad_mode is not None and not self.grad_mode.enabled:
            fields["no_grad"] = True
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
        fields = {"routing_floating": [t.is_floating_point() for t in routing]}
        if info.summed_bias:
            # One rank adds the out bias to its partial outputs: its gradient, there alone, is summed.
            fields["summed_bias"] = info.summed_bias
        self.node("opaque", info.name + ".combine", [down] + [self.tensor_id(t) for t in routing],
                  [self.tensor_id(output)], fields, "call")

    def document(self, outputs: Sequence[int] = ()) -> Dict[str, Any]:
        """The planner's graph document, version 1 (csrc/plan/graph.h)."""
        tensors = [dict(t) for t in self.tensors]
        for t in outputs:
            tensors[t]["output"] = True
        return {"version": 1, "tensors": tensors, "nodes": _mark_partitions(self.node_records, tensors)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if gathering():
            pass  # a parameter gathered whole for a call: the plan traced it whole (nn/gathered_parameters.py)
        elif self.layer_depth == 0:
            self.record(func, args, kwargs, out)
        elif self.lookup_weight is not None and func is torch.ops.aten.embedding.default \
                and id(args[0]) == self.lookup_weight:
            self.lookup_indices = args[1]
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
            sides = {reads.biases[id(t)] for t in read if id(t) in reads.biases}
            if packet in EXPERT_WEIGHT_VIEWS:
                for o in outs:
                    reads.tracked[id(o)] = o
                    if of_out_weight:
                        reads.out_weight[id(o)] = o
                    if sides:
                        reads.biases[id(o)] = next(iter(sides))
            elif sides:
                self.follow_expert_bias(func, flat, read, sides, outs)
            elif packet not in EXPERT_WEIGHT_PRODUCTS:
                reads.refusals.append(str(func))
            elif of_out_weight:
                reads.partial.update((id(o), o) for o in outs)
            return
        if packet in ZERO_MAKERS or (packet in KEEP_VALUES and flat and all(id(t) in reads.zeros for t in flat)):
            reads.zeros.update((id(o), o) for o in outs)
        partial = [t for t in flat if id(t) in reads.partial]
        if not partial:
            return
        if packet not in LINEAR_IN_PARTIAL_SUMS or (packet in PRODUCTS_OF_TWO and len(partial) > 1):
            reads.refusals.append(f"{func} of an expert's output before the experts' outputs are summed")
            return
        if packet in SUMS_OF_TERMS and any(t.is_floating_point() and id(t) not in reads.partial
                                           and id(t) not in reads.zeros for t in flat):
            reads.refusals.append(f"{func} sums an expert's output with a term that is not one")
            return
        if packet is aten.masked_fill and len(args) > 2 and id(args[0]) in reads.partial:
            value = args[2]
            whole = id(value) not in reads.partial and id(value) not in reads.zeros if isinstance(value, torch.Tensor) \
                else value != 0
            if whole:
                reads.refusals.append(f"{func} fills an expert's output with a value every rank would add")
                return
        reads.partial.update((id(o), o) for o in outs)

    def follow_expert_bias(self, func, flat, read, sides, outs) -> None:
        """A bias of an experts module (one per expert and side) may only be added to the products
        of its side: the in bias to the in products, which split experts hold the FFN slice of
        (split with them); the out bias to the out products, whose sum over the ranks it must
        enter once (one rank adds it: see nn/experts.py), so the sum is again a partial one."""
        reads = self.experts_reads
        packet = func.overloadpacket
        first_of_product = packet in (aten.addmm, aten.baddbmm) and flat and id(flat[0]) in reads.biases
        added = packet in (aten.add, aten.add_) and len(read) == 1 and len(flat) == 2
        if len(sides) != 1 or not (added or first_of_product) or (first_of_product and len(read) != 2):
            reads.refusals.append(f"{func} of an expert bias other than its addition to a product")
            return
        others = [t for t in flat if id(t) not in reads.tracked]
        of_partial = any(id(t) in reads.partial for t in others)
        out_side = sides == {"out"}
        if first_of_product:
            of_partial = any(id(t) in reads.out_weight for t in read)
        if out_side != of_partial:
            reads.refusals.append(f"{func} adds an expert bias to another side's products")
            return
        if out_side:
            reads.partial.update((id(o), o) for o in outs)

    def record(self, func, args, kwargs, out) -> None:
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        flat_out = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not flat_out:
            return
        packet = func.overloadpacket
        label = str(func).replace(" ", "")
        if self.record_weight_product(func, args, flat_out, label):
            return
        inputs = [self.tensor_id(t) for t in flat_in]
        if not inputs:
            self.node("source", label, [], [self.tensor_id(o) for o in flat_out])
            return
        x = flat_in[0]
        if packet in VIEWS and len(flat_in) == 1:
            self.node("view", label, inputs, [self.tensor_id(flat_out[0])])
        elif packet in PERMUTES:
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
        elif packet is aten.convolution and _depthwise(args):
            self.record_depthwise_convolution(label, args, inputs, flat_out[0])
        elif packet is aten.linalg_solve_triangular:
            self.record_triangular_solve(label, kwargs, inputs, flat_out[0])
        elif packet in (aten.tril, aten.triu) and x.dim() >= 2:
            # Which elements it keeps depends on their row and column: only the batch axes
            # before the matrix may be split through it.
            self.record_axes_changed(label, [x.dim() - 2, x.dim() - 1], inputs[0], flat_out[0])
        elif packet.__name__.startswith(ATTENTION_PREFIX):
            self.node("attention", label, inputs, [self.tensor_id(o) for o in flat_out])
        elif packet in SOFTMAX:
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": [_normalize_dim(args[1], x.dim())]})
        elif packet in REDUCE_DIMS:
            # A norm's order comes before its dims (DoRA's weight norm: aten.norm(w, 2.0, [1])).
            dim_args = (args[0],) + tuple(args[2:]) if packet in (aten.norm, aten.linalg_vector_norm) else args
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": self.reduced_dims(dim_args, kwargs, x)})
        elif packet in NORMS or packet.__name__.endswith("rms_norm"):
            normalized = len(args[1]) if isinstance(args[1], (list, tuple)) else 1
            self.node("reduce", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"axes": list(range(x.dim() - normalized, x.dim()))})
        elif packet in SPLITS:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            self.node("split", label, inputs[:1], [self.tensor_id(o) for o in flat_out], {"dim": _normalize_dim(dim, x.dim())})
        elif packet is aten.unbind:
            # A split into pieces of one along dim, each without that axis.
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            self.node("split", label, inputs[:1], [self.tensor_id(o) for o in flat_out],
                      {"dim": _normalize_dim(dim, x.dim()), "drop_dim": True})
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
        elif packet is aten.constant_pad_nd:
            pad = [int(p) for p in args[1]]
            axes = [x.dim() - 1 - i // 2 for i in range(0, len(pad), 2) if pad[i] or pad[i + 1]]
            self.record_axes_changed(label, axes, inputs[0], flat_out[0])
        elif packet is aten.new_empty and flat_out[0].dim() == x.dim():
            # A tensor shaped like x but on some axes, filled by copies into slices of it (MLA's
            # key_states = kv.new_empty(*kv.shape[:-1], d); key_states[..., :n].copy_(k_nope)):
            # x's layout on the axes it keeps, each copy then checked against it.
            axes = [d for d in range(x.dim()) if flat_out[0].shape[d] != x.shape[d]]
            self.record_axes_changed(label, axes, inputs[0], flat_out[0])
        elif packet in (aten.slice, aten.narrow, aten.select):
            self.node("slice", label, inputs[:1], [self.tensor_id(flat_out[0])], self.slice_fields(packet, x, args))
        elif packet in COPIES or torch.Tag.pointwise in func.tags:
            # The planner keeps narrowing casts of parameters out of sequence regions.
            narrowing = packet in (aten._to_copy, aten.to) and _narrows(x, flat_out[0])
            self.node("pointwise", label, inputs, [self.tensor_id(o) for o in flat_out],
                      {"narrowing": True} if narrowing else None)
        else:
            self.node("opaque", label, inputs, [self.tensor_id(o) for o in flat_out])

    def record_weight_product(self, func, args, flat_out, label) -> bool:
        """A Linear layer's weight multiplied by the model itself, outside the layer's call
        (`self.dt_proj.weight @ x`, `F.linear(x, layer.weight, layer.bias)`): ATen sees the
        weight transposed, then `mm(x, w.t())` (`addmm(layer.bias, x, w.t())`). The transpose is
        held back, and the product recorded as a call of the layer marked `functional`: the
        planner may split it as a column layer only, whose local rows the model's own product
        then reads, and knows that no input copy sums its input's gradient. Whether handled."""
        packet = func.overloadpacket
        if packet in (aten.t, aten.transpose) and id(args[0]) in self.linear_weights and args[0].dim() == 2:
            # The transpose itself is kept alive, so that its id stays its own.
            self.weight_transposes[id(flat_out[0])] = (func, args[0], label, flat_out[0])
            return True
        if packet not in (aten.mm, aten.addmm):
            return False
        x, transposed = (args[0], args[1]) if packet is aten.mm else (args[1], args[2])
        held = self.weight_transposes.get(id(transposed))
        if held is None or id(x) in self.weight_transposes:
            return False
        info = self.linear_weights[id(held[1])]
        bias = args[0] if packet is aten.addmm else None
        if info is None:
            self.nodes.append(("layer", (), (self.layer_output(flat_out[0]),)))
            return True
        if bias is not None and (info.bias_param < 0 or self.param_index.get(id(bias)) != info.bias_param):
            return False  # another bias (a concatenation of several): the product is followed as it is
        fields = {**info.planner_fields(x, flat_out[0]), "functional": True, "functional_bias": bias is not None}
        node = self.node("linear", info.name, [self.tensor_id(x)], [self.layer_output(flat_out[0])], fields)
        self.layers[node] = info.record_call(x, flat_out[0])
        return True

    def record_depthwise_convolution(self, label, args, inputs, out) -> None:
        """A depthwise convolution called functionally (F.conv1d(x, layer.weight, groups=C), as
        Mamba's and gated-delta-net mixers do) pairs channel c of its input with channel c of
        its weight alone: its taps summed per channel, multiplied into the input channel by
        channel. Every output position reads several input positions, so each axis after the
        channels is recorded as changed (a split token axis meets a conflict); the channels
        pass, and the weight (and bias) may be split with them like any per-channel parameter."""
        x, weight, bias = args[0], args[1], args[2]
        spatial = list(range(2, x.dim()))
        source = self.changed(label, spatial, inputs[0], out.shape)
        channels = weight.shape[0]
        taps = self.declare([channels])
        self.node("reduce", label, [inputs[1]], [taps], {"axes": list(range(1, weight.dim()))})
        operands = [source, self.declare([channels] + [1] * len(spatial))]
        self.node("view", label, [taps], [operands[1]])
        if bias is not None:
            operands.append(self.declare([channels] + [1] * len(spatial)))
            self.node("view", label, [inputs[2]], [operands[2]])
        self.node("pointwise", label, operands, [self.tensor_id(out)])

    def record_triangular_solve(self, label, kwargs, inputs, out) -> None:
        """solve_triangular(A, B) is A's inverse times B (or B times it, left=False), batch by
        batch: recorded as that product with A's two matrix axes changed, so that only batch
        axes (heads) and B's free axis pass it split; a row of the solution reads every row of A."""
        shape = self.shapes[inputs[0]]
        a, b = self.changed(label, [len(shape) - 2, len(shape) - 1], inputs[0], shape), inputs[1]
        operands = [a, b] if kwargs.get("left", True) else [b, a]
        self.node("matmul", label, operands, [self.tensor_id(out)])

    def changed(self, label, axes, source, shape) -> int:
        """`source` with each of `axes` recorded as changed to `shape`'s length, one slice per
        axis (a split axis among them meets a conflict, as record_axes_changed's do); the id of
        the result."""
        current = list(self.shapes[source])
        for dim in axes:
            current[dim] = int(shape[dim])
            after = self.declare(list(current))
            self.node("slice", label, [source], [after], {"dim": dim, "start": 0, "stop": 0, "drop_dim": False})
            source = after
        return source

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

    def record_axes_changed(self, label, axes, source, out) -> None:
        """An op whose output is its input with `axes` lengthened, shortened or shifted (F.pad,
        new_empty of another size), as one slice per such axis that does not keep it whole: a
        split axis among them stays a conflict, and one left alone passes (LongT5 pads its
        tokens into blocks, beside heads split on another axis)."""
        if not axes:
            self.node("view", label, [source], [self.tensor_id(out)])
            return
        shape = list(self.shapes[source])
        axes = sorted(set(axes))
        for step, dim in enumerate(axes):
            shape[dim] = out.shape[dim]
            after = self.tensor_id(out) if step == len(axes) - 1 else self.declare(shape)
            self.node("slice", label, [source], [after], {"dim": dim, "start": 0, "stop": 0, "drop_dim": False})
            source = after

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
