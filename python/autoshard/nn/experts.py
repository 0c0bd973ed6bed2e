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

Experts with biases (gpt-oss: ``[E, parts * F]`` beside the in weight, ``[E, H]`` beside the
out weight) split the in bias with the FFN axis. The out bias is added to each expert's output
before the routing weights scale it, so it must enter the sum over the ranks once: rank 0 adds
it and the others add zeros, through a copy whose gradient (rank 0's) is summed in backward.
"""

import torch
from torch import nn

from ..core import ops, region_generators
from ..core.spec import ShardSpec


def _local(spec: ShardSpec, full: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(spec.take_owned(full), requires_grad=full.requires_grad)


def shard_experts(module: nn.Module, in_name: str, in_spec: ShardSpec, out_name: str, out_spec: ShardSpec,
                  group, input_copy=None, in_bias=None, in_bias_spec=None, out_bias=None) -> nn.Module:
    """Makes `module` (an experts module) hold this rank's FFN slices and sum its output over
    `group`, in place; returns it. `input_copy` replaces the hidden states' copy (a copy shared
    with other column layers reading them). `in_bias` (split by `in_bias_spec`) and `out_bias`
    name the module's biases, if it has them."""
    if (in_spec.dim, out_spec.dim) not in ((1, 2), (2, 1)):
        raise ValueError(f"shard_experts: the FFN axis must be dim 1 of {in_name} and dim 2 of {out_name}, or (stored "
                         f"transposed) dim 2 and dim 1, got dims {in_spec.dim} and {out_spec.dim}")
    for name, spec in ((in_name, in_spec), (out_name, out_spec)):
        full = getattr(module, name)
        if not isinstance(full, torch.Tensor) or full.dim() != 3 or full.shape[spec.dim] != spec.full_size:
            raise ValueError(f"shard_experts: {type(module).__name__}.{name} must be 3-D with {spec.full_size} "
                             f"features on dim {spec.dim}, got shape {None if full is None else tuple(full.shape)}")
    if (in_bias is None) != (in_bias_spec is None) or (in_bias is None) != (out_bias is None):
        raise ValueError(f"shard_experts: give in_bias with in_bias_spec, and out_bias with them, got in_bias="
                         f"{in_bias!r}, in_bias_spec={in_bias_spec!r}, out_bias={out_bias!r}")
    if in_bias is not None:
        full = getattr(module, in_bias)
        if full.dim() != 2 or full.shape[1] != in_bias_spec.full_size or in_bias_spec.dim != 1:
            raise ValueError(f"shard_experts: {type(module).__name__}.{in_bias} must be [E, {in_bias_spec.full_size}] "
                             f"split on dim 1, got shape {tuple(full.shape)} split on dim {in_bias_spec.dim}")
    module.shard_specs = {in_name: in_spec, out_name: out_spec}
    if in_bias is not None:
        module.shard_specs[in_bias] = in_bias_spec
    for name, spec in module.shard_specs.items():
        setattr(module, name, _local(spec, getattr(module, name)))
    module.group = group
    group_name = group.group_name
    forward = type(module).forward.__get__(module)
    first = group.rank() == 0

    def sharded_forward(hidden_states: torch.Tensor, *routing, **kwargs):
        x = input_copy(hidden_states) if input_copy is not None else ops.copy_to_parallel(hidden_states, group_name)
        region_generators.enter(x, group_name, module.training)
        routing = tuple(_copy_routing(r, x, group_name) for r in routing)
        kwargs = {k: _copy_routing(v, x, group_name) for k, v in kwargs.items()}
        if out_bias is None:
            return region_generators.leave(ops.reduce_from_parallel(forward(x, *routing, **kwargs), group_name))
        bias = module._parameters[out_bias]
        # The same ops on every rank (so that every rank joins the gradient's all-reduce), times 0 off rank 0.
        module._parameters[out_bias] = ops.copy_to_parallel(bias, group_name) * (1.0 if first else 0.0)
        try:
            out = forward(x, *routing, **kwargs)
        finally:
            module._parameters[out_bias] = bias
        return region_generators.leave(ops.reduce_from_parallel(out, group_name))

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
