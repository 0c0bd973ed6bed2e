"""Mixture-of-experts modules holding every expert's weights as two 3-D parameters: recorded as
two Linear-like nodes on the FFN axis (an "in" side, [E, parts * F, H], and an "out" side,
[E, H, F]; or both stored transposed for `x @ w`, [E, H, parts * F] and [E, F, H]), split as a
column side followed by a row side (nn/experts.py), in place."""

from typing import Dict, Optional

from torch import nn

from ..nn.experts import shard_experts
from ..styles import Style
from .base import LayerConstruct, register


@register
class ExpertsConstruct(LayerConstruct):
    kind = "experts"
    order = 50
    last_axis_features = False

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        from ..plan.layers import LayerInfo, experts_weights

        experts = experts_weights(module)
        if experts is None:
            return None
        first, second, parts, transposed = experts
        index = lambda p: param_index.get(id(p), -1)
        info = LayerInfo(name, "experts", transposed=transposed, weight_shape=tuple(getattr(module, first).shape),
                         parts=parts, experts_params=(index(getattr(module, first)), index(getattr(module, second))))
        info.weight_param = info.experts_params[0]
        return info

    def weight_dim(self, layer) -> Optional[int]:
        # [E, out, in]: the FFN axis is out for the column side, in for the row side; stored
        # transposed, [E, in, out], the other way round.
        if layer.transposed:
            return {Style.COLUMN: 2, Style.ROW: 1}.get(layer.style)
        return {Style.COLUMN: 1, Style.ROW: 2}.get(layer.style)

    def bias_spec(self, layer, rank: int, world_size: int):
        return None

    def replaces(self, module: nn.Module) -> bool:
        return False

    def weight_of(self, module: nn.Module, layer):
        return getattr(module, layer.weight.rpartition(".")[2], None)  # this side's 3-D weight

    def shard_sides(self, module: nn.Module, name: str, sides, group, input_copy) -> None:
        """Splits the experts module `module` by its two planned sides (column, then row), or
        leaves it whole where both are replicated."""
        styles = tuple(layer.style for layer in sides)
        if styles == (Style.REPLICATE, Style.REPLICATE):
            return
        if styles != (Style.COLUMN, Style.ROW) or any(layer.sequence for layer in sides):
            raise ValueError(f"parallelize: experts module {name!r} is planned as {styles}"
                             f"{' with sequence parallelism' if any(l.sequence for l in sides) else ''}; its 3-D "
                             "weights can only be split as a column side followed by a row side, or replicated")
        column, row = sides
        rank, world = group.rank(), group.size()
        shard_experts(module, column.weight.rpartition(".")[2], column.weight_spec(rank, world),
                      row.weight.rpartition(".")[2], row.weight_spec(rank, world), group, input_copy)
