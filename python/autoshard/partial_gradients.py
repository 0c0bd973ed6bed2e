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

from . import comm, ops


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        self.params = params
        self.contributions: Dict[int, torch.Tensor] = {}
        # Each gradient as it was before this pass (None: there was none), to which the sum is
        # added: own + (sum - own) would round differently on each rank, and replicated
        # parameters would drift apart.
        self.before: Dict[int, Optional[torch.Tensor]] = {}
        self.arrived = set()
        self.done = False

    def reset(self) -> None:
        self.contributions.clear()
        self.before.clear()
        self.arrived.clear()
        self.done = False


class PartialGradientReducer:
    """Hooks on `buckets` (lists of parameters) that sum their gradients over the group
    named `group_name` during backward, and average them over `dp_group` when given."""

    def __init__(self, buckets: List[List[torch.nn.Parameter]], group_name: str, dp_group=None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.group_name = group_name
        self.dp_group = dp_group
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self.buckets = [_Bucket(list(params)) for params in buckets if params]
        self.names: List[str] = []  # the parameters' names in the model, when install() knows them
        self.handles = []
        self._finish_queued = False
        for bucket in self.buckets:
            for index, p in enumerate(bucket.params):
                self.handles.append(p.register_hook(self._record(bucket, index, p)))
                self.handles.append(p.register_post_accumulate_grad_hook(self._arrived(bucket, index)))

    @staticmethod
    def _record(bucket: _Bucket, index: int, param: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            # What this pass adds to the gradient, before it is accumulated.
            bucket.contributions[index] = grad.detach()
            if index not in bucket.before:
                bucket.before[index] = None if param.grad is None else param.grad.detach().clone()

        return hook

    def _arrived(self, bucket: _Bucket, index: int):
        def hook(param: torch.nn.Parameter) -> None:
            if not self._finish_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._finish_queued = True
            bucket.arrived.add(index)
            if len(bucket.arrived) == len(bucket.params) and not bucket.done:
                self._reduce(bucket)

        return hook

    def _reduce(self, bucket: _Bucket) -> None:
        parts = []
        for index, p in enumerate(bucket.params):
            got = bucket.contributions.get(index)
            parts.append((got if got is not None else torch.zeros_like(p)).reshape(-1))
        with torch.no_grad():
            flat = torch.cat(parts)
            if self.reduce_dtype is not None:
                flat = flat.to(self.reduce_dtype)
            total = ops.reduce_from_parallel(flat, self.group_name)
            if self.dp_group is not None:
                total = total + 0  # a tensor of our own for the in-place collective
                comm.all_reduce_(total, "sum", self.dp_group)
                total.div_(self.dp_group.size())
            offset = 0
            for index, p in enumerate(bucket.params):
                n = p.numel()
                piece = total[offset:offset + n].view_as(p).to(p.dtype)
                # A parameter with no gradient in this pass kept the one it had.
                before = bucket.before[index] if index in bucket.before else p.grad
                summed = piece if before is None else before + piece
                if p.grad is None:
                    p.grad = summed.clone() if summed is piece else summed
                else:
                    p.grad.copy_(summed)
                offset += n
        bucket.done = True

    def _finish(self) -> None:
        # A bucket some of whose parameters got no gradient in this pass (on every rank alike)
        # is summed with zeros for them.
        for bucket in self.buckets:
            if bucket.arrived and not bucket.done:
                self._reduce(bucket)
            bucket.reset()
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
