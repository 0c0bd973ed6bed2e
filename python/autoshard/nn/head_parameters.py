"""Parameters over the attention heads split with them (``ShardingPlan.head_parameters``): a
per-head scale, or a bias of all_head_size added to the query or value heads (DeBERTa's
``q_bias`` and ``v_bias``), that the plan found meeting the heads-sharded attention only in
elementwise ops (csrc/plan/constructs/head_params.cpp).

Each rank keeps the slice for its heads as a plain local parameter of the same module, under
the same name, recorded in the module's ``shard_specs``: loading, saving, gathering the full
state dict, clipping and the optimizers read it there like a layer's. Its gradient comes from
this rank's heads only and is exact as it is: no collective.
"""

from typing import Optional

import torch
from torch import nn

from ..core.spec import ShardSpec

# The attribute naming a module's shard_specs entries that are head parameters (or gathered
# parameters: nn/gathered_parameters.py), so that a module holding only those (an attention
# module, a vision tower's embeddings, not a layer) is still traced op by op.
HEAD_PARAMETERS = "head_parameters"


def holds_only_head_parameters(module: nn.Module) -> bool:
    """Whether every parameter `module` records in shard_specs is a head parameter."""
    specs = getattr(module, "shard_specs", None)
    return specs is not None and set(specs) <= set(getattr(module, HEAD_PARAMETERS, ()))


def shard_head_parameter(owner: nn.Module, attr: str, spec: ShardSpec, group: Optional[object],
                         what: str = "head parameter") -> nn.Parameter:
    """Replaces `owner`'s parameter `attr` with the slice `spec` gives this rank (an empty meta
    tensor of its local shape for a parameter on meta) and records it; returns the new parameter.
    `what` names the kind of parameter in errors."""
    full = owner._parameters.get(attr)
    if not isinstance(full, torch.Tensor):
        raise ValueError(f"{what}: module {type(owner).__name__} has no parameter {attr!r}")
    if full.dim() <= spec.dim or full.shape[spec.dim] != spec.full_size:
        raise ValueError(f"{what}: {attr!r} has shape {tuple(full.shape)}, the plan expects {spec.full_size} "
                         f"on dim {spec.dim}")
    if full.device.type == "meta":
        local = torch.empty(spec.local_shape(full.shape), dtype=full.dtype, device="meta")
    else:
        local = spec.take_owned(full)
    if getattr(owner, "group", None) not in (None, group):
        raise ValueError(f"{what}: module {type(owner).__name__} already has an attribute 'group' "
                         f"({owner.group!r}), where autoshard records the process group of its parameter {attr!r}")
    param = nn.Parameter(local, requires_grad=full.requires_grad)
    owner._parameters[attr] = param
    if not hasattr(owner, "shard_specs"):
        owner.shard_specs = {}
    owner.shard_specs[attr] = spec
    setattr(owner, HEAD_PARAMETERS, tuple(getattr(owner, HEAD_PARAMETERS, ())) + (attr,))
    owner.group = group
    return param
