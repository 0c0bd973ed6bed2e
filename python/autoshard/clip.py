"""clip_grad_norm_: the global gradient norm of a tensor-parallel model, as torch computes it
for the unsharded model. A shard's squares are summed across the tensor-parallel group; a
replicated parameter (a norm's weight, a row layer's bias) holds the same gradient on every
rank and is counted once, as is a KV head that several ranks hold; a replicated parameter whose state is partitioned across
data-parallel replicas holds only its own piece of the averaged gradient, so its pieces'
squares are summed across the data-parallel group. The norm is computed in fp32 whatever
the gradients' dtype (bf16 gradients included; fp64 stays fp64); the scaling is applied in their dtype."""

import math
import numbers
from typing import Iterable, Union

import torch
import torch.distributed as dist

from .comm import all_reduce_
from .model_state import shards_of
from .partitioned_state import piece_of


def _one_group(groups, what: str):
    unique = {id(g): g for g in groups}
    if len(unique) > 1:
        raise ValueError(f"clip_grad_norm_: the {what} parameters are spread over different process groups")
    return next(iter(unique.values()), None)


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the gradients in place so that their global norm is at most `max_norm`;
    returns the norm before clipping. Every rank of the tensor-parallel group (and, with
    partitioned optimizer state, of the data-parallel group) must call it."""
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
    # The norm is computed in fp32 at least, whatever the gradients' dtype: a bf16 norm per
    # tensor would carry bf16's rounding (about 0.4%) into the total; fp64 gradients keep fp64.
    # Every rank holds the same dtypes, so every rank's partial sums agree on this one.
    norm_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    pieces = {key: piece for key, p in unique.items() if (piece := piece_of(p)) is not None}
    shards = {key: found for key, found in shards_of(unique.values()).items() if key not in pieces}
    # A KV head held by several ranks (ShardSpec.repeat) is counted by one of them.
    owned = {key: shards[key][0].owned_part(p.grad) for key, p in unique.items() if key in shards}
    sharded = [g for g in owned.values() if g is not None]
    partitioned = [pieces[key].of(p.grad) for key, p in unique.items() if key in pieces]
    replicated = [p.grad for key, p in unique.items() if key not in shards and key not in pieces]
    group = _one_group([shards[key][1] for key in unique if key in shards], "sharded")
    dp_group = _one_group([piece.group for piece in pieces.values()], "partitioned")

    def local(tensors, combine):
        if not tensors:
            return torch.zeros((), device=device, dtype=norm_dtype)
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=norm_dtype))
        return combine(norms)

    def across(tensors, combine, over, op, participate=None):
        # Every rank of `over` must take part; a rank whose KV shards are all owned elsewhere
        # may hold no tensor here while the others do.
        part = local(tensors, combine)
        if (tensors if participate is None else participate) and dist.is_initialized():
            all_reduce_(part, op, over)
        return part

    if math.isinf(norm_type):
        total = torch.maximum(across(sharded, torch.max, group, "max", bool(owned)),
                              across(partitioned, torch.max, dp_group, "max"))
        total = torch.maximum(total, local(replicated, torch.max))
    else:
        power_sum = lambda n: n.pow(norm_type).sum()
        total = (across(sharded, power_sum, group, "sum", bool(owned))
                 + across(partitioned, power_sum, dp_group, "sum"))
        total = (total + local(replicated, power_sum)).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total
