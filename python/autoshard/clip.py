"""clip_grad_norm_: the global gradient norm of a tensor-parallel model, as torch computes it
for the unsharded model. A shard's squares are summed across the tensor-parallel group; a
replicated parameter (a norm's weight, a row layer's bias) holds the same gradient on every
rank and is counted once."""

import math
import numbers
from typing import Iterable, Union

import torch
import torch.distributed as dist

from .nn.spec import sharded_parameters


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the gradients in place so that their global norm is at most `max_norm`;
    returns the norm before clipping. Every rank of the tensor-parallel group must call it."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # A tied parameter listed twice counts once, as model.parameters() lists it.
    unique = {id(p): p for p in params if isinstance(p, torch.Tensor) and p.grad is not None}
    if not unique:
        return torch.tensor(0.0)
    grads = [p.grad for p in unique.values()]
    devices = {g.device for g in grads}
    if len(devices) > 1:
        raise ValueError(f"clip_grad_norm_: the gradients are on several devices {sorted(map(str, devices))}")
    device = grads[0].device
    shards = sharded_parameters()
    sharded = [p.grad for key, p in unique.items() if key in shards]
    replicated = [p.grad for key, p in unique.items() if key not in shards]
    groups = {id(shards[key][1]): shards[key][1] for key in unique if key in shards}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the parameters are sharded over different process groups")
    group = next(iter(groups.values())) if groups else None

    def local(tensors, combine):
        if not tensors:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, norm_type)])
        return combine(norms)

    if math.isinf(norm_type):
        total = local(sharded, torch.max)
        if sharded and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(total, local(replicated, torch.max))
    else:
        total = local(sharded, lambda n: n.pow(norm_type).sum())
        if sharded and dist.is_initialized():
            dist.all_reduce(total, group=group)
        total = (total + local(replicated, lambda n: n.pow(norm_type).sum())).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total
