"""DDP and a parallelized model: refused over the tensor-parallel ranks before its first
collective, and exact over the data-parallel ones.

DDP's constructor reads ``module._ddp_params_and_buffers_to_ignore`` (as ``set(...)``) once
its process group is chosen, before any collective. ``parallelize`` makes that attribute a
``DdpGuard``, which, iterated from there:

- refuses a DDP over two or more tensor-parallel ranks, leaving the model unchanged;
- refuses a DDP around a model that autoshard already averages over "dp" (the mesh path):
  its gradients would be averaged twice, and the pieces of partitioned state mixed;
- over data-parallel ranks, hands DDP the parameters whose partial gradients autoshard sums
  over the tensor-parallel ranks (norm weights under sequence parallelism) to leave alone,
  and has autoshard average them over DDP's group itself. DDP would otherwise average each
  rank's partial gradient and, at the end of backward, write that over autoshard's sum.

A DDP around a module that holds the model never reads the model's attribute: the forward
check (wrapper_check) applies the same rules to it, refusing where the guard would have made
it exact.
"""

import sys
from typing import Iterable, List, Optional, Set, Tuple

from torch import nn

from ..conventions.data_parallel_wrappers import (DDP, already_averaged, ranks_of, refusal, spans_tensor_parallel,
                                                  wrapper_types)
from ..core.parallel_state import ParallelState, state_of


def partial_gradient_names(model: nn.Module, state: ParallelState) -> List[str]:
    """The names of the parameters whose gradients autoshard sums over the tensor-parallel ranks."""
    reducer = state.partial_gradients
    ids = {id(p) for bucket in (reducer.buckets if reducer else ()) for p in bucket.params}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def _already_averaged(ddp_ranks: Set[int]) -> ValueError:
    return already_averaged(DDP, ddp_ranks, "Drop the DDP wrapper, or parallelize over the tensor-parallel group alone "
                            "(parallelize(model, mesh=mesh['tp'])) and wrap the model in DDP over mesh.get_group('dp')")


def check_over_data_parallel(ddp_ranks: Set[int], model: nn.Module, state: ParallelState) -> None:
    """At a forward under a DDP over data-parallel ranks: raises where the DDP is not exact."""
    if state.data_parallel_group is not None:
        raise _already_averaged(ddp_ranks)
    names = partial_gradient_names(model, state)
    reducer = state.partial_gradients
    if names and ranks_of([reducer.dp_group]) != ddp_ranks:
        raise ValueError(
            f"autoshard: {DDP} over ranks {sorted(ddp_ranks)} wraps a parallelized model whose parameters {names} "
            "receive partial gradients that autoshard sums over the tensor-parallel ranks (sequence parallelism), "
            "and DDP would write its average of the unsummed ones over them. Wrap the parallelized model itself, "
            "leaving the _ddp_params_and_buffers_to_ignore that parallelize set on it, so that autoshard averages "
            "those parameters over DDP's group (DistributedDataParallel(model, process_group=mesh.get_group('dp'))"
            "), or parallelize with sequence_parallel=False")


def _constructing_ddp(frame) -> Optional[Tuple[object, Optional[nn.Module]]]:
    """(the DDP being constructed, the module it wraps) when `frame` is, or is just below,
    DistributedDataParallel.__init__; else None."""
    ddp_type = wrapper_types()[0]
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__":
            local = frame.f_locals
            owner = local.get("self")
            if isinstance(owner, ddp_type) and getattr(owner, "process_group", None) is not None:
                return owner, local.get("module")
        frame = frame.f_back
    return None


class DdpGuard:
    """A parallelized model's ``_ddp_params_and_buffers_to_ignore``: the names it held before
    (if any), and, read by DDP's constructor, the checks and setup above."""

    def __init__(self, names: Iterable[str] = ()):
        self.names = list(names)

    def __iter__(self):
        found = _constructing_ddp(sys._getframe(1))
        state = state_of(found[1]) if found is not None and isinstance(found[1], nn.Module) else None
        if state is None or state.group is None:
            return iter(self.names)
        ddp, model = found
        ddp_ranks, tp_ranks = ranks_of([ddp.process_group]), ranks_of([state.group])
        if spans_tensor_parallel(ddp_ranks, tp_ranks):
            raise refusal(DDP, ddp_ranks, sorted(tp_ranks),
                          "it was refused before its first broadcast, and the model is unchanged")
        if state.data_parallel_group is not None:
            raise _already_averaged(ddp_ranks)
        partial = partial_gradient_names(model, state)
        if partial:
            state.partial_gradients.dp_group = ddp.process_group
        return iter(self.names + [name for name in partial if name not in self.names])

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"DdpGuard({self.names})"


def install_ddp_guard(model: nn.Module) -> None:
    model._ddp_params_and_buffers_to_ignore = DdpGuard(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
