"""What AdamW and SGD share: hyperparameter checks, and gathering a step's tensors into one
fused call per (param group, device, dtype, ...) after checking all of them, so that a bad
parameter raises before any parameter or state has changed."""

import numbers
from typing import Callable, Dict, Hashable, List, Tuple

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


def check_gradient(optimizer: str, p: torch.Tensor, name: str) -> None:
    grad = p.grad
    if grad.is_sparse:
        raise TypeError(f"{optimizer}: {name}.grad is sparse; {optimizer} needs dense gradients")
    if grad.device != p.device:
        raise ValueError(f"{optimizer}: {name}.grad is on {grad.device} but the parameter is on {p.device}")
    if grad.dtype != p.dtype:
        raise TypeError(f"{optimizer}: {name}.grad has dtype {grad.dtype} but the parameter has dtype {p.dtype}")
    if p.dtype not in _FLOATING and not p.is_complex():
        raise TypeError(f"{optimizer}: {name} must be a floating-point or complex tensor, got {p.dtype}")


def check_state_tensor(optimizer: str, p: torch.Tensor, name: str, state: Dict, key: str) -> None:
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{optimizer}: the state of {name} has no tensor {key!r} (got {type(value).__name__})")
    if value.device != p.device:
        raise ValueError(f"{optimizer}: state {key!r} of {name} is on {value.device} but the parameter is on {p.device}")
    if value.dtype != p.dtype:
        raise TypeError(f"{optimizer}: state {key!r} of {name} has dtype {value.dtype} but the parameter has dtype {p.dtype}")
    if value.shape != p.shape:
        raise ValueError(
            f"{optimizer}: state {key!r} of {name} has shape {tuple(value.shape)} but the parameter has shape {tuple(p.shape)}"
        )


def as_real(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors are stepped as pairs of reals, as torch.optim does."""
    return torch.view_as_real(t) if t.is_complex() else t


def gather_buckets(
    optimizer: str,
    param_groups: List[Dict],
    check_group: Callable[[Dict, int], None],
    bucket_key: Callable[[Dict, torch.Tensor, str], Hashable],
) -> List[Tuple[Dict, Dict[Hashable, List[torch.Tensor]]]]:
    """For every group, its parameters with gradients sorted into buckets that each become one
    fused call. Checks everything first; changes nothing."""
    plan = []
    for group_index, group in enumerate(param_groups):
        check_group(group, group_index)
        buckets: Dict[Hashable, List[torch.Tensor]] = {}
        for param_index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = param_name(group_index, param_index)
            check_gradient(optimizer, p, name)
            key = (p.device, p.dtype, bucket_key(group, p, name))
            buckets.setdefault(key, []).append(p)
        plan.append((group, buckets))
    return plan
