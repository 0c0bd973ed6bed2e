"""Summing the partial gradients of replicated parameters over the tensor-parallel group.

A parameter that the plan replicates but that is read inside a sharded region (an RMSNorm
over head_dim applied to every head, a temperature, a replicated weight multiplying each
head) receives on each rank only the gradient of that rank's shard. The plan lists these
parameters in buckets (``ShardingPlan.partial_gradients``); during backward, once every
gradient of a bucket has been accumulated, the bucket's new contributions are summed over the
group with one all-reduce (a C++ op, counted by ``CommCounter``) and each gradient gets the
rest of its sum added. Only what this backward pass contributed is summed, so gradients
accumulated over several passes stay exact.

With data parallelism (a ("dp", "tp") mesh) the same bucket is then averaged over "dp" here
too, and these parameters are left out of the data-parallel averager.
"""

from typing import Dict, List, Optional

import torch

from ..core import comm, ops
from ..core.collective_buckets import CollectiveBucket


class PartialGradientReducer:
    """Hooks on `buckets` (lists of parameters) that sum their gradients over the group
    named `group_name` during backward, and average them over `dp_group` when given."""

    def __init__(self, buckets: List[List[torch.nn.Parameter]], group_name: str, dp_group=None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.group_name = group_name
        self.dp_group = dp_group
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self.buckets = [CollectiveBucket(list(params)) for params in buckets if params]
        # What each bucket has seen of this backward pass, by parameter index: what the pass
        # adds to each gradient, the gradient as it was before the pass (None: there was none;
        # the sum is added to it, as own + (sum - own) would round differently on each rank and
        # replicated parameters would drift apart), which gradients are in, and whether the
        # bucket was summed.
        self._contributions: List[Dict[int, torch.Tensor]] = [{} for _ in self.buckets]
        self._before: List[Dict[int, Optional[torch.Tensor]]] = [{} for _ in self.buckets]
        self._arrived = [set() for _ in self.buckets]
        self._done = [False] * len(self.buckets)
        self.names: List[str] = []  # the parameters' names in the model, when install() knows them
        self.handles = []
        self._finish_queued = False
        for b, bucket in enumerate(self.buckets):
            for index, p in enumerate(bucket.params):
                self.handles.append(p.register_hook(self._record(b, index, p)))
                self.handles.append(p.register_post_accumulate_grad_hook(self._arrived_hook(b, index)))

    def _record(self, b: int, index: int, param: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            # What this pass adds to the gradient, before it is accumulated.
            self._contributions[b][index] = grad.detach()
            if index not in self._before[b]:
                self._before[b][index] = None if param.grad is None else param.grad.detach().clone()

        return hook

    def _arrived_hook(self, b: int, index: int):
        def hook(param: torch.nn.Parameter) -> None:
            if not self._finish_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._finish_queued = True
            self._arrived[b].add(index)
            if len(self._arrived[b]) == len(self.buckets[b].params) and not self._done[b]:
                self._reduce(b)

        return hook

    def _sum_over_groups(self, pieces: List[torch.Tensor]) -> torch.Tensor:
        """The collective of these buckets: the sum over the tensor-parallel group (a C++ op,
        by group name), then over "dp"."""
        flat = torch.cat(pieces)
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        total = ops.reduce_from_parallel(flat, self.group_name)
        if self.dp_group is not None:
            total = total + 0  # a tensor of our own for the in-place collective
            comm.all_reduce_(total, "sum", self.dp_group)
        return total

    def _reduce(self, b: int) -> None:
        bucket, contributions, before = self.buckets[b], self._contributions[b], self._before[b]
        added = [contributions[i] if i in contributions else torch.zeros_like(p) for i, p in enumerate(bucket.params)]
        with torch.no_grad():
            bucket.launch(self._sum_over_groups, added)
            total = bucket.result(divide_by=None if self.dp_group is None else self.dp_group.size())
            for index, (p, piece) in enumerate(zip(bucket.params, bucket.split(total))):
                piece = piece.to(p.dtype)
                # A parameter with no gradient in this pass kept the one it had.
                held = before[index] if index in before else p.grad
                summed = piece if held is None else held + piece
                if p.grad is None:
                    p.grad = summed.clone() if summed is piece else summed
                else:
                    p.grad.copy_(summed)
        self._done[b] = True

    def _finish(self) -> None:
        # A bucket some of whose parameters got no gradient in this pass (on every rank alike)
        # is summed with zeros for them.
        for b in range(len(self.buckets)):
            if self._arrived[b] and not self._done[b]:
                self._reduce(b)
            self._contributions[b].clear()
            self._before[b].clear()
            self._arrived[b].clear()
            self._done[b] = False
        self._finish_queued = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def install(model: torch.nn.Module, buckets: List[Dict[str, object]], group_name: str,
            dp_group=None, reduce_dtype: Optional[torch.dtype] = None) -> Optional[PartialGradientReducer]:
    """Hooks the plan's partial-gradient buckets (parameter names) on `model`'s parameters."""
    if not buckets:
        return None
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [name for bucket in buckets for name in bucket.params if name not in params]
    if missing:
        raise ValueError(f"parallelize: the plan sums the partial gradients of {missing}, which the model lacks")
    trainable = [[params[name] for name in bucket.params if params[name].requires_grad] for bucket in buckets]
    reducer = PartialGradientReducer(trainable, group_name, dp_group, reduce_dtype)
    # By name too: fully_shard replaces the parameters, and its own keep the names (fully_sharded).
    reducer.names = [name for bucket in buckets for name in bucket.params if params[name].requires_grad]
    return reducer
