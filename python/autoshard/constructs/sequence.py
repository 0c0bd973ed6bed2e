"""Sequence parallelism's cuts at module boundaries: where a module receives a tensor held
whole inside a sequence region, it is cut to this rank's tokens (``sequence_entries``); where a
module's own column layers need every token (an attention reading its input's length), they are
gathered as it receives them (``sequence_gathers``) or as a module returns them
(``sequence_exits``, for column layers reading them through ops that index the tokens). The
planner decides the regions (csrc/plan/sequence.cpp); a row layer's reduce-scatter and a column
layer's gather are part of the layers' own sharding (nn/sequence.py)."""

from .base import RecordConstruct, register_records


@register_records
class SequenceCut(RecordConstruct):
    kind = "sequence"
    fields = ("sequence_entries", "sequence_gathers", "sequence_exits")
    order = 30

    def check(self, model, plan, params) -> None:
        for entry in self.records(plan):
            try:
                model.get_submodule(entry.module)
            except AttributeError:
                raise ValueError(f"parallelize: the plan cuts the tokens of a tensor at module {entry.module!r}, "
                                 "which the model lacks") from None

    def apply(self, model, plan, surgery) -> None:
        tokens = surgery.tokens
        for entry in plan.sequence_entries:
            model.get_submodule(entry.module).register_forward_pre_hook(tokens.entry_hook(entry), with_kwargs=True)
        for entry in plan.sequence_gathers:
            model.get_submodule(entry.module).register_forward_pre_hook(tokens.entry_hook(entry, gather=True),
                                                                           with_kwargs=True)
        for entry in plan.sequence_exits:
            model.get_submodule(entry.module).register_forward_hook(tokens.exit_hook(entry))
