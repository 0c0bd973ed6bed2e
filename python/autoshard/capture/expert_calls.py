"""An experts module's call as the planner reads it, and the checks that keep splitting its
experts exact. The planner sees an experts module as one gated MLP whose FFN axis it may split;
that is only the module's own computation if its weights are used as a sharded MLP uses them,
so every op inside the call that reads a weight, a bias or a partial sum of the experts' outputs
is followed here, and anything else keeps the module whole."""

from dataclasses import dataclass, field
from typing import Dict, List

import torch
from torch.utils._pytree import tree_flatten

from ..constructs.layer_info import LayerInfo
from .graph_records import GraphRecords
from .op_classes import (
    EXPERT_WEIGHT_PRODUCTS,
    EXPERT_WEIGHT_VIEWS,
    KEEP_VALUES,
    LINEAR_IN_PARTIAL_SUMS,
    SUMS_OF_TERMS,
    ZERO_MAKERS,
    PRODUCTS_OF_TWO,
)

aten = torch.ops.aten


@dataclass
class ExpertReads:
    """What an experts module's call has read so far (see ExpertCalls.follow_expert_weights)."""
    tracked: Dict[int, torch.Tensor]  # its weights and the views taken of them
    out_weight: Dict[int, torch.Tensor]  # the out weight and its views
    partial: Dict[int, torch.Tensor] = field(default_factory=dict)  # what follows linearly from out products
    # Each bias and its views, by side ("in" or "out"): gpt-oss's per-expert biases.
    biases: Dict[int, str] = field(default_factory=dict)
    refusals: List[str] = field(default_factory=list)
    zeros: Dict[int, torch.Tensor] = field(default_factory=dict)  # tensors of zeros made in the call


class ExpertCalls(GraphRecords):
    """The nodes of an experts module's call, and what may be done inside it."""

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
