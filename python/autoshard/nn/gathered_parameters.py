"""Large parameters outside the layers (``ShardingPlan.gathered_parameters``): a position
embedding held as a Parameter, experts the plan keeps whole. Each rank stores its piece of the
parameter on its longest axis, as a plain local parameter of the same module under the same name
(recorded in ``shard_specs``, so that loading, saving, clipping and the optimizers read it as a
layer's), and the parameter is all-gathered whole where each call of that module begins, and put
back to the piece where the call returns, as a fully sharded data-parallel parameter is.

The plan gathers only a parameter that every read of which lies inside its module's call and
computes on tensors held whole (csrc/plan/constructs/gathered_params.cpp): its gradient is then the same
on every rank, and the gather's backward keeps this rank's piece of it, with no collective.
"""

import threading
from typing import List, Tuple

import torch
from torch import nn

from ..core import ops
from ..core.spec import ShardSpec


# Per thread: > 0 while a GatherOnCall of this thread gathers, so that a trace skips those ops
# (the plan traced none) and a trace in another thread is not misled.
_gathering = threading.local()


def gathering() -> bool:
    """Whether a module's gathered parameters are being gathered now, in this thread (see GatherOnCall)."""
    return getattr(_gathering, "depth", 0) > 0


class GatherOnCall:
    """A module's forward pre-hook and forward hook: the gathered parameters read in its call
    whole for the call. Each is held by this module or by a submodule the model never calls,
    whose weight this module's forward reads itself (a position table interpolated)."""

    def __init__(self, module: nn.Module, group_name: str):
        self.module_id = id(module)
        self.group_name = group_name
        self.pieces: List[Tuple[nn.Module, str, nn.Parameter, ShardSpec]] = []
        self.depth = 0
        module.register_forward_pre_hook(self.gather)
        module.register_forward_hook(self.release, always_call=True)

    def gather(self, module: nn.Module, args) -> None:
        self.depth += 1
        if self.depth > 1:  # called again inside its own call: already whole
            return
        for owner, attr, piece, spec in self.pieces:
            if owner._parameters.get(attr) is not piece:
                self.depth -= 1
                raise RuntimeError(f"autoshard: parameter {attr!r} of {type(owner).__name__} was replaced after "
                                   "parallelize; the plan stores this rank's piece of it there and gathers it whole "
                                   f"for each call of {type(module).__name__}")
        _gathering.depth = getattr(_gathering, "depth", 0) + 1
        try:
            # Gradient mode on even under no_grad: the whole tensor requires a gradient as the
            # parameter does, so that ops choosing their path by it (matmul's folding, an
            # attention's fused path) take the path they take for the parameter.
            with torch.enable_grad():
                for owner, attr, piece, spec in self.pieces:
                    owner._parameters[attr] = ops.gather_from_parallel(piece, spec.dim, spec.full_size,
                                                                       self.group_name)
        finally:
            _gathering.depth -= 1

    def release(self, module: nn.Module, args, output) -> None:
        self.depth -= 1
        if self.depth == 0:
            for owner, attr, piece, _ in self.pieces:
                owner._parameters[attr] = piece


def gather_on_call(module: nn.Module, owner: nn.Module, attr: str, piece: nn.Parameter, spec: ShardSpec,
                   group_name: str, hooks: List[GatherOnCall]) -> None:
    """Has `module` gather the parameter `attr` of `owner` (itself or a submodule; stored as this
    rank's `piece`) for each of its calls, with one pair of hooks per module, kept in `hooks`."""
    hook = next((hook for hook in hooks if hook.module_id == id(module)), None)
    if hook is None:
        hook = GatherOnCall(module, group_name)
        hooks.append(hook)
    hook.pieces.append((owner, attr, piece, spec))
