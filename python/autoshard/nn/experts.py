"""Mixture-of-experts weights held as 3-D parameters, split on each expert's FFN axis.

An experts module holds E experts' MLPs as two parameters: ``[E, parts * F, H]`` (the gate
and up projections one after the other when gated) and ``[E, H, F]``, or both transposed
(``[E, H, parts * F]`` and ``[E, F, H]``, multiplied as ``x @ w``). Each rank keeps its
``split_sizes`` slice of F for every expert (of each part), so each expert is a column layer
followed by a row layer, and the module's own forward (its loop over experts, or a grouped or
batched matmul) computes this rank's partial sum of every routed token's output. The module's
output is all-reduced once in forward; its inputs are replicated, so their gradients (the
hidden states', and the routing weights', which meet every rank's partial outputs) are
all-reduced in backward. The router stays replicated: every rank routes the tokens alike.
"""

import torch
from torch import nn

from .. import ops, region_generators
from .spec import ShardSpec


def _local(spec: ShardSpec, full: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(spec.take_owned(full), requires_grad=full.requires_grad)


def shard_experts(module: nn.Module, in_name: str, in_spec: ShardSpec, out_name: str, out_spec: ShardSpec,
                  group, input_copy=None) -> nn.Module:
    """Makes `module` (an experts module) hold this rank's FFN slices and sum its output over
    `group`, in place; returns it. `input_copy` replaces the hidden states' copy (a copy shared
    with other column layers reading them)."""
    if (in_spec.dim, out_spec.dim) not in ((1, 2), (2, 1)):
        raise ValueError(f"shard_experts: the FFN axis must be dim 1 of {in_name} and dim 2 of {out_name}, or (stored "
                         f"transposed) dim 2 and dim 1, got dims {in_spec.dim} and {out_spec.dim}")
    for name, spec in ((in_name, in_spec), (out_name, out_spec)):
        full = getattr(module, name)
        if not isinstance(full, torch.Tensor) or full.dim() != 3 or full.shape[spec.dim] != spec.full_size:
            raise ValueError(f"shard_experts: {type(module).__name__}.{name} must be 3-D with {spec.full_size} "
                             f"features on dim {spec.dim}, got shape {None if full is None else tuple(full.shape)}")
    setattr(module, in_name, _local(in_spec, getattr(module, in_name)))
    setattr(module, out_name, _local(out_spec, getattr(module, out_name)))
    module.shard_specs = {in_name: in_spec, out_name: out_spec}
    module.group = group
    group_name = group.group_name
    forward = type(module).forward.__get__(module)

    def sharded_forward(hidden_states: torch.Tensor, *routing, **kwargs):
        x = input_copy(hidden_states) if input_copy is not None else ops.copy_to_parallel(hidden_states, group_name)
        region_generators.enter(x, group_name, module.training)
        routing = tuple(_copy_routing(r, x, group_name) for r in routing)
        kwargs = {k: _copy_routing(v, x, group_name) for k, v in kwargs.items()}
        return region_generators.leave(ops.reduce_from_parallel(forward(x, *routing, **kwargs), group_name))

    # The instance's forward, so that hooks on the module see the sharded call as one call.
    module.forward = sharded_forward
    return module


def _copy_routing(value, x: torch.Tensor, group_name: str):
    """A floating-point routing input, replicated, whose gradient is summed over the ranks. A
    lower-precision one is first cast to the hidden states' dtype, which the experts' products
    promote it to anyway: its gradient is then summed at that precision and rounded once, as
    in the unsharded model."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    dtype = torch.promote_types(value.dtype, x.dtype)
    return ops.copy_to_parallel(value.to(dtype), group_name)
