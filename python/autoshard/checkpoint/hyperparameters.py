"""Checks of the optimizer hyperparameters and state a manifest holds, made before a load
changes the model or the optimizer.

A manifest's ``lr`` becomes the optimizer's: a negative learning rate or betas outside [0, 1)
would train silently wrong, so they are refused like a damaged file, with the field named. So
are a key the optimizer's groups do not have (it would be copied into them silently; but for the
few that torch's and autoshard's optimizers of one kind do not share), a value
whose type is not the optimizer's own (where the optimizer's own is None, as autoshard's
``master_weights`` by default, only None, a bool or, but for ``master_weights``, a string), and,
for the optimizers whose state is known (AdamW, Adam, SGD), a state key they do not keep, a
``step`` that is not one whole number >= 0 (a stored ``step`` tensor is read and checked
before anything changes too, by load.py).
"""

import math
from typing import Dict, List

import torch

from ..tensor_io import CheckpointCorruptError

_AT_LEAST_ZERO = ("lr", "eps", "weight_decay", "momentum", "dampening")
_BOOL_OR_NONE = ("master_weights", "foreach", "fused", "capturable", "differentiable")
# Hyperparameters that torch's AdamW, Adam and SGD keep and autoshard's do not, or the reverse
# (with a value of the type they take): a checkpoint of one loads into the other (copied into its
# groups, as before, once checked); any other key the optimizer's groups lack is refused.
_ONE_FAMILY = {"master_weights": None, "amsgrad": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": False}
# State keys of the optimizers whose state is known (autoshard's and torch's of these names).
_MASTER = "master"
KNOWN_STATE = {
    "AdamW": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", _MASTER},
    "Adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", _MASTER},
    "SGD": {"momentum_buffer", _MASTER},
}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_problem(value):
    """What is wrong with a ``step`` count (None: nothing)."""
    if not _number(value) or value < 0 or value != int(value):
        return "must be a whole number >= 0"
    return None


def _problem(key: str, value, current):
    """What is wrong with ``value`` for hyperparameter ``key`` (None: nothing)."""
    if key in _BOOL_OR_NONE and not (value is None or isinstance(value, bool)):
        return "must be null, true or false"
    if current is None and not (value is None or isinstance(value, (bool, str))):
        return "must be null, a bool or a string (the optimizer's own value is None)"
    if isinstance(current, str) and not isinstance(value, str):
        return "must be a string"
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
            if key not in group and key not in _ONE_FAMILY:
                raise CheckpointCorruptError(
                    f"load: {manifest_path!r}: optimizer.param_groups[{g}][{key!r}] is not a hyperparameter of "
                    f"this {type(optimizer).__name__}, whose groups hold {sorted(k for k in group if k != 'params')}")
            problem = _problem(key, value, group[key] if key in group else _ONE_FAMILY[key])
            if problem is not None:
                raise CheckpointCorruptError(f"load: {manifest_path!r}: optimizer.param_groups[{g}][{key!r}] {problem}, "
                                             f"got {value!r}")


def check_state(saved: Dict, optimizer: torch.optim.Optimizer, tensors: Dict, manifest_path: str) -> None:
    """The manifest's optimizer state (``saved["state"]``: name -> key -> entry), for the
    optimizers whose state is known; ``tensors`` are the manifest's tensor records."""
    known = KNOWN_STATE.get(type(optimizer).__name__)
    if known is None or saved.get("type") not in KNOWN_STATE:
        return
    for name, entries in saved["state"].items():
        for key, entry in entries.items():
            field = f"optimizer.state[{name!r}][{key!r}]"

            def refuse(problem: str, field=field):
                return CheckpointCorruptError(f"load: {manifest_path!r}: {field} {problem}")

            if key not in known:
                raise refuse(f"is not state that {type(optimizer).__name__} keeps (it keeps {sorted(known)})")
            if "value" in entry:
                value = entry["value"]
                if key == "step":
                    problem = step_problem(value)
                    if problem is not None:
                        raise refuse(f"{problem}, got {value!r}")
                elif not (key == "momentum_buffer" and value is None):
                    raise refuse(f"must be a tensor, got {value!r}")
                continue
            record = tensors[entry["tensor"]]
            if key == "step" and math.prod(record.shape) != 1:
                raise refuse(f"must be one number, got a tensor of shape {record.shape}")
