"""The checks of an optimizer's settings that AdamW and SGD share, with the messages they raise.
Both optimizers check every setting as a group joins and again at each step (a group's values
may be changed in between), so each check is written once, and its message names the setting
as the user set it (``lr`` or ``param_groups[1]['lr']``) so that it can be found and fixed."""

import numbers
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch


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


def check_settings(optimizer: str, values: Dict, group_index: Optional[int], at_least: Sequence[str],
                   bools: Sequence[str], only: Dict[str, Tuple[bool, str]], floats: Sequence[str] = ()) -> Callable:
    """Checks the settings present in `values` (all of them for a complete group): `at_least` real
    numbers >= 0, `floats` real numbers, `bools`; `only` maps a setting of torch's that autoshard's
    optimizer keeps in its param groups (so that state dicts move between them) but runs with one
    value only to (that value, why); foreach, fused and master_weights are None or a bool. Returns
    the function naming a setting in messages."""

    def name(key: str) -> str:
        """``lr`` for an optimizer default, ``param_groups[1]['lr']`` for a group's own value."""
        return key if group_index is None else f"param_groups[{group_index}][{key!r}]"

    for keys, check in ((at_least, check_at_least), (floats, as_float), (bools, check_bool)):
        for key in keys:
            if key in values:
                check(optimizer, name(key), values[key])
    for key, (supported, why) in only.items():
        if key in values and check_bool(optimizer, name(key), values[key]) is not supported:
            raise ValueError(f"{optimizer}: {name(key)}={values[key]} is not supported: {why}; "
                             f"only {name(key)}={supported} is")
    for key in ("foreach", "fused", "master_weights"):
        value = values.get(key)
        if value is not None and not isinstance(value, bool):
            on = " (on for bf16/fp16 parameters)" if key == "master_weights" else ""
            raise TypeError(f"{optimizer}: {name(key)} must be None{on}, True or False, got {value!r}")
    return name


def param_name(group_index: int, param_index: int) -> str:
    return f"param_groups[{group_index}]['params'][{param_index}]"
