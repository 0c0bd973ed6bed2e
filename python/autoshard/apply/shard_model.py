"""A plan applied to a model in place: every planned layer swapped for its sharded construct
(tied parameters kept one), the record constructs applied, the regions' integer attributes
and view sizes made local. parallelize() calls it on the model, the dry run and the memory
prediction on a meta copy."""

from collections import Counter
from typing import Dict

import torch
from torch import nn

from ..constructs import LayerSurgery, Surgery, record_constructs
from ..constructs.summed_output import keep_input
from ..core.distributed import ProcessGroup
from ..core.module_attributes import set_attribute
from ..nn import sequence
from ..nn.input_copies import InputCopyPerCall, SharedInputCopy
from ..nn.view_sizes import ViewSizeHooks, region_view_sizes
from .replaced_modules import check_no_hooks_lost


def check_plan_fits(model: nn.Module, plan, world_size: int) -> None:
    if plan.world_size != world_size:
        raise ValueError(f"parallelize: the plan was made for world_size={plan.world_size}, "
                         f"but the group has {world_size} ranks")
    params = dict(model.named_parameters(remove_duplicate=False))
    for layer in plan.layers:
        try:
            module = layer.construct.module_of(model, layer)
        except AttributeError:
            raise ValueError(f"parallelize: the plan names layer {layer.module!r}, which the model lacks") from None
        weight = layer.construct.weight_of(module, layer)
        if not isinstance(weight, torch.Tensor) or list(weight.shape) != list(layer.weight_shape):
            got = None if weight is None else list(weight.shape)
            raise ValueError(f"parallelize: layer {layer.module!r} has weight shape {got}, "
                             f"the plan expects {layer.weight_shape}")
        if hasattr(module, "shard_specs"):
            raise ValueError(f"parallelize: layer {layer.module!r} is already sharded")
        if layer.weight not in params:
            raise ValueError(f"parallelize: the plan names parameter {layer.weight!r}, which the model lacks")
    for construct in record_constructs():
        construct.check(model, plan, params)
    check_no_hooks_lost(model, plan)


def _input_copy(calls, copies, tokens, group_name: str):
    """A column layer's input copy, from the plan's records of its calls: its group's shared
    copy, its gather of the tokens, or None (a copy of its own); one of those per call where
    its calls read tensors of different copy groups."""
    def of(layer):
        if layer.copy_group in copies:
            return copies[layer.copy_group]
        if layer.sequence.gathers:
            return tokens.gathers[layer.copy_group]
        return None

    if len({layer.copy_group for layer in calls}) > 1:
        return InputCopyPerCall(group_name, [of(layer) for layer in calls])
    return of(calls[0])


def apply_plan(model: nn.Module, plan, group: ProcessGroup) -> sequence.PlanSteps:
    """Shards `model` in place by `plan` for `group`'s rank: layers swapped for their sharded
    constructs, records applied, integer attributes and view sizes made local. Returns the
    sequence-parallel steps the forward hooks take."""
    rank, world = group.rank(), group.size()
    users = Counter(layer.copy_group for layer in plan.layers if layer.style.is_column)
    tokens = sequence.steps(plan, group.group_name)
    copies = {g: SharedInputCopy(group.group_name, n, tokens.gathers.get(g)) for g, n in users.items() if n > 1}
    # Every place a parameter is registered, so that tied parameters (an embedding shared with
    # the output head, a head's bias also held by its parent) stay one parameter once sharded.
    registrations: Dict[int, list] = {}
    for owner in model.modules():
        for attr, param in owner._parameters.items():
            if param is not None:
                registrations.setdefault(id(param), []).append((owner, attr))
    replaced: Dict[int, nn.Parameter] = {}
    modules: Dict[str, list] = {}  # a module -> the plan's entries of it (one per call or side), in order
    for layer in plan.layers:
        modules.setdefault(layer.module, []).append(layer)
    taken = {name for layers in modules.values() for name in layers[0].construct.sharded_with(layers)}
    surgery = LayerSurgery(model, plan, group, tokens, lambda calls: _input_copy(calls, copies, tokens, group.group_name),
                           keep_input, copies, replaced, taken)
    for layers in modules.values():
        layers[0].construct.shard_module(layers, surgery)
    for key, new in replaced.items():
        for owner, attr in registrations.get(key, []):
            if not hasattr(owner, "shard_specs"):
                owner._parameters[attr] = new
    records = Surgery(group, rank, world, tokens, registrations)
    for construct in record_constructs():
        construct.apply(model, plan, records)
    for region in plan.regions.values():
        owner = model.get_submodule(region.module)
        for attr in region.attributes:
            set_attribute(owner, attr, region.local_attribute(attr, rank, world))
        if region.view_sizes:
            owner.autoshard_view_sizes = ViewSizeHooks(owner, region_view_sizes(region, rank, world))
    return tokens

