"""torch.amp.GradScaler over a parallelized model's optimizer: every rank finds the same inf.

GradScaler unscales an optimizer's gradients and records, per device, whether any is not
finite; ``step()`` skips the optimizer's step where one was, and ``update()`` lowers the scale.
On a rank these gradients are the local shards: an overflow in one rank's shard is found by
that rank alone, which skips its step and halves its scale while the others step and keep
theirs. The shards then belong to different models than the unsharded one, and the ranks go on
with different scales: silently wrong.

GradScaler computes these flags in one method, ``_unscale_grads_`` (``unscale_``, ``step`` and a
fused optimizer's ``_check_inf_per_device`` all call it). It is wrapped while a parallelized
model lives, like torch's clipping (runtime/torch_patches.py): for an optimizer stepping a parallelized model's parameters,
the flags are combined into one and its maximum taken over the models' tensor-parallel and
data-parallel groups, then written back to every device's flag before ``step()`` or ``update()``
reads them. Each rank unscales before each step (``step`` does it where the user did not), so
every rank meets the collective. Any other optimizer is left to torch's own method.
"""

from typing import List

import torch
import torch.distributed as dist

from ..core.parallel_state import parameters_states
from torch.amp import grad_scaler

_ORIGINAL = {}


def _groups_of(optimizer) -> List[dist.ProcessGroup]:
    """The groups over which `optimizer`'s parallelized parameters' gradients are split or
    partitioned (tensor-parallel, then data-parallel), each once."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = {id(group): group for state in parameters_states(params)
              for group in (state.group, state.data_parallel_group) if group is not None and group.size() > 1}
    return list(groups.values())


def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    per_device = _ORIGINAL["_unscale_grads_"](self, optimizer, inv_scale, found_inf, allow_fp16)
    groups = _groups_of(optimizer)
    if not groups:
        return per_device
    # One flag for all devices, so that every rank issues one collective per group whatever
    # devices its gradients are on; found_inf is the flag of the scale's device.
    agreed = found_inf.clone()
    for flag in per_device.values():
        if flag is not found_inf:
            agreed.add_(flag.to(agreed.device))
    for group in groups:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    per_device.setdefault(found_inf.device, found_inf)
    for flag in per_device.values():
        flag.copy_(agreed.to(flag.device))
    return per_device


def install() -> None:
    """Wraps GradScaler's unscaling (once) so that ranks holding shards agree on found_inf."""
    if _ORIGINAL:
        return
    _ORIGINAL["_unscale_grads_"] = grad_scaler.GradScaler._unscale_grads_
    grad_scaler.GradScaler._unscale_grads_ = _unscale_grads_


def remove() -> None:
    """Gives GradScaler its own unscaling back, where nothing replaced autoshard's since."""
    if _ORIGINAL and grad_scaler.GradScaler._unscale_grads_ is _unscale_grads_:
        grad_scaler.GradScaler._unscale_grads_ = _ORIGINAL["_unscale_grads_"]
    _ORIGINAL.clear()


def is_installed() -> bool:
    return torch.amp.GradScaler._unscale_grads_ is _unscale_grads_
