"""Which construct recognises a module as a layer, and the probes a trace asks of a module: does
it map its input's features as a Linear does, is its call recorded as one layer node. What is
recorded of a layer (LayerInfo) is the constructs' (constructs/layer_info.py)."""

from typing import Dict, Optional

import torch
from torch import nn

from ..constructs import construct_of, recognise
from ..constructs.layer_info import LayerInfo
from ..nn.einsum import ShardedEinsumDense
from ..nn.head_parameters import holds_only_head_parameters
from ..nn.linear import ColumnParallelLinear, RowParallelLinear, _ParallelLinear
from ..nn.multihead_attention import IN_PROJECTION


def describe_layer(name: str, module: nn.Module, param_index: Dict[int, int]) -> Optional[LayerInfo]:
    """The LayerInfo of the construct (autoshard.constructs) that recognises `module`, or None."""
    # A forward set on the instance (in place of its class's) computes what it will: its ops
    # are followed one by one, and the module, never replaced, keeps it. The capture's own
    # stand-in for a block it replays (capture/folding.py) is not the model's.
    forward = vars(module).get("forward")
    if forward is not None and not getattr(forward, "autoshard_folded_block", False):
        return None
    return recognise(name, module, param_index)


def is_linear_like(module: nn.Module) -> bool:
    """Whether a layer module maps its input's features as a Linear does (a Linear, Conv1D or
    einsum layer, sharded or not): a norm called on its output may split with its features."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ShardedEinsumDense)) \
            or getattr(type(module), "autoshard_linear_like", False):
        return True

    info = describe_layer("", module, {})
    return info is not None and construct_of(info.kind).last_axis_features


def plain_linear_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The weight of a Linear layer stored [out, in] (nn.Linear, or a column- or row-parallel
    one made from it), which a model may multiply itself; None for any other module."""
    if isinstance(module, _ParallelLinear) and not module.transposed_weight:
        return module.weight
    if isinstance(module, nn.Linear) and isinstance(module.weight, torch.Tensor) and module.weight.dim() == 2:
        return module.weight
    return None


def in_projection_layer(name: str, module: nn.MultiheadAttention, param_index: Dict[int, int]) -> LayerInfo:
    """The q/k/v projection of an nn.MultiheadAttention named `name` as the layer
    `name + ".in_proj"` (see constructs/attention.py)."""
    return construct_of("attention").projection(name, module, param_index)


def layer_at(root: nn.Module, relative: str, name: str, param_index: Dict[int, int]) -> Optional[LayerInfo]:
    """The layer at `relative` inside `root`, named `name`: a module, or the q/k/v projection
    of an nn.MultiheadAttention (`<attention>.in_proj`, which is no module)."""
    parent, _, child = relative.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    if child == IN_PROJECTION and isinstance(owner, nn.MultiheadAttention):
        return in_projection_layer(name[:-len(IN_PROJECTION) - 1], owner, param_index)
    return describe_layer(name, root.get_submodule(relative), param_index)


def is_layer_module(module: nn.Module) -> bool:
    """Whether a trace records a module's call as one layer: a layer the planner plans, a
    sharded one, unless the module says otherwise (`autoshard_layer`: a sharded attention is
    traced op by op, its q/k/v projection is one layer)."""
    flag = getattr(type(module), "autoshard_layer", None)
    if flag is not None:
        return flag
    sharded = hasattr(module, "shard_specs") and not holds_only_head_parameters(module)
    return sharded or describe_layer("", module, {}) is not None
