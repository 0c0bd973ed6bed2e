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

import weakref
from typing import Collection, Dict, Iterable, List, Optional

import torch

from ..core.collective_buckets import (DEFAULT_BUCKET_BYTES, EVERY_RANK, OWN, WHOLE, CollectiveBucket, all_reduce,
                                       fill_buckets, reduce_scatter)
from .optimizer_partition import piece_of

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientAverager"]


class GradientAverager:
    """Averages the gradients of `parameters` over `group` during backward; those whose ids
    are in `partitioned` (registered with optimizer_partition) are reduce-scattered instead.
    Buckets hold up to `bucket_bytes` of gradients in their own dtype."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], group, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 partitioned: Collection[int] = (), reduce_dtype: Optional[torch.dtype] = None):
        self.group = group
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        unique = {id(p): p for p in parameters if p.requires_grad}
        # In the order backward produces gradients; a collective takes one device and dtype.
        grouped = fill_buckets(list(reversed(unique.values())), bucket_bytes,
                               lambda p: (id(p) in partitioned, p.device, p.dtype))
        self.buckets = [CollectiveBucket(params, [piece_of(p) for p in params] if scatter else None)
                        for (scatter, _, _), params in grouped]
        self.bucket_of: Dict[int, int] = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        # For each reduce-scattered bucket, the gradients into which the last finish wrote an
        # average: a later backward that adds to one of them before the optimizer clears it
        # accumulates gradients.
        self._averaged: Dict[int, List[Optional[weakref.ref]]] = {
            b: [None] * len(bucket.params) for b, bucket in enumerate(self.buckets) if bucket.pieces}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in unique.values()]
        for b in self._averaged:
            self.handles += [p.register_hook(lambda grad, b=b, i=i: self._rescale_held_average(b, i))
                             for i, p in enumerate(self.buckets[b].params)]
        self._reset()

    def _reset(self) -> None:
        self._waiting = [{id(p) for p in bucket.params} for bucket in self.buckets]
        self._launched = set()
        self._finish_queued = False

    def _rescale_held_average(self, b: int, index: int) -> None:
        """Called as backward is about to add a new gradient into a reduce-scattered
        parameter's .grad, and at launch for a gradient that received none in this pass.

        When that gradient holds an average of earlier passes, only this rank has it, in its
        own piece (zeros elsewhere): scaled by the world size, the reduce-scatter's sum counts
        it once per rank, and its average is that average plus the new gradients' average."""
        averaged = self._averaged[b]
        held, averaged[index] = averaged[index], None
        bucket = self.buckets[b]
        grad = bucket.params[index].grad
        if grad is not None and held is not None and held() is grad:
            piece = bucket.pieces[index]
            piece.of(grad).mul_(piece.world_size)

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
        collective, layout = all_reduce(self.group, self.reduce_dtype), WHOLE
        if bucket.pieces:
            for i in range(len(bucket.params)):
                self._rescale_held_average(b, i)
            collective, layout = reduce_scatter(bucket.lengths, self.group, self.reduce_dtype), EVERY_RANK
        bucket.launch(collective, [p.grad for p in bucket.params], layout, in_flight=True)
        self._launched.add(b)

    def _finish_bucket(self, b: int) -> None:
        bucket = self.buckets[b]
        grads = [p.grad for p in bucket.params]
        if not bucket.pieces:
            for grad, average in zip(grads, bucket.split(bucket.result(divide_by=self.group.size()))):
                grad.copy_(average)
            return
        out = bucket.result(divide_by=bucket.world_size, dtype=grads[0].dtype)
        elsewhere = []
        for grad, piece in zip(grads, bucket.pieces):
            flat, start, n = grad.view(-1), piece.starts[piece.rank], piece.numel
            elsewhere += [flat.narrow(0, 0, start), flat.narrow(0, start + n, flat.numel() - start - n)]
        torch._foreach_copy_(bucket.segments(grads, OWN), bucket.split(out, OWN))
        torch._foreach_zero_(elsewhere)
        self._averaged[b] = [weakref.ref(grad) for grad in grads]

    def _finish(self) -> None:
        for b in range(len(self.buckets)):
            if b not in self._launched:
                self._launch(b)
        for b in sorted(self._launched):
            self._finish_bucket(b)
        self._reset()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
