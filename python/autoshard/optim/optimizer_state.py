"""What a parameter's optimizer state holds, and in which dtypes. bf16 and fp16 parameters step
through an fp32 master weight with fp32 states, since their own precision would lose small
updates; torch.optim's load_state_dict knows nothing of this and would round them, and a state
saved by torch.optim (or whole, or without master weights) must still continue correctly here.
So the rules for which parameters have a master, and the conforming of a loaded state to them
and to this rank's owned pieces, live together."""

from typing import Callable, Dict

import torch

from ..state.optimizer_views import local_state_dict
from ..runtime.optimizer_partition import piece_of
from .hyperparameters import param_name

_HALF = (torch.float16, torch.bfloat16)
# What a parameter may have an fp32 master of: a float64 one would lose precision.
_MASTERABLE = (torch.float32, torch.float16, torch.bfloat16)
MASTER = "master"  # the state key of a parameter's fp32 master weight


def uses_master(group: Dict, dtype: torch.dtype) -> bool:
    """Whether parameters of `dtype` in `group` step through an fp32 master weight."""
    master_weights = group.get("master_weights")
    if master_weights is None:
        return dtype in _HALF
    return bool(master_weights) and dtype in _MASTERABLE


def state_dtype(group: Dict, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state tensors of a parameter of `dtype`: fp32 with a master weight."""
    return torch.float32 if uses_master(group, dtype) else dtype


def check_masterable(optimizer: str, param_group: Dict, group_index: int) -> None:
    """master_weights=True needs bf16, fp16 or fp32 parameters (checked as the group joins)."""
    if param_group.get("master_weights") is not True:
        return
    for param_index, p in enumerate(param_group.get("params", [])):
        if isinstance(p, tuple) and len(p) == 2:
            p = p[1]
        if isinstance(p, torch.Tensor) and p.dtype not in _MASTERABLE:
            raise TypeError(f"{optimizer}: master_weights=True needs bfloat16, float16 or float32 parameters, but "
                            f"{param_name(group_index, param_index)} has dtype {p.dtype}")


def new_master(target: torch.Tensor) -> torch.Tensor:
    """An fp32 master weight of the stepped tensor (a parameter or its owned piece)."""
    return torch.empty_like(target, dtype=torch.float32, memory_format=torch.preserve_format).copy_(target)


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives a host-side ``step`` tensor (float64 under a float64 default
    dtype), so that a state dict's ``step`` is the same tensor either optimizer would make."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def load_state_dict_keeping_masters(optimizer: torch.optim.Optimizer, state_dict: Dict, load: Callable) -> None:
    """torch's Optimizer.load_state_dict (`load`) casts every floating state tensor to its
    parameter's dtype, which would round fp32 master weights and states to bf16: those of
    parameters stepped through a master weight are set aside and put back as saved."""
    # The state dict as this rank holds it (its own shards), before anything reads it.
    state_dict = local_state_dict(optimizer, state_dict)
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    saved_state = state_dict.get("state") if isinstance(state_dict, dict) else None
    kept = []
    if isinstance(saved_groups, list) and isinstance(saved_state, dict) and len(saved_groups) == len(optimizer.param_groups):
        for group, saved_group in zip(optimizer.param_groups, saved_groups):
            settings = {**group, **{k: v for k, v in saved_group.items() if k != "params"}}
            for saved_id, p in zip(saved_group.get("params", []), group["params"]):
                if not uses_master(settings, p.dtype):
                    continue
                for key, value in saved_state.get(saved_id, {}).items():
                    if key != "step" and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                        kept.append((p, key, value))
    settings_before = [group.get("master_weights") for group in optimizer.param_groups]
    load(state_dict)
    # A state dict of torch.optim's has no master_weights: the groups keep their own.
    for group, before in zip(optimizer.param_groups, settings_before):
        group.setdefault("master_weights", before)
    for p, key, value in kept:
        optimizer.state[p][key] = value.to(device=p.device, copy=True)
    conform_master_state(optimizer)


def conform_master_state(optimizer: torch.optim.Optimizer) -> None:
    """After a load: a parameter stepped through a master weight whose state was saved without
    one (by torch.optim, or with master_weights=False) gets one from its current value, and fp32
    states; one stepped without drops a saved master and keeps states of its own dtype."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            param_state = optimizer.state.get(p)
            if not param_state:
                continue
            master = uses_master(group, p.dtype)
            if master and MASTER not in param_state:
                piece = piece_of(p)
                param_state[MASTER] = new_master(p.detach() if piece is None else piece.of(p.detach()))
            elif not master:
                param_state.pop(MASTER, None)
            step = param_state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                # torch.optim keeps it on the device when fused or capturable; the step count is
                # read on the host at every step here, which would sync once per parameter.
                param_state["step"] = step.to("cpu")
            wanted = state_dtype(group, p.dtype)
            for key, value in param_state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and value.dtype != wanted:
                    param_state[key] = value.to(wanted)


def keep_owned_pieces(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: a partitioned parameter's state tensors shaped like the whole
    parameter (saved by torch.optim or without partitioning) keep only this rank's piece."""
    for p, param_state in optimizer.state.items():
        piece = piece_of(p)
        if piece is None:
            continue
        for key, value in param_state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape:
                param_state[key] = piece.of(value.contiguous()).clone()
