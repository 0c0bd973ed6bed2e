"""Mixture-of-experts modules holding every expert's weights as two 3-D parameters: recorded as
two Linear-like nodes on the FFN axis (an "in" side, [E, parts * F, H], and an "out" side,
[E, H, F]; or both stored transposed for `x @ w`, [E, H, parts * F] and [E, F, H]), split as a
column side followed by a row side (nn/experts.py), in place. experts_weights finds where such
a module keeps its weights."""

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from ..nn.experts import shard_experts
from ..core.spec import ShardSpec
from ..core.styles import Style
from .base import LayerConstruct, LayerSurgery, register
from .layer_info import LayerInfo


class ExpertsWeights(NamedTuple):
    """Where an experts module keeps its weights (see experts_weights)."""
    first: str  # the in weight's name
    second: str  # the out weight's name
    parts: int  # 2: gated (gate and up in the in weight), 1: plain
    transposed: bool
    # Gate and up interleaved on the FFN axis (gate 0, up 0, gate 1, ...: gpt-oss, transformers'
    # is_concatenated=False) rather than one after the other.
    interleaved: bool = False
    in_bias: Optional[str] = None  # [E, parts * F], added to each expert's in product
    out_bias: Optional[str] = None  # [E, H], added to each expert's output


def experts_weights(module: nn.Module) -> Optional[ExpertsWeights]:
    """Where a module holding mixture-of-experts weights as 3-D parameters keeps them, or None:
    exactly two 3-D parameters, [E, parts * F, H] then [E, H, F] (each expert a gated or plain
    MLP whose input and output have H features), gated ones holding the gate and up projections
    one after the other on the FFN axis (parts = 2), or interleaved where the module says so
    (transformers' `is_concatenated=False`); or, stored transposed for `x @ w` (transformers'
    `is_transposed`, Llama 4's, Aria's and gpt-oss's experts), [E, H, parts * F] then [E, F, H].
    Without the flag the first layout is read where it fits. A module flagged `has_bias` (gpt-oss)
    also holds one bias per side, [E, parts * F] and [E, H], after its weight."""
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    weights = [(name, p) for name, p in params if p.dim() == 3]
    biases = [(name, p) for name, p in params if p.dim() == 2]
    with_bias = bool(getattr(module, "has_bias", False))
    if len(weights) != 2 or len(biases) != (2 if with_bias else 0) or len(params) != len(weights) + len(biases):
        return None
    interleaved = not getattr(module, "is_concatenated", True)
    (first, a), (second, b) = weights
    flagged = getattr(module, "is_transposed", None)
    for transposed in ((False, True) if flagged is None else (bool(flagged),)):
        if transposed:
            experts, hidden, features_in = a.shape
            ffn, out_hidden = b.shape[1], b.shape[2]
        else:
            experts, features_in, hidden = a.shape
            out_hidden, ffn = b.shape[1], b.shape[2]
        if b.shape[0] != experts or out_hidden != hidden or ffn == 0:
            continue
        parts = features_in // ffn if features_in % ffn == 0 else 0
        has_gate = getattr(module, "has_gate", parts == 2)
        if parts != (2 if has_gate else 1) or (interleaved and parts != 2):
            continue
        if not with_bias:
            return ExpertsWeights(first, second, parts, transposed, interleaved)
        (in_bias, c), (out_bias, d) = biases
        if tuple(c.shape) == (experts, features_in) and tuple(d.shape) == (experts, hidden):
            return ExpertsWeights(first, second, parts, transposed, interleaved, in_bias, out_bias)
    return None



