"""Tensors a model holds that an autograd graph computed, which torch cannot deepcopy."""

from typing import Any, Dict, List

import torch
from torch import nn


def computed_tensors(model: nn.Module, skip: Dict[int, Any]) -> List[torch.Tensor]:
    """The tensors held by the model (in its modules' attributes and the containers and objects
    they hold) that an autograd graph computed: a weight that torch.nn.utils.weight_norm
    recomputes in each forward, a tensor a forward left behind. torch cannot deepcopy them; the
    copy holds them detached (its forward computes them again, on meta)."""
    found, seen, stack = [], set(), [model]
    while stack:
        value = stack.pop()
        if id(value) in seen or id(value) in skip:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                found.append(value)
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            try:
                stack.extend(vars(value).values())
            except TypeError:  # an object whose attributes are not a plain dict: nothing to copy there
                continue
    return found
