"""Head cuts: a tensor held whole that a module adds to its heads-sharded attention scores (an
ALiBi bias passed to each attention) is cut to this rank's heads where the module receives it
(``head_entries``), and a replicated embedding whose embedding dim is the heads (T5's relative
position bias) has its output cut as it leaves the layer (``head_outputs``). The planner finds
both from the dataflow (csrc/plan/emit.cpp); the cuts themselves are nn/head_cuts.py."""

from dataclasses import dataclass

import torch
from torch import nn

from ..nn import head_cuts
from .base import RecordConstruct, planned_module, register_records
from ..core.sealed import Sealed


@dataclass
class HeadCut(Sealed):
    """A tensor held whole cut to this rank's heads: where a module receives it (its input at
    `leaf`: an ALiBi bias passed to each attention) or as an embedding's output leaves it (T5's
    relative position bias); the heads are the outer factor of axis `axis` ({outer, size})."""

    module: str
    axis: int
    outer: int
    size: int
    region: int
    leaf: int = 0


def _meta_cut(plan, entry, rank: int):
    """A function giving an empty meta tensor of `entry`'s cut shape on `rank`."""
    units = plan.regions[entry.region].units
    return lambda x: torch.empty(head_cuts.local_heads_shape(x.shape, entry, units, rank, plan.world_size),
                                 dtype=x.dtype, device="meta")


@register_records
class HeadCutConstruct(RecordConstruct):
    kind = "head_cut"
    fields = {"head_entries": HeadCut, "head_outputs": HeadCut}
    order = 40
    printout_order = 10

    def read(self, answer, reading):
        cut = lambda e: HeadCut(e["module"], e["axis"], e["outer"], e["size"], e["region"], e.get("leaf", 0))
        return {field: [cut(e) for e in answer.get(field, [])] for field in self.fields}

    def printout(self, plan, printing):
        lines = []
        if plan.head_entries:
            lines.append(f"  bias over the heads cut to each rank's heads on entering "
                         f"{printing.listed([e.module for e in plan.head_entries])}")
        if plan.head_outputs:
            lines.append(f"  output cut to each rank's heads as it leaves "
                         f"{printing.listed([e.module for e in plan.head_outputs])} (its gradient gathered back)")
        return lines

    def check(self, model, plan, params) -> None:
        for entry in self.records(plan):
            planned_module(model, entry.module, "cuts the heads of a tensor at module")

    def stand_in(self, copy: nn.Module, prefix: str, plan, rank: int) -> None:
        for entry in plan.head_outputs:
            if entry.module.startswith(prefix):
                cut = _meta_cut(plan, entry, rank)
                copy.get_submodule(entry.module[len(prefix):]).register_forward_hook(
                    lambda module, args, out, cut=cut: cut(out))

    def cut_inputs(self, plan, module: str, args, kwargs, rank: int):
        for entry in plan.head_entries:
            if entry.module == module:
                args, kwargs = head_cuts.cut_leaf(args, kwargs, entry.leaf, _meta_cut(plan, entry, rank), module)
        return args, kwargs

    def apply(self, model, plan, surgery) -> None:
        group_name = surgery.group.group_name
        for entry in plan.head_entries:
            model.get_submodule(entry.module).register_forward_pre_hook(
                head_cuts.entry_hook(entry, plan.regions[entry.region].units, group_name), with_kwargs=True)
        for entry in plan.head_outputs:
            model.get_submodule(entry.module).register_forward_hook(
                head_cuts.output_hook(entry, plan.regions[entry.region].units, group_name))
