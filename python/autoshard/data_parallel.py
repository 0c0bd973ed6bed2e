"""Gradient averaging across the data-parallel replicas of a tensor-parallel model.

Gradients are packed into buckets in the order backward produces them (the reverse of the
parameters' order), and each bucket's all-reduce starts as soon as its last gradient is
accumulated, so communication overlaps the rest of backward. At the end of backward every
bucket is waited for and the averages written back into the gradients.
"""

from typing import Dict, Iterable, List

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 25 * 2**20


class GradientAverager:
    def __init__(self, parameters: Iterable[torch.nn.Parameter], group, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.group = group
        self.size = group.size()
        unique = {id(p): p for p in parameters if p.requires_grad}
        self.buckets: List[List[torch.nn.Parameter]] = []
        bucket, filled = [], 0
        for p in reversed(list(unique.values())):
            bucket.append(p)
            filled += p.numel() * p.element_size()
            if filled >= bucket_bytes:
                self.buckets.append(bucket)
                bucket, filled = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of: Dict[int, int] = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in unique.values()]
        self._reset()

    def _reset(self) -> None:
        self._waiting = [{id(p) for p in bucket} for bucket in self.buckets]
        self._in_flight = {}
        self._finish_queued = False

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        b = self.bucket_of[id(param)]
        self._waiting[b].discard(id(param))
        if not self._waiting[b] and b not in self._in_flight:
            self._launch(b)

    def _launch(self, b: int) -> None:
        params = self.buckets[b]
        for p in params:
            if p.grad is None:  # unused in this step: it contributes zeros, as on every replica
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._in_flight[b] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def _finish(self) -> None:
        for b in range(len(self.buckets)):
            if b not in self._in_flight:
                self._launch(b)
        for b, (flat, work) in self._in_flight.items():
            work.wait()
            flat.div_(self.size)
            offset = 0
            for p in self.buckets[b]:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._reset()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
