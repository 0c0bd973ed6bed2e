"""Einsum layers (nn/einsum.py's EinsumDense): split on one weight letter, an output letter as
a column layer, a contracted one as a row layer (ShardedEinsumDense)."""

from typing import Dict, List, Optional

from torch import nn

from ..core import ops
from ..nn.einsum import EinsumDense, ShardedEinsumDense
from ..core.styles import Style
from .base import LayerConstruct, register
from .layer_info import LayerInfo


@register
class EinsumConstruct(LayerConstruct):
    kind = "einsum"
    planner_kind = "einsum"
    order = 30
    bias_has_spec = False

    def bias_split_by_letter(self, layer) -> bool:
        return layer.style.is_split and layer.bias is not None and layer.letter in layer.bias_axes

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        if not isinstance(module, EinsumDense):
            return None
        index = lambda p: param_index.get(id(p), -1) if p is not None else -1
        return LayerInfo(name, "einsum", weight_param=index(module.weight), bias_param=index(module.bias),
                         equation=module.equation, weight_shape=tuple(module.weight.shape),
                         bias_axes=module.bias_axes or "")

    def planner_fields(self, info, inputs, output):
        # ShardedEinsumDense splits an output or a contracted letter: its batch letters are left
        # out, so that an input split on one stops at the layer.
        letters = [letter for letter in einsum_letters(info.equation, inputs.dim(), output.dim())
                   if letter["role"] != "batch"]
        return {"weight_param": info.weight_param, "bias_param": info.bias_param, "letters": letters}

    def weight_dim(self, layer) -> Optional[int]:
        return ops.einsum_weight_axes(layer.equation)[0].index(layer.letter) if layer.style.is_split else None

    def bias_spec(self, layer, rank: int, world_size: int):
        return None  # laid out by its bias_axes: ShardedEinsumDense records it

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        split = layer.weight_shape[self.weight_dim(layer)]
        if layer.units != split:
            raise ValueError(f"parallelize: einsum layer {layer.module!r} would be split in {layer.units} units, "
                             f"but ShardedEinsumDense splits letter {layer.letter!r} element by element ({split})")
        return ShardedEinsumDense.from_einsum_dense(module, layer.letter, group,
                                                    gather_output=layer.style is Style.COLUMN_GATHER)


def einsum_letters(equation: str, input_ndim: int, output_ndim: int) -> List[Dict[str, object]]:
    """The planner's description of an einsum layer's weight letters, from the C++ equation
    parser: per weight letter, its role ("output", "contracted" or "batch") and its dims in the
    input and the output (from the start; -1 where absent)."""
    letters, roles, input_dims, output_dims = ops.einsum_weight_axes(equation)
    return [{"letter": letter, "role": role,
             "input_dim": -1 if in_dim is None else in_dim % input_ndim,
             "output_dim": -1 if out_dim is None else out_dim % output_ndim}
            for letter, role, in_dim, out_dim in zip(letters, roles, input_dims, output_dims)]
