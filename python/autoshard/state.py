"""The unsharded view of a parallelized model: full_state_dict() puts every sharded
parameter back together, under the model's original names and in its original layout
(fused QKV parts included), on every rank."""

from dataclasses import replace
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

from .nn.spec import ShardSpec


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor of which `local` is this rank's `spec` piece (every rank calls this)."""
    if local.device.type == "meta":
        raise ValueError("full_state_dict: the model is still on the meta device; load or initialise its weights first")
    world = spec.world_size
    local = local.detach().contiguous()
    sizes = [replace(spec, rank=r).local_size() for r in range(world)]
    # all_gather needs equal shapes: pad every piece to the largest, drop the padding after.
    padded_shape = list(local.shape)
    padded_shape[spec.dim] = max(sizes)
    padded = local.new_zeros(padded_shape)
    padded.narrow(spec.dim, 0, local.shape[spec.dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    full_shape = list(local.shape)
    full_shape[spec.dim] = spec.full_size
    full = local.new_empty(full_shape)
    for r, piece in enumerate(pieces):
        offset = 0
        for start, length in replace(spec, rank=r).local_ranges():
            full.narrow(spec.dim, start, length).copy_(piece.narrow(spec.dim, offset, length))
            offset += length
    return full


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict the unsharded model would have, on every rank (a collective call)."""
    sharded = {}
    for module in model.modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            sharded[id(getattr(module, param_name))] = (spec, getattr(module, "group", None))
    state = model.state_dict()
    gathered: Dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in sharded and name in state:
            if id(param) not in gathered:
                spec, group = sharded[id(param)]
                gathered[id(param)] = gather_full(param, spec, group)
            state[name] = gathered[id(param)]
    return state
