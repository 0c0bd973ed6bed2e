"""Sequence parallelism's cuts at module boundaries: where a module receives a tensor held
whole inside a sequence region, it is cut to this rank's tokens (``sequence_entries``); where a
module's own column layers need every token (an attention reading its input's length), they are
gathered as it receives them (``sequence_gathers``) or as a module returns them
(``sequence_exits``, for column layers reading them through ops that index the tokens). The
planner decides the regions (csrc/plan/sequence.cpp); a row layer's reduce-scatter and a column
layer's gather are part of the layers' own sharding (nn/sequence.py)."""

from dataclasses import dataclass
from typing import Dict, List

from .base import RecordConstruct, planned_module, register_records
from ..core.sealed import Sealed


@dataclass
class TokenCut(Sealed):
    """Sequence parallelism where a module receives (or returns) a tensor: the tensor at `leaf`
    among the call's flattened inputs, its tokens on axis `dim`, cut to this rank's tokens or
    gathered (see nn/sequence.py)."""

    module: str
    leaf: int
    dim: int
    region: int


def sequence_regions(plan) -> Dict[int, Dict[str, List[str]]]:
    """Each sequence region's modules by role: {"reduce_scatter": [...], "gather": [...], "entry": [...]}."""
    regions: Dict[int, Dict[str, List[str]]] = {}
    empty = lambda: {"reduce_scatter": [], "gather": [], "gathered": [], "entry": []}
    for layer in plan.layers:
        if layer.sequence:
            regions.setdefault(layer.sequence_region, empty())[layer.sequence].append(layer.module)
    for entry in plan.sequence_entries:
        regions.setdefault(entry.region, empty())["entry"].append(entry.module)
    for entry in plan.sequence_gathers:
        regions.setdefault(entry.region, empty())["gather"].append(entry.module)
    for entry in plan.sequence_exits:
        regions.setdefault(entry.region, empty())["gather"].append(f"the output of {entry.module}")
    for roles in regions.values():
        roles.pop("gathered", None)
    return regions


@register_records
class SequenceCut(RecordConstruct):
    kind = "sequence"
    fields = {"sequence_entries": TokenCut, "sequence_gathers": TokenCut, "sequence_exits": TokenCut}
    order = 30
    printout_order = 60

    def read(self, answer, reading):
        cut = lambda e: TokenCut(e["module"], e["leaf"], e["dim"], e["region"])
        return {field: [cut(e) for e in answer[field]] for field in self.fields}

    def printout(self, plan, printing):
        lines = [f"  {plan.sequence_choice}"] if plan.sequence_choice else []
        listed = printing.listed
        for region, roles in sorted(sequence_regions(plan).items()):
            cut = f"; cut on entering {listed(roles['entry'])}" if roles["entry"] else ""
            lines.append(f"  sequence parallel (tokens split over the ranks): after {listed(roles['reduce_scatter'])}"
                         f"{cut}; gathered before {listed(roles['gather'])}")
        # A note that names its own layer's modules folds with the layer: the name becomes a mark.
        mark = "\0"
        folded = printing.fold([(layer.module, layer.sequence_note.replace(layer.module, mark))
                                for layer in plan.layers if layer.sequence_note])
        refused: Dict[str, List[str]] = {}
        for module, _, note in folded:
            if mark in note:
                lines.append(f"  tokens held whole after {module}: {note.replace(mark, module)}")
            else:
                refused.setdefault(note, []).append(module)
        for note, modules in refused.items():
            lines.append(f"  tokens held whole after {listed(modules)}: {note}")
        return lines

    def check(self, model, plan, params) -> None:
        for entry in self.records(plan):
            planned_module(model, entry.module, "cuts the tokens of a tensor at module")

    def apply(self, model, plan, surgery) -> None:
        tokens = surgery.tokens
        for entry in plan.sequence_entries:
            model.get_submodule(entry.module).register_forward_pre_hook(tokens.entry_hook(entry), with_kwargs=True)
        for entry in plan.sequence_gathers:
            model.get_submodule(entry.module).register_forward_pre_hook(tokens.entry_hook(entry, gather=True),
                                                                           with_kwargs=True)
        for entry in plan.sequence_exits:
            model.get_submodule(entry.module).register_forward_hook(tokens.exit_hook(entry))
