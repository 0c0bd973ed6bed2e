"""An optimizer's ``state_dict()`` over a parallelized model, as DCP expects it: the state of a
sharded parameter (``exp_avg``, ``exp_avg_sq``, a master weight: each shaped like the parameter's
shard) is given as a ``ShardView`` of the global shape, as the model's own entries are
(state/state_views.py), so that ``get_optimizer_state_dict`` + ``dcp.save`` store the global tensors and
``dcp.load`` + ``set_optimizer_state_dict`` reshard them.

Any torch optimizer gets this at its first step over parameters of a parallelized model (a
global step pre-hook, installed by ``parallelize``), autoshard's optimizers as well. DCP's
``get_optimizer_state_dict`` takes a step with zero learning rate to create the state of a fresh
optimizer, so a fresh optimizer is covered before DCP reads it.
"""

from typing import Dict, Hashable, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.parallel_state import shards_of
from ..core.spec import ShardSpec
from .state_views import ShardView, fully_sharded_entry, local_of

__all__ = ["install_optimizer_views", "install_global_optimizer_hook", "local_state_dict"]

_INSTALLED = "_autoshard_state_views"
_CHECKED = "_autoshard_state_views_checked"
_global_hook = None


def _sharded_by_key(optimizer: torch.optim.Optimizer, state_dict: Dict) -> Dict[Hashable, Tuple[torch.Tensor, ShardSpec]]:
    """The key of each sharded parameter in `state_dict`'s "state" -> (the parameter, its ShardSpec).
    Keys are matched by position through the saved param groups, as torch's load_state_dict
    does: indices in torch's own state dicts, names in DCP's."""
    groups = state_dict.get("param_groups")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shards = shards_of(params)
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return {}
    found = {}
    for group, saved in zip(optimizer.param_groups, groups):
        for key, p in zip(saved.get("params", []) if isinstance(saved, dict) else [], group["params"]):
            if id(p) in shards:
                found[key] = (p, shards[id(p)][0])
    return found


def _views_on_save(optimizer, state_dict):
    state = dict(state_dict.get("state", {}))
    for index, (param, spec) in _sharded_by_key(optimizer, state_dict).items():
        # A new dict: torch's packed state shares each parameter's dict with the live state.
        param_state = dict(state.get(index, {}))
        for key, value in param_state.items():
            if hasattr(value, "device_mesh"):
                raise fully_sharded_entry(f"optimizer.state_dict(): state {key!r} of parameter {index!r}")
            # A state tensor shaped like the shard is sharded with it; a scalar step, or a piece
            # partitioned over data-parallel replicas (1-D), is left as it is.
            if isinstance(value, torch.Tensor) and not isinstance(value, ShardView) and value.shape == param.shape \
                    and value.dim() > spec.dim:
                param_state[key] = ShardView(value, spec)
        if param_state:
            state[index] = param_state
    return {**state_dict, "state": state}


def local_state_dict(optimizer, state_dict):
    """`state_dict` with this rank's tensors in place of ShardViews and of whole tensors."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict):
        return state_dict
    sharded = _sharded_by_key(optimizer, state_dict)
    state = dict(state)
    for index, param_state in state.items():
        if not isinstance(param_state, dict):
            continue
        found = sharded.get(index)
        param_state = dict(param_state)
        for key, value in param_state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if found is None:
                if isinstance(value, ShardView):
                    raise ValueError(f"load_state_dict: state {key!r} of parameter {index} is the shard {value.spec} "
                                     "of a parameter this optimizer does not split")
                continue
            try:
                param_state[key] = local_of(value, found[1])
            except ValueError as error:
                raise ValueError(f"load_state_dict: state {key!r} of parameter {index}: {error}") from None
        state[index] = param_state
    return {**state_dict, "state": state}


def install_optimizer_views(optimizer: torch.optim.Optimizer) -> None:
    """Makes `optimizer.state_dict()` give ShardViews for sharded parameters' state, and
    `load_state_dict` take them (or whole tensors) back. Idempotent."""
    if optimizer.__dict__.get(_INSTALLED):
        return
    optimizer.__dict__[_INSTALLED] = True
    optimizer.register_state_dict_post_hook(_views_on_save)
    optimizer.register_load_state_dict_pre_hook(local_state_dict)


def _on_step(optimizer, args, kwargs) -> None:
    if optimizer.__dict__.get(_INSTALLED):
        return
    # Looked at again only when the optimizer gained parameters (add_param_group).
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if optimizer.__dict__.get(_CHECKED) != count:
        optimizer.__dict__[_CHECKED] = count
        if shards_of(p for group in optimizer.param_groups for p in group["params"]):
            install_optimizer_views(optimizer)


def install_global_optimizer_hook() -> None:
    """Once per process: every optimizer stepping a parallelized model's parameters gets its views."""
    global _global_hook
    if _global_hook is None:
        _global_hook = register_optimizer_step_pre_hook(_on_step)
