"""Convolutions (nn.Conv1d/2d/3d and nn.ConvTranspose1d/2d/3d) split over channels.

A convolution is linear in its input's channels: each output channel sums, over the input
channels, that channel correlated with one kernel. So it pairs as a Linear does. A column
convolution holds this rank's output channels (its input is copied, and backward all-reduces
the input's gradient). A row convolution holds this rank's input channels (each rank convolves
its channels, the partial outputs are all-reduced, then the bias is added once). Stride,
padding (of any mode), dilation and a transposed convolution's output size act within each
channel, so they are the same on every rank.

The planner reads a convolution as an einsum layer with two weight letters: the output
channels ("o", on the output's channel axis) and the input channels ("i", contracted from the
input's channel axis). Grouped and depthwise convolutions read their input channels group by
group: they are split over their groups, with their input (constructs/grouped_conv.py).
"""

import copy
from collections import OrderedDict
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import ops, region_generators
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec
from ..core.styles import Style
from .base import LayerConstruct, register
from .linear import LinearConstruct
from .layer_info import LayerInfo

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _plain_convolution(module: nn.Module) -> bool:
    """A torch convolution computing its class's own forward, ungrouped, with its weights set."""
    return (isinstance(module, _CONVOLUTIONS) and type(module).forward in {c.forward for c in _CONVOLUTIONS}
            and module.groups == 1 and not isinstance(module.weight, nn.parameter.UninitializedParameter))


