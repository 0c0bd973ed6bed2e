"""The checks of an optimizer's settings that AdamW and SGD share, with the messages they raise.
Both optimizers check every setting as a group joins and again at each step (a group's values
may be changed in between), so each check is written once, and its message names the setting
as the user set it (``lr`` or ``param_groups[1]['lr']``) so that it can be found and fixed."""

import numbers

import torch


def check_master_weights(optimizer: str, name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be None (on for bf16/fp16 parameters), True or False, "
                        f"got {value!r}")


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


def check_none_or_bool(optimizer: str, name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be None, True or False, got {value!r}")


def check_only(optimizer: str, name: str, value, supported: bool, why: str) -> None:
    """A setting of torch's that autoshard's optimizer keeps in its param groups (so that state
    dicts move between them) but runs with one value only."""
    check_bool(optimizer, name, value)
    if value is not supported:
        raise ValueError(f"{optimizer}: {name}={value} is not supported: {why}; only {name}={supported} is")


def param_name(group_index: int, param_index: int) -> str:
    return f"param_groups[{group_index}]['params'][{param_index}]"
