"""The unsharded view of a parallelized model: full_state_dict() puts every sharded
parameter back together, under the model's original names and in its original layout
(fused QKV parts included), on every rank."""

from dataclasses import replace
from typing import Dict

import torch
from torch import nn

from .comm import all_gather_uneven
from .nn.spec import ShardSpec, module_shards


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor of which `local` is this rank's `spec` piece (every rank calls this)."""
    if local.device.type == "meta":
        raise ValueError("full_state_dict: the model is still on the meta device; load or initialise its weights first")
    others = [replace(spec, rank=r) for r in range(spec.world_size)]
    gathered = all_gather_uneven(local.detach(), spec.dim, [other.local_size() for other in others], group)
    full_shape = list(local.shape)
    full_shape[spec.dim] = spec.full_size
    full = local.new_empty(full_shape)
    offset = 0
    for other in others:
        for start, length in other.local_ranges():
            full.narrow(spec.dim, start, length).copy_(gathered.narrow(spec.dim, offset, length))
            offset += length
    return full


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict the unsharded model would have, on every rank (a collective call)."""
    sharded = module_shards(model.modules())
    state = model.state_dict()
    gathered: Dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in sharded and name in state:
            if id(param) not in gathered:
                spec, group = sharded[id(param)]
                gathered[id(param)] = gather_full(param, spec, group)
            state[name] = gathered[id(param)]
    return state