class ShardedConv(nn.Module):
    """A convolution's share on this rank: its output channels (`style` column, the output
    gathered whole with `gather_output`) or its input channels (row). The weight keeps the
    source layout ([out, in, *kernel]; a transposed convolution's [in, out, *kernel]), so a
    checkpoint slice and `shard_specs` describe it as it is stored."""

    def __init__(self, conv: nn.Module, style: Style, group=None, units: Optional[int] = None):
        super().__init__()
        if not _plain_convolution(conv):
            raise TypeError(f"ShardedConv: conv must be an ungrouped torch.nn Conv{{1,2,3}}d or ConvTranspose"
                            f"{{1,2,3}}d with its own forward, got {type(conv).__name__}")
        self.style = Style(style)
        if not self.style.is_split or self.style is Style.VOCAB:
            raise ValueError(f"ShardedConv: style must be column, column_gather or row, got {self.style}")
        self.group = resolve(group, "ShardedConv")
        self._group_name = self.group.group_name
        self._rank, self._world = self.group.rank(), self.group.size()
        self.transposed = bool(conv.transposed)
        self.spatial = len(conv.kernel_size)
        # The source's own attributes, global as a ColumnParallelLinear's in/out features are:
        # a model may read them (Whisper checks its input's length against its strides).
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        for attr in ("kernel_size", "stride", "padding", "dilation", "groups", "padding_mode", "output_padding"):
            setattr(self, attr, getattr(conv, attr))
        column = self.style.is_column
        dim = (1 if self.transposed else 0) if column else (0 if self.transposed else 1)
        full = conv.weight.shape[dim]
        units = None if units in (None, full) else units
        spec = ShardSpec(dim, full, self._rank, self._world, units=units)
        if (units or full) < self._world:
            raise ValueError(f"ShardedConv: cannot split {full} {'output' if column else 'input'} channels over "
                             f"{self._world} ranks: every rank needs at least one")
        self.shard_specs = {"weight": spec}
        self.weight = nn.Parameter(spec.take_owned(conv.weight), requires_grad=conv.weight.requires_grad)
        if conv.bias is None:
            self.register_parameter("bias", None)
        elif column:
            self.shard_specs["bias"] = ShardSpec(0, full, self._rank, self._world, units=units)
            self.bias = nn.Parameter(self.shard_specs["bias"].take_owned(conv.bias), requires_grad=conv.bias.requires_grad)
        else:  # added once, after the partial outputs are summed
            self.bias = nn.Parameter(conv.bias.detach().clone(), requires_grad=conv.bias.requires_grad)
        # The source's stride, padding and the rest, without its parameters or hooks: its own
        # convolution is called with this rank's weight.
        template = copy.copy(conv)
        template._parameters = OrderedDict(weight=None, bias=None)
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            setattr(template, hooks, OrderedDict())
        self.__dict__["_template"] = template  # not a submodule: no parameters, no state
        # Column convolutions reading the same tensor may share one input copy (see parallelize).
        self.input_copy = None
        attach_layer_state(self)

    def _convolve(self, x: torch.Tensor, bias: Optional[torch.Tensor], output_size=None) -> torch.Tensor:
        t = self._template
        if not self.transposed:
            return type(t)._conv_forward(t, x, self.weight, bias)
        padding = t._output_padding(x, output_size, t.stride, t.padding, t.kernel_size, self.spatial, t.dilation)
        return _TRANSPOSED[self.spatial](x, self.weight, bias, t.stride, t.padding, padding, t.groups, t.dilation)

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() not in (self.spatial + 1, self.spatial + 2):
            raise ValueError(f"ShardedConv: input must be a tensor of {self.spatial + 1} or {self.spatial + 2} "
                             f"dimensions, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        axis = x.dim() - self.spatial - 1
        if self.style.is_column:
            x = self.input_copy(x) if self.input_copy is not None else ops.copy_to_parallel(x, self._group_name)
            region_generators.enter(x, self._group_name, self.training)
            y = self._convolve(x, self.bias, output_size)
            if self.style is Style.COLUMN_GATHER:
                y = region_generators.leave(ops.gather_from_parallel(y, axis, self.out_channels, self._group_name))
            return y
        y = region_generators.leave(ops.reduce_from_parallel(self._convolve(x, None, output_size), self._group_name))
        if self.bias is None:
            return y
        return y + self.bias.view(-1, *([1] * self.spatial))

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        kind = f"ConvTranspose{self.spatial}d" if self.transposed else f"Conv{self.spatial}d"
        return (f"{kind}({self.in_channels}, {self.out_channels}), style={self.style}, "
                f"local_{'out' if self.style.is_column else 'in'}_channels={spec.local_size()} "
                f"(rank {self._rank} of {self._world})")


class ConvolutionConstruct(LayerConstruct):
    """What the convolution constructs share: recognition by `accepts` (a function of the module,
    which each defines), the channel axis the planner reads, and a meta stand-in holding this
    rank's weight (and bias)."""

    planner_kind = "einsum"
    last_axis_features = False

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        if not self.accepts(module):
            return None
        index = lambda p: param_index.get(id(p), -1) if p is not None else -1
        return LayerInfo(name, self.kind, module.in_channels, module.out_channels, bool(module.transposed),
                         index(module.weight), index(module.bias), weight_shape=tuple(module.weight.shape),
                         groups=module.groups)

    @staticmethod
    def channel_axis(info, inputs: torch.Tensor) -> int:
        """The input's channel axis: the one before the spatial axes."""
        return inputs.dim() - (len(info.weight_shape) - 2) - 1

    @staticmethod
    def meta_copy(module: nn.Module, spec: ShardSpec, with_bias: bool) -> nn.Module:
        """A shallow copy of `module` whose weight (and bias, with `with_bias`) are empty meta
        tensors of `spec`'s local shape."""
        local = copy.copy(module)
        local._parameters = OrderedDict(module._parameters)
        local.weight = nn.Parameter(torch.empty(spec.local_shape(module.weight.shape), device="meta",
                                                dtype=module.weight.dtype), requires_grad=False)
        if module.bias is not None and with_bias:
            local.bias = nn.Parameter(torch.empty(spec.local_size(), device="meta", dtype=module.bias.dtype),
                                      requires_grad=False)
        return local


@register
class ConvConstruct(ConvolutionConstruct):
    kind = "conv"
    order = 60

    accepts = staticmethod(_plain_convolution)

    def planner_fields(self, info, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        axis = self.channel_axis(info, inputs)
        return {"weight_param": info.weight_param, "bias_param": info.bias_param, "convolution": True,
                "letters": [{"letter": "o", "role": "output", "input_dim": -1, "output_dim": axis},
                            {"letter": "i", "role": "contracted", "input_dim": axis, "output_dim": -1}]}

    # The weight splits as a Linear's, [out, in] (transposed: [in, out]) on its first two axes.
    weight_dim = LinearConstruct.weight_dim

    def stand_in(self, layer, module: nn.Module, rank: int, world_size: int) -> Optional[nn.Module]:
        if layer.style is Style.COLUMN_GATHER:
            return module  # its output gathered: every channel, as the unsharded layer gives
        return self.meta_copy(module, layer.weight_spec(rank, world_size), with_bias=layer.style.is_column)

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        return ShardedConv(module, layer.style, group, units=layer.units or None)
