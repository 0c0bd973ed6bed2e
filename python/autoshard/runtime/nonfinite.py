"""Agreeing across the tensor-parallel ranks on which replicated gradients are not finite,
before autoshard's optimizers step.

Every tensor-parallel rank holds the whole of a replicated parameter (a norm's weight, a row
layer's bias) and steps its own copy. Healthy ranks compute bitwise equal gradients for it, so
the copies stay equal. A gradient that is not finite (nan or inf) on one rank only (a fault on
that rank, a rank-dependent loss term) would step that rank's copy alone into nan, and the
ranks would go on computing different models.

Where the ranks already agree, nothing is added:
- a replicated parameter read inside a sharded region has its partial gradients summed over
  the group during backward (runtime/partial_gradients.py): a non-finite part reaches every rank;
- ``clip_grad_norm_`` carries a non-finite replicated gradient of one rank into the norm it
  all-reduces, so every rank scales by the same non-finite factor.

For the other replicated parameters, at the end of each backward pass that gave one of them a
gradient, each rank counts the non-finite elements of each such gradient and the ranks take
the maximum and the minimum of every count in one all-reduce of 2 integers per parameter
(``record``). The collective runs in backward, which every rank runs, and not in
``opt.step()``: a rank that skips a step must not leave the others waiting in a collective
(the replica fingerprint names it). ``opt.step()`` then reads the agreed counts
(``check_before_step``): where a parameter's count differs between ranks it raises on every
rank, naming the parameter, before anything is stepped; where the counts agree (all finite, or
the same non-finite gradient on every rank) it steps as torch.optim does. ``zero_grad()``
forgets the counts.

Gradients that FSDP holds (DTensor pieces, fully_shard over "dp") are left to FSDP's own
reduction and are not counted here. A gradient changed on one rank after backward and before
``opt.step()`` without ``clip_grad_norm_`` is not seen by the other ranks; the replica
fingerprint finds the copies that differ afterwards.
"""

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .fully_sharded import is_dtensor
from .input_check import _wire_device
from ..core.parallel_state import ParallelState, parameter_state
from ..core.stalls import named

_ATTRIBUTE = "nonfinite_agreement"  # the ParallelState's attribute holding its Agreement
_NOTHING_TO_AGREE = object()  # that attribute's value where no replicated gradient needs one


class Agreement:
    """The hooks on one parallelized model's replicated parameters, and the counts the ranks
    last agreed on."""

    def __init__(self, state: ParallelState, params: List[Tuple[str, torch.nn.Parameter]]) -> None:
        self.state = weakref.ref(state)
        self.group = state.group
        self.names = [name for name, _ in params]
        self.params = [p for _, p in params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # [2, n] int64 after a backward: each count's maximum and minimum over the ranks.
        self.agreed: Optional[torch.Tensor] = None
        self.backwards = 0  # backward passes agreed on so far (named in stall errors)
        self._queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.params]

    def _arrived(self, param: torch.nn.Parameter) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.record)

    def record(self) -> None:
        """At the end of a backward pass: the ranks' non-finite counts, agreed (a collective)."""
        self._queued = False
        device = _wire_device(self.group, self.params[0].device)
        with torch.no_grad():
            counts = torch.stack([torch.zeros((), dtype=torch.int64, device=p.device) if p.grad is None
                                  else torch.isfinite(p.grad).logical_not_().sum() for p in self.params])
            both = torch.cat([counts, -counts]).to(device)
        with named("the non-finite gradient check's all-reduce", self.group, self.backwards):
            dist.all_reduce(both, dist.ReduceOp.MAX, group=self.group)
        self.backwards += 1
        n = len(self.params)
        self.agreed = torch.stack([both[:n], -both[n:]])

    def check(self, stepped: List[torch.Tensor]) -> None:
        """Raises on every rank if a parameter in `stepped` had a gradient whose non-finite count
        differed between the ranks at the last backward."""
        rows = [self.index[id(p)] for p in stepped if id(p) in self.index]
        if self.agreed is None or not rows:
            return
        picked = self.agreed[:, rows].cpu()  # the one wait for the device in a step
        differs = (picked[0] != picked[1]).nonzero().view(-1).tolist()
        if not differs:
            return
        first = rows[differs[0]]
        agreed = self.agreed.cpu()
        ranks = dist.get_process_group_ranks(self.group)
        raise RuntimeError(
            f"autoshard: the gradient of the replicated parameter {self.names[first]!r} is not finite on some of "
            f"the tensor-parallel ranks {ranks} and finite on others (between {int(agreed[1, first])} and "
            f"{int(agreed[0, first])} non-finite elements; {len(differs)} replicated parameter(s) differ): "
            "stepping would leave the ranks with different copies. Nothing was stepped, on any rank. A fault "
            "on one rank, or a loss term that differs between ranks, gives such gradients; call zero_grad() "
            "and run the step again, or stop")

    def forget(self) -> None:
        self.agreed = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _replicated(state: ParallelState) -> List[Tuple[str, torch.nn.Parameter]]:
    """The model's trainable replicated parameters that no collective of backward already sums."""
    model = state.model
    if model is None:
        return []
    sharded = set(state.shards())
    reducer = state.partial_gradients
    summed = {id(p) for bucket in (reducer.buckets if reducer else ()) for p in bucket.params}
    return [(name, p) for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in sharded and id(p) not in summed and not is_dtensor(p)]


def agreements_for(params: List[torch.Tensor]) -> List[Agreement]:
    """The agreements of the parallelized models that `params` belong to, installed on first use
    (once per model; on models sharded over more than one rank)."""
    found: Dict[int, Agreement] = {}
    for p in params:
        state = parameter_state(p)
        if state is None or id(state) in found:
            continue
        group = state.group
        if group is None or not dist.is_initialized() or group.size() < 2:
            continue
        agreement = getattr(state, _ATTRIBUTE, None)
        if agreement is None:
            # Found once, like the parameters an Agreement holds: the search walks the whole
            # model, and optimizers ask on every step.
            replicated = _replicated(state)
            agreement = Agreement(state, replicated) if replicated else _NOTHING_TO_AGREE
            setattr(state, _ATTRIBUTE, agreement)
        if agreement is not _NOTHING_TO_AGREE:
            found[id(state)] = agreement
    return list(found.values())
