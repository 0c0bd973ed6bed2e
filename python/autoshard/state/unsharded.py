"""The unsharded view of a parallelized model: full_state_dict() puts every sharded
parameter back together, under the model's original names and in its original layout
(fused QKV parts included), on every rank.

A model whose modules have state_dict hooks (a fused q/k/v weight saved as q, k and v) saves
under names and in layouts of the hooks' making: there every sharded parameter is gathered
first, and the hooks run on the whole tensors, with the global sizes parallelize made local
restored for the call (see unsharded_view), so that they save what they save unsharded."""

from contextlib import contextmanager
from dataclasses import replace
from typing import Dict

import torch
from torch import nn

from ..core.comm import all_gather_uneven
from ..runtime.fully_sharded import is_dtensor, whole_over_data_parallel
from ..core.spec import ShardSpec, module_shards
from ..core.module_attributes import set_attribute
from ..core.parallel_state import state_of


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor of which `local` is this rank's `spec` piece (every rank calls this)."""
    if local.device.type == "meta":
        raise ValueError("full_state_dict: the model is still on the meta device; load or initialise its weights first")
    others = [replace(spec, rank=r) for r in range(spec.world_size)]
    gathered = all_gather_uneven(local.detach(), spec.dim, [other.local_size() for other in others], group)
    full = local.new_empty(spec.full_shape(local.shape))
    offset = 0
    for other in others:
        for start, length in other.local_ranges():
            full.narrow(spec.dim, start, length).copy_(gathered.narrow(spec.dim, offset, length))
            offset += length
    return full


def _own_hook(hook) -> bool:
    """A hook the model came with, not one autoshard registered (those know about shards) nor
    one of fully_shard's (which only reshards FSDP's parameters before a save or load)."""
    return not (getattr(hook, "__module__", None) or "").startswith(("autoshard.", "torch.distributed.fsdp."))


def has_state_dict_hooks(model: nn.Module) -> bool:
    """Whether a module of the model's own (not a sharded one autoshard made) has state_dict
    hooks of the model's own."""
    return any(_own_hook(hook) for m in model.modules() if not hasattr(m, "shard_specs")
               for hook in (*m._state_dict_hooks.values(), *m._state_dict_pre_hooks.values()))


@contextmanager
def unsharded_view(model: nn.Module, whole: Dict[int, torch.Tensor]):
    """While inside: each sharded parameter (by id in `whole`) holds its whole tensor, and the
    attributes the plan made local hold their global values again, and the view calls it made
    local (nn/view_sizes.py) are left as the model writes them."""
    params = {id(p): p for p in model.parameters()}
    local = {key: params[key].data for key in whole}
    state = state_of(model)
    regions = [] if state is None or state.plan is None else list(state.plan.regions.values())
    rank, world = (state.group.rank(), state.group.size()) if regions else (0, 1)
    try:
        for key, tensor in whole.items():
            params[key].data = tensor
        for region in regions:
            for attr, value in region.attributes.items():
                set_attribute(model.get_submodule(region.module), attr, value)
            _view_sizes_enabled(model.get_submodule(region.module), False)
        yield
    finally:
        for key, tensor in local.items():
            params[key].data = tensor
        for region in regions:
            for attr in region.attributes:
                set_attribute(model.get_submodule(region.module), attr, region.local_attribute(attr, rank, world))
            _view_sizes_enabled(model.get_submodule(region.module), True)


def _view_sizes_enabled(module: nn.Module, enabled: bool) -> None:
    hooks = getattr(module, "autoshard_view_sizes", None)
    if hooks is not None:
        hooks.enabled = enabled


def _hooked_state_dict(model: nn.Module, sharded) -> Dict[str, torch.Tensor]:
    whole = {}
    for param in model.parameters():
        if id(param) in sharded:
            spec, group = sharded[id(param)]
            whole[id(param)] = gather_full(param, spec, group)
    with unsharded_view(model, whole):
        state = model.state_dict()

    expected = getattr(state_of(model), "unsharded_state_shapes", None)
    got = {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    if expected is not None and got != expected:
        differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        shown = ", ".join(f"{k!r}: {got.get(k)} (unsharded {expected.get(k)})" for k in differ[:4])
        raise ValueError(f"full_state_dict: the model's state_dict hooks save other entries from the parallelized "
                         f"model than from the unsharded one ({shown}{' ...' if len(differ) > 4 else ''}); they "
                         "read sizes or modules that parallelize changed. Save the unsharded layout with "
                         "autoshard.full_state_dict after removing the hooks, and apply their renaming to its result")
    return state


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict the unsharded model would have, on every rank (a collective call).
    Under fully_shard over "dp", FSDP's pieces are all-gathered over its ranks first."""
    sharded = module_shards(model.modules())
    fully_sharded = any(is_dtensor(p) for p in model.parameters())
    if has_state_dict_hooks(model):
        if fully_sharded:
            raise ValueError("full_state_dict: a model under fully_shard whose modules have state_dict hooks of their "
                             "own is not supported; call it before fully_shard, or remove the hooks")
        return _hooked_state_dict(model, sharded)
    # Under fully_shard, the parameters themselves (keep_vars): state_dict() refuses FSDP's pieces of shards.
    state = model.state_dict(keep_vars=fully_sharded)
    gathered: Dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state and (id(param) in sharded or is_dtensor(param)):
            if id(param) not in gathered:
                whole = whole_over_data_parallel(param)
                if id(param) in sharded:
                    spec, group = sharded[id(param)]
                    whole = gather_full(whole, spec, group)
                gathered[id(param)] = whole
            state[name] = gathered[id(param)]
    if fully_sharded:
        state = {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    return state
