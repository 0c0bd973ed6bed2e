"""The forward collectives of the dry run, checked against the plan's.

The dry run calls the sharded copy of the model on meta tensors, where autoshard's collectives
issue nothing (and CommCounter, which counts in C++ where they are issued, sees none). The
ops themselves still pass the dispatcher: a dispatch mode counts them there, by kind, and
notes which planned layer was running. A layer that computes its output without reaching its
sharded counterpart's collective (an embedding subclass whose forward looks its local rows up
with F.embedding and sums nothing) changes no shape, so only this count can tell.
"""

from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.styles import Style

_autoshard = torch.ops.autoshard

# Each op's collectives in forward, by the kinds CommCounter reports.
FORWARD_KINDS = {
    _autoshard.reduce_from_parallel.default: "all_reduce",
    _autoshard.gather_from_parallel.default: "all_gather",
    _autoshard.reduce_scatter_to_sequence.default: "reduce_scatter",
    _autoshard.all_gather_from_sequence.default: "all_gather",
    _autoshard.all_reduce_.default: "all_reduce",
    _autoshard.all_gather_uneven.default: "all_gather",
    _autoshard.reduce_scatter_uneven.default: "reduce_scatter",
    _autoshard.all_reduce_bucket.default: "all_reduce",
    _autoshard.broadcast_.default: "broadcast",
}

# Planned styles whose sharded layer issues a collective on every call (unless its output is
# cut to this rank's tokens or gathered by sequence parallelism, which is a collective too).
_COLLECTIVE_STYLES = (Style.ROW, Style.VOCAB, Style.COLUMN_GATHER)


class ForwardCollectives(TorchDispatchMode):
    """Counts autoshard's forward collectives, and those issued inside each planned layer's call."""

    def __init__(self):
        super().__init__()
        self.counts: Dict[str, int] = {}
        self.by_layer: Dict[str, int] = {}
        self._running: List[str] = []
        self._handles = []

    def watch(self, model: nn.Module, names) -> "ForwardCollectives":
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue
            self.by_layer.setdefault(name, 0)
            self._handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._running.append(name)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))
        return self

    def _leave(self) -> None:  # a forward hook that returned something would replace the output
        self._running.pop()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = FORWARD_KINDS.get(func)
        if kind is not None and _elements(args[0] if args else None) > 0:  # the comm ops skip empty tensors
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if self._running:
                self.by_layer[self._running[-1]] += 1
        return func(*args, **(kwargs or {}))


def _elements(value) -> int:
    """The elements of a collective's tensor (of a bucket's tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_elements(v) for v in value)
    return 0


def watched_layers(plan) -> List[str]:
    """The modules of the planned layers whose sharded forward must issue a collective."""
    return sorted({layer.module for layer in plan.layers if layer.style in _COLLECTIVE_STYLES})


def silent_layers(plan, counter: ForwardCollectives) -> List[str]:
    """The watched layers that issued no collective in the forward counted."""
    return [name for name in watched_layers(plan) if counter.by_layer.get(name, 1) == 0]


def forward_mismatch(plan, counter: ForwardCollectives, model: nn.Module) -> Optional[str]:
    """Why the counted forward collectives differ from the plan's, naming the layers that issued
    none where their plan needs one; None when they agree."""
    predicted = plan.collectives("forward", training=model.training)
    if counter.counts == predicted:
        return None
    silent = []
    for name in silent_layers(plan, counter):
        try:
            module = model.get_submodule(name)
            cls = getattr(module, "autoshard_class", type(module)).__name__
        except AttributeError:
            cls = "?"
        silent.append((name, cls))
    text = f"its forward issues the collectives {counter.counts or {}} where the plan predicts {predicted}"
    if silent:
        named = ", ".join(f"{name!r} ({cls})" for name, cls in silent)
        overrides = {name: Style.REPLICATE.value for name, _ in silent}
        text += (f"; layer(s) {named} issued none where the plan needs one: their forward computes without the "
                 "sharded layer's collective (a forward of their own that bypasses their base class's); keep them "
                 f"whole with autoshard.plan(model, overrides={overrides})")
    return text
