"""Grouped and depthwise convolutions (nn.Conv1d/2d/3d with groups > 1) split over their groups.

A convolution with G groups computes each run of out_channels / G output channels from its own
run of in_channels / G input channels only; a depthwise convolution is G = in_channels. So when
its input arrives split over the channels by whole groups (a column layer's output, its pieces
aligned to the groups), each rank convolves its own groups and its output is split over the
channels in the same way: no collective, in forward or in backward. The planner reads it as an
einsum layer with one batch letter, the groups, shared by the input's and the output's channel
axes and by the weight's first axis ([out, in / groups, *kernel]), and an extent (`size`) of
G: the region's units then divide G, so an uneven split (as numpy's array_split) still holds
whole groups. A grouped convolution whose input arrives whole stays whole: split alone, each
rank would need its groups' input channels cut from the whole input and its output gathered
back, more traffic than the few multiply-adds per element it computes.

The sharded convolution is the model's own module, changed in place: its weight and bias hold
this rank's groups, and its `groups`, `in_channels` and `out_channels` are its local counts, so
its own forward (padding modes included) computes exactly this rank's channels.
"""

from typing import Dict, Optional

import torch
from torch import nn

from ..core.distributed import resolve
from ..core.spec import ShardSpec
from ..core.styles import Style
from .base import register
from .conv import ConvolutionConstruct

_GROUPED = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def grouped_convolution(module: nn.Module) -> bool:
    """A torch convolution (not transposed) with several groups, computing its class's own
    forward, with its weights set."""
    return (isinstance(module, _GROUPED) and type(module).forward in {c.forward for c in _GROUPED}
            and module.groups > 1 and not isinstance(module.weight, nn.parameter.UninitializedParameter))


def _local_counts(module: nn.Module, local_out: int) -> Dict[str, int]:
    """The groups and channels of `local_out` output channels of `module`, whole groups."""
    per_group = module.out_channels // module.groups
    if local_out % per_group:
        raise ValueError(f"grouped convolution: {local_out} output channels are not whole groups of {per_group}")
    groups = local_out // per_group
    return {"groups": groups, "in_channels": groups * (module.in_channels // module.groups), "out_channels": local_out}


def shard_grouped_conv(module: nn.Module, weight_spec: ShardSpec, bias_spec: Optional[ShardSpec]) -> nn.Module:
    """`module` changed in place to hold the groups `weight_spec` gives this rank; returns it."""
    if not grouped_convolution(module):
        raise TypeError(f"shard_grouped_conv: module must be a torch.nn Conv{{1,2,3}}d with groups > 1 and its own "
                        f"forward, got {type(module).__name__}")
    counts = _local_counts(module, weight_spec.local_size())
    module.weight = nn.Parameter(weight_spec.take_owned(module.weight), requires_grad=module.weight.requires_grad)
    module.shard_specs = {"weight": weight_spec}
    if module.bias is not None:
        module.bias = nn.Parameter(bias_spec.take_owned(module.bias), requires_grad=module.bias.requires_grad)
        module.shard_specs["bias"] = bias_spec
    for attr, value in counts.items():
        setattr(module, attr, value)
    return module


@register
class GroupedConvConstruct(ConvolutionConstruct):
    kind = "grouped_conv"
    order = 61

    accepts = staticmethod(grouped_convolution)

    def planner_fields(self, info, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        axis = self.channel_axis(info, inputs)
        return {"weight_param": info.weight_param, "bias_param": info.bias_param,
                "letters": [{"letter": "g", "role": "batch", "input_dim": axis, "output_dim": axis,
                             "size": info.groups}]}

    def weight_dim(self, layer) -> Optional[int]:
        return 0 if layer.style is Style.BATCH else None  # [out, in / groups, *kernel]: groups lead

    def bias_spec(self, layer, rank: int, world_size: int) -> Optional[ShardSpec]:
        if layer.bias is None or layer.style is not Style.BATCH:
            return None
        return ShardSpec(0, layer.weight_shape[0], rank, world_size, units=layer.units or None)

    def bias_size(self, layer) -> int:
        return layer.weight_shape[0]

    def replaces(self, module: nn.Module) -> bool:
        return False  # the model's own convolution, holding this rank's groups

    def stand_in(self, layer, module: nn.Module, rank: int, world_size: int) -> Optional[nn.Module]:
        spec = layer.weight_spec(rank, world_size)
        local = self.meta_copy(module, spec, with_bias=True)
        for attr, value in _local_counts(module, spec.local_size()).items():
            setattr(local, attr, value)
        return local

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        if layer.style is not Style.BATCH:
            raise ValueError(f"parallelize: grouped convolution {layer.module!r} is planned {layer.style}; it is "
                             "split only over its groups (style batch), with its input")
        group = resolve(group, "parallelize")
        rank, world = group.rank(), group.size()
        sharded = shard_grouped_conv(module, layer.weight_spec(rank, world), self.bias_spec(layer, rank, world))
        sharded.group = group
        return sharded
