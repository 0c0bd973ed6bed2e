"""The tensors of a (possibly parallelized) model that a checkpoint fills, with the part of
the full tensor each one holds on this rank."""

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from ..nn.spec import sharded_parameters
from .selection import Selection, selection_of


@dataclass
class Target:
    name: str  # the first name the module tree gives it
    tensor: torch.Tensor  # the local tensor (a Parameter or a buffer; may be on meta)
    selection: Selection  # which part of the full tensor it holds
    is_parameter: bool
    aliases: List[str] = field(default_factory=list)  # every name of a tied tensor, `name` first


def model_targets(model: torch.nn.Module, persistent_only: bool = True) -> Dict[str, Target]:
    """Name -> Target for every parameter and (persistent) buffer, tied tensors once."""
    specs = sharded_parameters()
    targets: Dict[str, Target] = {}
    by_id: Dict[int, Target] = {}

    def add(name: str, tensor: torch.Tensor, is_parameter: bool) -> None:
        if id(tensor) in by_id:
            by_id[id(tensor)].aliases.append(name)
            return
        spec = specs.get(id(tensor), (None, None))[0] if is_parameter else None
        full_shape = spec.full_shape(tensor.shape) if spec is not None else tuple(tensor.shape)
        target = Target(name, tensor, selection_of(spec, full_shape), is_parameter, [name])
        targets[name] = by_id[id(tensor)] = target

    for name, param in model.named_parameters(remove_duplicate=False):
        add(name, param, True)
    for module_name, module in model.named_modules(remove_duplicate=False):
        skipped = getattr(module, "_non_persistent_buffers_set", set()) if persistent_only else set()
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in skipped:
                add(f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer, False)
    return targets
