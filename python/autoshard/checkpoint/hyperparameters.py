"""Checks of the optimizer hyperparameters a manifest holds, made before a load applies them.

A manifest's ``lr`` becomes the optimizer's: a negative learning rate or betas outside [0, 1)
would train silently wrong, so they are refused like a damaged file, with the field named.
"""

import math
from typing import List

import torch

from ..tensor_io import CheckpointCorruptError

_AT_LEAST_ZERO = ("lr", "eps", "weight_decay", "momentum", "dampening")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problem(key: str, value, current):
    """What is wrong with ``value`` for hyperparameter ``key`` (None: nothing)."""
    if isinstance(current, bool) and not isinstance(value, bool):
        return "must be a bool"
    if (isinstance(current, (int, float)) and not isinstance(current, bool)) or isinstance(current, torch.Tensor):
        if not _number(value):
            return "must be a finite number"
    if isinstance(current, (tuple, list)):
        if not (isinstance(value, list) and len(value) == len(current) and all(_number(v) for v in value)):
            return f"must be a list of {len(current)} finite numbers"
    if key in _AT_LEAST_ZERO and not (_number(value) and value >= 0):
        return "must be a finite number >= 0"
    if key == "betas" and not (isinstance(value, list) and len(value) == 2
                               and all(_number(b) and 0 <= b < 1 for b in value)):
        return "must be two numbers in [0, 1)"
    return None


def check_hyperparameters(saved_groups: List[dict], optimizer: torch.optim.Optimizer, manifest_path: str) -> None:
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for key, value in saved.items():
            if key == "params":
                continue
            problem = _problem(key, value, group.get(key))
            if problem is not None:
                raise CheckpointCorruptError(f"load: {manifest_path!r}: optimizer.param_groups[{g}][{key!r}] {problem}, "
                                             f"got {value!r}")
