"""Replicated layers whose output's gradient is a partial sum on every rank
(``ShardingPlan.summed_outputs``, csrc/plan/gradients.cpp): multi-head latent attention's
kv_a_proj, whose output feeds the column layer kv_b_proj and, as k_pe, a key part broadcast to
the rank's heads. Each reader's gradient is this rank's part, so the sum over the ranks is taken
once, where the layer returns its output (identity forward, all-reduce in backward), and the
column layers reading it (``LayerPlan.deferred_copy``) copy their input without summing."""

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..core import ops
from .base import RecordConstruct, register_records
from ..core.sealed import Sealed


@dataclass
class SummedOutput(Sealed):
    """A replicated layer whose output's gradient is partial on every rank (MLA's compressed kv
    and k_pe, read by a column layer and by the split heads): all-reduced in backward where the
    layer returns it, while the column layers reading it (LayerPlan.deferred_copy) sum nothing."""

    module: str
    elements: int


def keep_input(x: torch.Tensor) -> torch.Tensor:
    """A deferred column layer's input copy: the gradient it passes back stays this rank's part,
    summed where the replicated layer upstream returns its output."""
    return x


class _SumGradientOnReturn:
    def __init__(self, group_name: str):
        self.group_name = group_name

    def __call__(self, module: nn.Module, args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"parallelize: {type(module).__name__} returns {type(output).__name__}; the plan sums "
                            "the gradient of the one tensor it returns")
        return ops.copy_to_parallel(output, self.group_name)


@register_records
class SummedOutputConstruct(RecordConstruct):
    kind = "summed_output"
    fields = {"summed_outputs": SummedOutput}
    order = 30
    # After the partial gradients (planner/printout.py).
    printout_order = 80

    def read(self, answer, reading):
        return {"summed_outputs": [SummedOutput(reading.graph.layers[s["node"]].name, s["elements"])
                                   for s in answer.get("summed_outputs", [])]}

    def printout(self, plan, printing):
        if not plan.summed_outputs:
            return []
        deferred = [layer.module for layer in plan.layers if layer.deferred_copy]
        return [f"  output gradients summed where their layer returns them (one all-reduce each in backward): "
                f"{', '.join(printing.fold_names([r.module for r in plan.summed_outputs]))}; the column layers "
                f"reading them sum nothing themselves: {', '.join(printing.fold_names(deferred))}"]

    def check(self, model, plan, params) -> None:
        names = dict(model.named_modules())
        for record in plan.summed_outputs:
            if record.module not in names:
                raise ValueError(f"parallelize: the plan sums the output gradient of module {record.module!r}, "
                                 "which the model lacks")

    def apply(self, model, plan, surgery) -> None:
        if not plan.summed_outputs:
            return
        hook = _SumGradientOnReturn(surgery.group.group_name)
        for record in plan.summed_outputs:
            model.get_submodule(record.module).register_forward_hook(hook)
        model.register_forward_pre_hook(_HooksInPlace(model, [r.module for r in plan.summed_outputs], hook))


class _HooksInPlace:
    """Refuses a forward once a module whose output gradient the plan sums has been replaced (a
    tool swapping Linear layers after parallelize) or lost the hook that sums it: its readers would
    get this rank's part of the gradient only, a silently wrong result."""

    def __init__(self, model: nn.Module, names, hook: _SumGradientOnReturn):
        self.modules = [(name, weakref.ref(model.get_submodule(name))) for name in names]
        self.hook = hook

    def __call__(self, model: nn.Module, args) -> None:
        for name, original in self.modules:
            try:
                current = model.get_submodule(name)
            except AttributeError:
                current = None
            if current is not original() or not any(h is self.hook for h in current._forward_hooks.values()):
                raise RuntimeError(
                    f"autoshard: module {name!r} was replaced, or its forward hook removed, after parallelize; the "
                    "plan sums the gradient of its output in that hook (its readers each get this rank's part), so "
                    "the gradients would be wrong. Change the model before parallelize, or keep this module as "
                    "parallelize left it")
