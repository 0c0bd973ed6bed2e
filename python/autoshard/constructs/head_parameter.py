"""Parameters over the attention heads split with them: a per-head scale, or a bias of
all_head_size added to the query or value heads (DeBERTa's q_bias and v_bias). The planner
finds them from the dataflow, meeting the heads-sharded attention only in elementwise ops
(csrc/plan/head_params.cpp); each rank keeps its heads' slice as a local parameter of the same
module, under the same name (nn/head_parameters.py), with no collective."""

import dataclasses

import torch
from torch import nn

from ..nn.head_parameters import shard_head_parameter
from ..core.spec import ShardSpec
from .base import ParameterRecords, named_owner, register_records


@register_records
class HeadParameter(ParameterRecords):
    kind = "head_parameter"
    fields = ("head_parameters",)
    order = 20
    how = "with its heads"

    @staticmethod
    def spec(plan, record, rank: int) -> ShardSpec:
        """The ShardSpec on `rank` of a parameter split with its heads (with the parts of the
        fused layer it follows, as that layer's weight splits its output features)."""
        if record.layer:
            layer = plan.layer(record.layer).weight_spec(rank, plan.world_size)
            if layer.full_size != record.size:
                raise ValueError(f"parallelize: parameter {record.name!r} follows layer {record.layer!r}, whose "
                                 f"{layer.full_size} output features differ from its {record.size}")
            return dataclasses.replace(layer, dim=record.dim)
        if record.parts:
            return ShardSpec(record.dim, record.size, rank, plan.world_size, units=plan.regions[record.region].units,
                             parts=tuple(record.parts))
        return ShardSpec(record.dim, record.size, rank, plan.world_size, units=plan.regions[record.region].units)

    def stand_in(self, copy: nn.Module, prefix: str, plan, rank: int) -> None:
        for record in plan.head_parameters:
            if record.name.startswith(prefix):
                owner, attr = named_owner(copy, record.name[len(prefix):])
                full = owner._parameters[attr]
                local_shape = self.spec(plan, record, rank).local_shape(full.shape)
                owner._parameters[attr] = nn.Parameter(torch.empty(local_shape, dtype=full.dtype, device="meta"),
                                                       requires_grad=full.requires_grad)

    def apply(self, model, plan, surgery) -> None:
        for record in plan.head_parameters:
            owner, attr = named_owner(model, record.name)
            original = owner._parameters[attr]
            local = shard_head_parameter(owner, attr, self.spec(plan, record, surgery.rank), surgery.group)
            # Tied elsewhere (a head's bias also held by its parent): one parameter still.
            for other, other_attr in surgery.registrations.get(id(original), []):
                other._parameters[other_attr] = local
