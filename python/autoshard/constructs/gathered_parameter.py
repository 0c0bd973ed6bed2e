"""Large parameters outside the layers, stored split over the ranks and gathered whole for each
call of the module holding them (nn/gathered_parameters.py): in a plan asked to gather what
cannot be paired, where holding them whole would leave a rank far more than its share."""

from dataclasses import dataclass

from torch import nn

from ..nn.gathered_parameters import gather_on_call
from ..nn.head_parameters import shard_head_parameter
from ..core.spec import ShardSpec
from .base import ParameterRecords, named_owner, register_records
from ..core.sealed import Sealed


@dataclass
class GatheredParameter(Sealed):
    """A large parameter outside the layers, stored split on dim `dim` (of global length `size`)
    and all-gathered whole where each call of the module holding it begins
    (nn/gathered_parameters.py): one all-gather of `elements` elements per call, none in backward.
    `module`: where the module holding it is never called and its parent's forward reads it
    itself (a position table interpolated), the module whose call gathers it; "" for its own."""

    name: str
    dim: int
    size: int
    elements: int
    module: str = ""


@register_records
class GatheredParameterConstruct(ParameterRecords):
    kind = "gathered_parameter"
    fields = {"gathered_parameters": GatheredParameter}
    order = 25
    printout_order = 50
    how = "to gather it whole for each call of its module"
    said = "parameters stored split and gathered whole for each call of their module (one all-gather each in forward)"

    def read(self, answer, reading):
        return {"gathered_parameters": [
            GatheredParameter(reading.names[p["param"]], p["axis"], p["size"], p["elements"],
                              reading.graph.gather_calls.get(p["param"], ""))
            for p in answer.get("gathered_params", [])]}

    @staticmethod
    def spec(plan, record, rank: int) -> ShardSpec:
        return ShardSpec(record.dim, record.size, rank, plan.world_size)

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
            caller = model.get_submodule(record.module) if record.module else owner
            gather_on_call(caller, owner, attr, piece, spec, surgery.group.group_name, hooks)
