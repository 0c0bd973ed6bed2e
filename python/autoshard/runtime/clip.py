"""clip_grad_norm_: the global gradient norm of a tensor-parallel model, as torch computes it
for the unsharded model. A shard's squares are summed across the tensor-parallel group; a
replicated parameter (a norm's weight, a row layer's bias) holds the same gradient on every
rank and is counted once, as is a KV head that several ranks hold; a replicated parameter whose state is partitioned across
data-parallel replicas holds only its own piece of the averaged gradient, so its pieces'
squares are summed across the data-parallel group, and so are the pieces of FSDP's DTensor
gradients (fully_shard over "dp"). The norm is computed in fp32 whatever
the gradients' dtype (bf16 gradients included; fp64 stays fp64); the scaling is applied in their dtype."""

import math
import numbers
from typing import Iterable, Union

import torch
import torch.distributed as dist

from ..core.comm import all_reduce_
from ..core.parallel_state import shards_of
from .fully_sharded import fsdp_group_of, is_dtensor, local_tensor, whole_over_data_parallel
from .optimizer_partition import piece_of


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
    total = global_grad_norm(params, norm_type, error_if_nonfinite)
    scale_grads_(params, max_norm, total)
    return total


def scale_grads_(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scales the gradients of `params` by max_norm / total where that is below 1 (each rank's
    local part: FSDP's pieces, shards)."""
    grads = [p.grad for p in {id(p): p for p in params if isinstance(p, torch.Tensor) and p.grad is not None}.values()]
    if grads:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([local_tensor(g) for g in grads], coefficient.to(grads[0].dtype))


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> torch.Tensor:
    """The norm of order `norm_type` of the gradients of `params` over every rank that holds a
    part of them, as torch computes it for the unsharded model (a collective: every rank of the
    groups calls it)."""
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
    # FSDP's DTensor gradients (fully_shard over "dp") hold this rank's piece of each tensor-parallel
    # shard or replicated gradient: the pieces' powers are summed over FSDP's group first. A KV
    # head held by several ranks is gathered whole over it, to be counted by one of them.
    over_dp = {key for key, p in unique.items() if is_dtensor(p.grad)}
    whole = {key: whole_over_data_parallel(p.grad) if key in over_dp and shards[key][0].overlaps else p.grad
             for key, p in unique.items() if key in shards}
    owned = {key: shards[key][0].owned_part(whole[key]) for key in whole}
    sharded = [local_tensor(g) for key, g in owned.items() if g is not None and not is_dtensor(g)]
    sharded_pieces = [local_tensor(g) for key, g in owned.items() if g is not None and is_dtensor(g)]
    partitioned = [pieces[key].of(p.grad) for key, p in unique.items() if key in pieces]
    rest = [p.grad for key, p in unique.items() if key not in shards and key not in pieces]
    replicated = [g for g in rest if not is_dtensor(g)]
    replicated_pieces = [local_tensor(g) for g in rest if is_dtensor(g)]
    group = _one_group([shards[key][1] for key in unique if key in shards], "sharded")
    dp_group = _one_group([piece.group for piece in pieces.values()], "partitioned")
    fsdp_group = _one_group([fsdp_group_of(unique[key].grad) for key in over_dp], "fully sharded")

    def local(tensors, combine):
        if not tensors:
            return torch.zeros((), device=device, dtype=norm_dtype)
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=norm_dtype))
        return combine(norms)

    def across(tensors, combine, over, op):
        part = local(tensors, combine)
        if tensors and dist.is_initialized():
            all_reduce_(part, op, over)
        return part

    def fully_sharded(combine, op):
        # (sharded, replicated) over FSDP's group, in one collective; FSDP's ranks all hold both kinds alike.
        part = torch.stack([local(sharded_pieces, combine), local(replicated_pieces, combine)])
        if over_dp and fsdp_group is not None:
            all_reduce_(part, op, fsdp_group)
        return part[0], part[1]

    # Every rank of the tensor-parallel group takes part in its sum as soon as it holds a sharded
    # gradient: a rank whose KV shards are all owned elsewhere may hold no tensor while the others do.
    # The replicated gradients are summed on each rank alone (every rank holds them whole): where
    # one rank's are not finite, the sum over the group carries it, so that every rank finds the
    # same non-finite total and takes the same decision (raise, or scale alike). The infinity
    # norm takes maxima where the others add powers.
    infinite = math.isinf(norm_type)
    combine = torch.max if infinite else lambda n: n.pow(norm_type).sum()
    op, join = ("max", torch.maximum) if infinite else ("sum", torch.add)
    sharded_dp, replicated_dp = fully_sharded(combine, op)
    own = local(replicated, combine)
    total = join(local(sharded, combine), sharded_dp)
    agreed = None
    if owned and dist.is_initialized():
        # A replicated gradient that is not finite on one rank only reaches every rank's total: it
        # makes the maximum infinite on all, and its nan or inf enters every rank's sum.
        not_finite = torch.full_like(own, math.inf) if infinite else own
        total = join(total, torch.where(torch.isfinite(own), torch.zeros_like(own), not_finite))
        all_reduce_(total, op, group)
        agreed = total.clone()
    total = join(join(join(total, across(partitioned, combine, dp_group, op)), replicated_dp), own)
    if not infinite:
        total = total.pow(1.0 / norm_type)
    if agreed is not None:
        total = torch.where(torch.isfinite(agreed), total, agreed)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    return total
