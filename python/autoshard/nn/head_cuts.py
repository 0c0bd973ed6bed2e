"""Head cuts: a tensor held whole that a module adds to its sharded attention scores along the
heads axis (an ALiBi bias made from the head count and passed to every attention) is cut to
this rank's heads where the module receives it (``ShardingPlan.head_entries``); a replicated
embedding whose embedding dim is the heads (T5's relative position bias) has its output cut as
it leaves the layer (``ShardingPlan.head_outputs``), its gradient gathered back whole.

Elementwise, the rank holding heads [start, stop) of the scores reads exactly those heads of
the bias, so the cut is exact whatever the bias holds. The heads axis may carry an outer factor
in front of them (Bloom's bias is shaped (batch * heads, 1, keys)): it is viewed as
(outer, units, size // units) and the rank's units are taken with split_sizes, as the
attention's projections split them. The plan cuts only tensors that no gradient reaches;
should one arrive, the cut's backward gathers it whole again.
"""

from typing import List, Tuple

import torch

from ..core import ops, region_generators
from ..core.split import split_sizes
from .sequence import replace_input


def _grouped_shape(shape: List[int], axis: int, size: int, units: int) -> List[int]:
    """The shape viewing axis `axis` (outer x size) as (outer, units, size // units)."""
    return shape[:axis] + [shape[axis] // size, units, size // units] + shape[axis + 1:]


def local_heads_shape(shape, entry, units: int, rank: int, world_size: int) -> Tuple[int, ...]:
    """The shape of the tensor of `entry` (global shape `shape`) once cut on `rank`."""
    shape = list(shape)
    axis, size = entry.axis, entry.size
    shape[axis] = shape[axis] // size * (size // units) * split_sizes(units, world_size)[rank]
    return tuple(shape)


def cut_steps(shape, entry, units: int, rank: int, world_size: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """(op, output shape) of each op the cut runs, as the dry run traces them."""
    local = local_heads_shape(shape, entry, units, rank, world_size)
    if entry.outer == 1 and entry.size == units:
        return [("autoshard.scatter_to_parallel.default", local)]
    grouped = _grouped_shape(list(shape), entry.axis, entry.size, units)
    piece = list(grouped)
    piece[entry.axis + 1] = split_sizes(units, world_size)[rank]
    return [("aten.view.default", tuple(grouped)), ("autoshard.scatter_to_parallel.default", tuple(piece)),
            ("aten.view.default", local)]


class SliceHeads:
    """Cuts a tensor held whole to this rank's heads on the plan's axis, which starts a region
    where a module in `training` draws its own dropout masks (see region_generators)."""

    def __init__(self, entry, units: int, group_name: str):
        self.axis, self.size, self.units = entry.axis, entry.size, units
        self.module = entry.module
        self.group_name = group_name

    def __call__(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        axis = self.axis
        if x.dim() <= axis or x.shape[axis] % self.size:
            raise ValueError(f"head cut: {self.module!r} received a tensor of shape {tuple(x.shape)}, whose axis {axis} "
                             f"should hold {self.size} heads (times a batch factor), as planned")
        if x.shape[axis] == self.size and self.size == self.units:
            piece = ops.scatter_to_parallel(x, axis, self.group_name)
        else:
            shape = list(x.shape)
            piece = ops.scatter_to_parallel(x.reshape(_grouped_shape(shape, axis, self.size, self.units)), axis + 1,
                                            self.group_name).reshape(shape[:axis] + [-1] + shape[axis + 1:])
        return region_generators.enter(piece, self.group_name, training)

    def __repr__(self) -> str:
        return f"SliceHeads(axis={self.axis}, size={self.size}, units={self.units})"


def cut_leaf(args, kwargs, leaf: int, cut, module: str):
    """(args, kwargs) with their flattened input `leaf` replaced by cut(leaf)."""
    return replace_input(args, kwargs, leaf, cut, f"head cut: {module!r} was called without the tensor the plan cuts "
                                                  f"to this rank's heads (input {leaf})")


def entry_hook(entry, units: int, group_name: str):
    """A forward pre-hook cutting the module's input leaf `entry.leaf` to this rank's heads."""
    step = SliceHeads(entry, units, group_name)

    def hook(module, args, kwargs):
        return cut_leaf(args, kwargs, entry.leaf, lambda x: step(x, module.training), entry.module)

    return hook


def output_hook(entry, units: int, group_name: str):
    """A forward hook cutting the module's output to this rank's heads."""
    step = SliceHeads(entry, units, group_name)

    def hook(module, args, output):
        return step(output, module.training)

    return hook
