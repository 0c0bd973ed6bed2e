"""Parameters over the attention heads split with them: a per-head scale, or a bias of
all_head_size added to the query or value heads (DeBERTa's q_bias and v_bias). The planner
finds them from the dataflow, meeting the heads-sharded attention only in elementwise ops
(csrc/plan/constructs/head_params.cpp); each rank keeps its heads' slice as a local parameter of the same
module, under the same name (nn/head_parameters.py), with no collective."""

import dataclasses
from dataclasses import dataclass, field
from typing import List

import torch
from torch import nn

from ..nn.head_parameters import shard_head_parameter
from ..core.spec import ShardSpec
from .base import ParameterRecords, named_owner, register_records
from ..core.sealed import Sealed


@dataclass
class HeadParameter(Sealed):
    """A parameter over the heads split with them: dim `dim` of global length `size`. With
    `layer` (a fused layer's module name), split part by part as that layer's output features
    are: a depthwise convolution's taps over fused q/k/v channels."""

    name: str
    dim: int
    size: int
    region: int
    layer: str = ""
    # Or the parts of a concatenation of split layer outputs (q, k and v of separate projections
    # joined for one convolution), each split like the region.
    parts: List[int] = field(default_factory=list)


@register_records
class HeadParameterConstruct(ParameterRecords):
    kind = "head_parameter"
    fields = {"head_parameters": HeadParameter}
    order = 20
    printout_order = 40
    how = "with its heads"
    said = "parameters split with their heads"

    def read(self, answer, reading):
        layer = lambda p: reading.graph.layers[p["layer"]].name if p.get("layer", -1) >= 0 else ""
        return {"head_parameters": [HeadParameter(reading.names[p["param"]], p["axis"], p["size"], p["region"],
                                                  layer(p), list(p.get("parts", [])))
                                    for p in answer.get("head_params", [])]}

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