@register
class ExpertsConstruct(LayerConstruct):
    kind = "experts"
    order = 50
    last_axis_features = False
    records_inner_nodes = True

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        experts = experts_weights(module)
        if experts is None:
            return None
        index = lambda name: param_index.get(id(getattr(module, name)), -1)
        weight = getattr(module, experts.first)
        info = LayerInfo(name, "experts", transposed=experts.transposed, weight_shape=tuple(weight.shape),
                         parts=experts.parts, experts_params=(index(experts.first), index(experts.second)),
                         interleaved=experts.interleaved, granule=max(1, 16 // weight.element_size()),
                         experts_biases=(index(experts.in_bias), index(experts.out_bias)) if experts.in_bias else ())
        info.weight_param = info.experts_params[0]
        return info

    def weight_reads(self, module: nn.Module, info) -> Optional[Dict[str, object]]:
        where = experts_weights(module)
        out_weight = getattr(module, where.second)
        biases = {id(getattr(module, where.in_bias)): "in", id(getattr(module, where.out_bias)): "out"} \
            if where.in_bias else {}
        out_bias = getattr(module, where.out_bias) if where.out_bias else None
        info.summed_bias = out_bias.numel() if out_bias is not None and out_bias.requires_grad else 0
        return {"tracked": {id(p): p for p in module._parameters.values() if p is not None},
                "out_weight": {id(out_weight): out_weight}, "biases": biases}

    def weight_dim(self, layer) -> Optional[int]:
        # [E, out, in]: the FFN axis is out for the column side, in for the row side; stored
        # transposed, [E, in, out], the other way round.
        if layer.transposed:
            return {Style.COLUMN: 2, Style.ROW: 1}.get(layer.style)
        return {Style.COLUMN: 1, Style.ROW: 2}.get(layer.style)

    def stored_layout(self, info, units: int, parts: List[int]) -> Tuple[int, List[int]]:
        if not units:
            return units, parts
        # A grouped matmul (transformers' default experts implementation) wants every row of its
        # operands on a 16-byte boundary: where the whole FFN axis is (4 features in float32, 8
        # in bfloat16), each rank's slice is kept so too, so the split experts run where the
        # whole ones do (an FFN of 64 in float32 on 3 ranks: 24, 20 and 20, not 22, 21 and 21).
        ffn = info.in_features if info.side == "out" else info.out_features // info.parts
        granule = info.granule if ffn % info.granule == 0 else 1
        units = math.gcd(units, ffn // granule)
        # Gate and up interleaved (gpt-oss): this rank's slice of each part is one run of
        # (gate, up) pairs, so the FFN axis is split in units of pairs, without parts.
        if info.interleaved and len(parts) == 2 and parts[0] == parts[1]:
            return units, []
        return units, parts

    def bias_spec(self, layer, rank: int, world_size: int):
        # The in bias ([E, parts * F]) is split with the column side's FFN axis; the out bias
        # ([E, H]) stays whole (one rank adds it: nn/experts.py).
        if layer.bias is None or not layer.style.is_column:
            return None
        weight = layer.weight_spec(rank, world_size)
        return ShardSpec(1, weight.full_size, rank, world_size, units=weight.units, parts=weight.parts)

    def bias_size(self, layer) -> int:
        # One bias of the side's output features per expert: [E, out] of [E, out, in] (stored
        # transposed: [E, in, out]).
        return layer.weight_shape[0] * layer.weight_shape[2 if layer.transposed else 1]

    def replaces(self, module: nn.Module) -> bool:
        return False

    def weight_of(self, module: nn.Module, layer):
        return getattr(module, layer.weight.rpartition(".")[2], None)  # this side's 3-D weight

    def shard_module(self, layers, surgery: LayerSurgery) -> None:
        # Two entries, its column side and its row side (column, then row), or both replicated.
        name, group = layers[0].module, surgery.group
        module = surgery.model.get_submodule(name)
        styles = tuple(layer.style for layer in layers)
        if styles == (Style.REPLICATE, Style.REPLICATE):
            return
        if styles != (Style.COLUMN, Style.ROW) or any(layer.sequence for layer in layers):
            raise ValueError(f"parallelize: experts module {name!r} is planned as {styles}"
                             f"{' with sequence parallelism' if any(l.sequence for l in layers) else ''}; its 3-D "
                             "weights can only be split as a column side followed by a row side, or replicated")
        column, row = layers
        rank, world = group.rank(), group.size()
        local = lambda name: name.rpartition(".")[2] if name else None
        shard_experts(module, local(column.weight), column.weight_spec(rank, world),
                      local(row.weight), row.weight_spec(rank, world), group, surgery.shared_copies.get(column.copy_group),
                      in_bias=local(column.bias), in_bias_spec=column.bias_spec(rank, world), out_bias=local(row.bias))
