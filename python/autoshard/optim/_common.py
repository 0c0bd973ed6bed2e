"""What AdamW and SGD share: hyperparameter checks, and gathering a step's tensors into one
fused call per (param group, device, dtype, ...) after checking all of them, so that a bad
parameter raises before any parameter or state has changed."""

import numbers
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def hyperparameter_name(key: str, group_index) -> str:
    """``lr`` for an optimizer default, ``param_groups[1]['lr']`` for a group's own value."""
    return key if group_index is None else f"param_groups[{group_index}][{key!r}]"


def as_float(optimizer: str, name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{optimizer}: {name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{optimizer}: {name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_at_least(optimizer: str, name: str, value, minimum: float = 0.0) -> float:
    number = as_float(optimizer, name, value)
    if not number >= minimum:  # also rejects nan
        raise ValueError(f"{optimizer}: {name} must be >= {minimum:g}, got {number}")
    return number


def check_bool(optimizer: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be a bool, got {type(value).__name__}")
    return value


def param_name(group_index: int, param_index: int) -> str:
    return f"param_groups[{group_index}]['params'][{param_index}]"


def _raise_for_gradient(optimizer: str, p: torch.Tensor, name: str) -> None:
    grad = p.grad
    if grad.is_sparse:
        raise TypeError(f"{optimizer}: {name}.grad is sparse; {optimizer} needs dense gradients")
    if grad.device != p.device:
        raise ValueError(f"{optimizer}: {name}.grad is on {grad.device} but the parameter is on {p.device}")
    if grad.dtype != p.dtype:
        raise TypeError(f"{optimizer}: {name}.grad has dtype {grad.dtype} but the parameter has dtype {p.dtype}")
    raise TypeError(f"{optimizer}: {name} must be a floating-point or complex tensor, got {p.dtype}")


def _raise_for_state(optimizer: str, p: torch.Tensor, name: str, key: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{optimizer}: the state of {name} has no tensor {key!r} (got {type(value).__name__})")
    if value.device != p.device:
        raise ValueError(f"{optimizer}: state {key!r} of {name} is on {value.device} but the parameter is on {p.device}")
    if value.dtype != p.dtype:
        raise TypeError(f"{optimizer}: state {key!r} of {name} has dtype {value.dtype} but the parameter has dtype {p.dtype}")
    raise ValueError(
        f"{optimizer}: state {key!r} of {name} has shape {tuple(value.shape)} but the parameter has shape {tuple(p.shape)}"
    )


class Bucket:
    """Parameters that step together in one fused call, with their gradients and states."""

    __slots__ = ("params", "grads", "states")

    def __init__(self) -> None:
        self.params: List[torch.Tensor] = []
        self.grads: List[torch.Tensor] = []
        self.states: List[Dict] = []


# (group, group_index) -> None, raising for bad settings
GroupCheck = Callable[[Dict, int], None]
# (group, param state or None) -> (state tensors it must have, what else splits buckets)
StateRule = Callable[[Dict, Optional[Dict]], Tuple[Tuple[str, ...], Hashable]]


def gather_buckets(
    optimizer: str, param_groups: List[Dict], state: Dict, check_group: GroupCheck, state_rule: StateRule
) -> List[Tuple[Dict, Dict[Hashable, Bucket]]]:
    """For every group, its parameters with gradients sorted into buckets of one device and
    dtype (and whatever else state_rule says must match), each becoming one fused call.
    Checks every group, gradient and state first; changes nothing."""
    plan = []
    for group_index, group in enumerate(param_groups):
        check_group(group, group_index)
        buckets: Dict[Hashable, Bucket] = {}
        for param_index, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            device, dtype = p.device, p.dtype
            if grad.is_sparse or grad.device != device or grad.dtype != dtype or not (dtype in _FLOATING or dtype.is_complex):
                _raise_for_gradient(optimizer, p, param_name(group_index, param_index))
            param_state = state.get(p)
            keys, extra = state_rule(group, param_state)
            for key in keys:
                value = param_state.get(key)
                if not (isinstance(value, torch.Tensor) and value.device == device and value.dtype == dtype
                        and value.shape == p.shape):
                    _raise_for_state(optimizer, p, param_name(group_index, param_index), key, value)
            bucket = buckets.get((device, dtype, extra))
            if bucket is None:
                bucket = buckets[(device, dtype, extra)] = Bucket()
            bucket.params.append(p)
            bucket.grads.append(grad)
            bucket.states.append(param_state)
        plan.append((group, buckets))
    return plan


def as_real(tensors: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """Complex tensors are stepped as pairs of reals, as torch.optim does."""
    return [torch.view_as_real(t) for t in tensors] if dtype.is_complex else tensors
