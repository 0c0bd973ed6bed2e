"""Gradient averaging across the data-parallel replicas of a tensor-parallel model.

Gradients are packed into buckets in the order backward produces them (the reverse of the
parameters' order), and each bucket's collective starts as soon as its last gradient is
accumulated, so communication overlaps the rest of backward. At the end of backward every
bucket is waited for and the averages written back into the gradients.

A bucket of tensor-parallel shards is all-reduced. A bucket of parameters whose optimizer
state is partitioned (see optimizer_partition) is reduce-scattered: each rank receives the
average of only the piece it steps.

With a `reduce_dtype`, each bucket is summed and averaged in that dtype and the average
rounded once to the gradients' dtype.
"""

from typing import Collection, Dict, Iterable, List, Optional

import torch

from .comm import all_reduce_bucket, wait
from .optimizer_partition import DEFAULT_BUCKET_BYTES, ReduceScatterBucket

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientAverager"]


class AllReduceBucket:
    def __init__(self, params: List[torch.nn.Parameter], group, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params = params
        self.group = group
        self.reduce_dtype = reduce_dtype
        self._in_flight = None

    def launch(self) -> None:
        grads = [p.grad if self.reduce_dtype is None else p.grad.to(self.reduce_dtype) for p in self.params]
        self._in_flight = all_reduce_bucket(grads, self.group, async_op=True)

    def finish(self) -> None:
        flat = wait(self._in_flight)
        self._in_flight = None
        flat.div_(self.group.size())
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


class GradientAverager:
    """Averages the gradients of `parameters` over `group` during backward; those whose ids
    are in `partitioned` (registered with optimizer_partition) are reduce-scattered instead."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], group, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 partitioned: Collection[int] = (), reduce_dtype: Optional[torch.dtype] = None):
        self.group = group
        unique = {id(p): p for p in parameters if p.requires_grad}
        # Each kind of bucket, device and dtype fills its own bucket; a bucket closes when full.
        open_buckets: Dict[tuple, List[torch.nn.Parameter]] = {}
        filled: Dict[tuple, int] = {}
        grouped: List[tuple] = []
        for p in reversed(list(unique.values())):
            key = (id(p) in partitioned, p.device, p.dtype)
            open_buckets.setdefault(key, []).append(p)
            filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
            if filled[key] >= bucket_bytes:
                grouped.append((key[0], open_buckets.pop(key)))
                filled[key] = 0
        grouped += [(key[0], params) for key, params in open_buckets.items()]
        self.buckets = [ReduceScatterBucket(params, group, reduce_dtype) if scatter
                        else AllReduceBucket(params, group, reduce_dtype) for scatter, params in grouped]
        self.bucket_of: Dict[int, int] = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in unique.values()]
        for bucket in self.buckets:
            if isinstance(bucket, ReduceScatterBucket):
                self.handles += [p.register_hook(self._before_accumulation(bucket, i))
                                 for i, p in enumerate(bucket.params)]
        self._reset()

    def _reset(self) -> None:
        self._waiting = [{id(p) for p in bucket.params} for bucket in self.buckets]
        self._launched = set()
        self._finish_queued = False

    @staticmethod
    def _before_accumulation(bucket: ReduceScatterBucket, index: int):
        def hook(grad: torch.Tensor) -> None:
            bucket.before_accumulation(index)

        return hook

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        b = self.bucket_of[id(param)]
        self._waiting[b].discard(id(param))
        if not self._waiting[b] and b not in self._launched:
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        for p in bucket.params:
            if p.grad is None:  # unused in this step: it contributes zeros, as on every replica
                p.grad = torch.zeros_like(p)
        bucket.launch()
        self._launched.add(b)

    def _finish(self) -> None:
        for b in range(len(self.buckets)):
            if b not in self._launched:
                self._launch(b)
        for b in sorted(self._launched):
            self.buckets[b].finish()
        self._reset()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
