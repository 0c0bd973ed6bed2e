"""A meta copy of a model that shares no storage with it."""

import copy

import torch
from torch import nn

from .computed_tensors import computed_tensors


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
    for t in computed_tensors(model, memo):
        memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)
