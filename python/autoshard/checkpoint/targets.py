"""The tensors of a (possibly parallelized) model that a checkpoint fills, with the part of
the full tensor each one holds on this rank."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..core.spec import ShardSpec, module_shards
from ..tensor_io import Selection, selection_of


@dataclass
class Target:
    name: str  # the first name the module tree gives it
    tensor: torch.Tensor  # the local tensor (a Parameter or a buffer; may be on meta)
    selection: Selection  # which part of the full tensor it holds
    is_parameter: bool
    aliases: List[str] = field(default_factory=list)  # every name of a tied tensor, `name` first
    spec: Optional[ShardSpec] = None

    def owned(self, local: torch.Tensor) -> Optional[Tuple[torch.Tensor, Selection]]:
        """The part of `local` (shaped like this target's tensor) that this rank saves, and its
        selection: all of it, except where several ranks hold the same KV heads, which the
        lowest-ranked holder saves; None when another rank saves all of it."""
        if self.spec is None or not self.spec.overlaps:
            return local, self.selection
        part = self.spec.owned_part(local)
        if part is None:
            return None
        runs = list(self.selection.runs)
        runs[self.spec.dim] = tuple(self.spec.owned_ranges())
        return part, Selection(self.selection.shape, tuple(runs))


def _refuse_fully_sharded(model: torch.nn.Module) -> None:
    # FSDP's DTensor of a tensor-parallel shard holds a piece the selections here do not describe.
    name = next((n for n, p in model.named_parameters() if hasattr(p, "device_mesh")), None)
    if name is not None:
        raise ValueError(f"autoshard.checkpoint and load_pretrained do not read or write a model under fully_shard "
                         f"({name!r} is FSDP's piece of a parameter). Save autoshard.full_state_dict(model) instead, "
                         "load weights before fully_shard, or use the mesh path without fully_shard, "
                         "parallelize(model, mesh=mesh)")


def model_targets(model: torch.nn.Module, persistent_only: bool = True) -> Dict[str, Target]:
    """Name -> Target for every parameter and (persistent) buffer, tied tensors once."""
    _refuse_fully_sharded(model)
    specs = module_shards(model.modules())
    targets: Dict[str, Target] = {}
    by_id: Dict[int, Target] = {}

    def add(name: str, tensor: torch.Tensor, is_parameter: bool) -> None:
        if id(tensor) in by_id:
            by_id[id(tensor)].aliases.append(name)
            return
        spec = specs.get(id(tensor), (None, None))[0] if is_parameter else None
        full_shape = spec.full_shape(tensor.shape) if spec is not None else tuple(tensor.shape)
        target = Target(name, tensor, selection_of(spec, full_shape), is_parameter, [name], spec)
        targets[name] = by_id[id(tensor)] = target

    for name, param in model.named_parameters(remove_duplicate=False):
        add(name, param, True)
    for module_name, module in model.named_modules(remove_duplicate=False):
        skipped = getattr(module, "_non_persistent_buffers_set", set()) if persistent_only else set()
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in skipped:
                add(f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer, False)
    return targets
