"""Large parameters outside the layers, stored split over the ranks and gathered whole for each
call of the module holding them (nn/gathered_parameters.py): in a plan asked to gather what
cannot be paired, where holding them whole would leave a rank far more than its share."""

from typing import Dict

from torch import nn

from ..nn.gathered_parameters import gather_on_call
from ..nn.head_parameters import shard_head_parameter
from ..nn.spec import ShardSpec
from .base import RecordConstruct, named_owner, register_records


@register_records
class GatheredParameter(RecordConstruct):
    kind = "gathered_parameter"
    fields = ("gathered_parameters",)
    order = 25

    @staticmethod
    def spec(plan, record, rank: int) -> ShardSpec:
        return ShardSpec(record.dim, record.size, rank, plan.world_size)

    def specs(self, plan, rank: int) -> Dict[str, ShardSpec]:
        return {record.name: self.spec(plan, record, rank) for record in plan.gathered_parameters}

    def check(self, model, plan, params) -> None:
        for record in plan.gathered_parameters:
            param = params.get(record.name)
            if param is None or param.dim() <= record.dim or param.shape[record.dim] != record.size:
                got = None if param is None else list(param.shape)
                raise ValueError(f"parallelize: the plan stores parameter {record.name!r} split ({record.size} on dim "
                                 f"{record.dim}) and gathers it for each call; the model's has shape {got}")

    def stand_in(self, copy: nn.Module, prefix: str, plan, rank: int) -> None:
        # Inside a region's module the parameter is whole during the call, as the plan traced it.
        return None

    def apply(self, model, plan, surgery) -> None:
        hooks = []
        for record in plan.gathered_parameters:
            owner, attr = named_owner(model, record.name)
            original = owner._parameters[attr]
            if surgery.registrations.get(id(original), [(owner, attr)]) != [(owner, attr)]:
                raise ValueError(f"parallelize: parameter {record.name!r} is also registered elsewhere; the plan "
                                 "gathers it for the calls of one module only")
            spec = self.spec(plan, record, surgery.rank)
            piece = shard_head_parameter(owner, attr, spec, surgery.group, what="gathered parameter")
            gather_on_call(owner, attr, piece, spec, surgery.group.group_name, hooks)
