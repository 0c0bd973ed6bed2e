"""Each ATen op outside a layer's call reduced to the few node kinds that matter for following a
sharded axis (view, permute, reduce, split, cat, slice, matmul, pointwise, ...). The planner
never sees ATen: what it must know of an op is which axes pass it unchanged, which it reduces or
reorders, and which it changes, and that is decided here, op by op, from its arguments."""

from typing import Any, Dict, List

import torch
from torch.utils._pytree import tree_flatten

from .graph_records import GraphRecords
from .op_classes import (
    ATTENTION_PREFIX,
    COPIES,
    NORMS,
    PERMUTES,
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


class OpRecording(GraphRecords):
    """The node (or nodes) recorded for one ATen op, by record."""

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
        self.layer_node(info, x, flat_out[0], functional=True, functional_bias=bias is not None)
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
        axes = sorted(set(axes))
        source = self.changed(label, axes[:-1], source, out.shape)
        self.node("slice", label, [source], [self.tensor_id(out)], {"dim": axes[-1], "start": 0, "stop": 0,
                                                                      "drop_dim": False})

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
