"""A meta copy of a model that shares no storage with it, and the walk over the tensors an
object holds that both that copy and a replayed call's cache copy (meta_inputs) are made by."""

import copy
from typing import Iterator

import torch
from torch import nn


def tensors_within(value, skip=()) -> Iterator[torch.Tensor]:
    """The tensors held by `value` (in the containers and objects it holds, their attributes
    among them), each once; what `skip` holds the id of is not entered."""
    seen, stack = set(), [value]
    while stack:
        value = stack.pop()
        if id(value) in seen or id(value) in skip:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            try:
                stack.extend(vars(value).values())
            except TypeError:  # an object whose attributes are not a plain dict: nothing to copy there
                continue


def meta_shadow(model: nn.Module, always_copy: bool = False) -> nn.Module:
    """The model itself if it is already on meta (unless always_copy), else a meta copy that
    shares no storage with it."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not always_copy and all(t.device.type == "meta" for t in tensors):
        return model
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    # Tensors an autograd graph computed (a weight that torch.nn.utils.weight_norm recomputes in
    # each forward, a tensor a forward left behind): torch cannot deepcopy them; the copy holds
    # them detached (its forward computes them again, on meta).
    for t in [t for t in tensors_within(model, memo) if t.grad_fn is not None]:
        memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)
