"""Copies of the tensors a rank writes, taken at the moment ``save`` is called.

A synchronous save writes CPU tensors as they are (the caller waits anyway). An asynchronous
save copies them to host memory first, so that training can change the originals while the
copy is written. The host buffers are kept for the next asynchronous save: filling an
existing buffer is several times faster than allocating a new one (no page faults), and
pinning memory for CUDA copies is slow. The price is one host copy of what this rank writes,
held between saves; ``release_snapshot_buffers()`` frees it. CUDA tensors are copied into
pinned buffers asynchronously, queued on the current stream, so kernels queued after
``save`` returns (the next optimizer step) run after the copies; the writer waits for them.
Only one save is in flight at a time, so a buffer is never refilled while being written.
"""

from typing import Dict, List, Tuple

import torch

from .pending import wait_for_pending_save

# stored key -> host buffer, reused by the next asynchronous save of the same tensor.
_buffers: Dict[str, torch.Tensor] = {}


class Snapshot:
    def __init__(self, tensors: Dict[str, torch.Tensor], events: List[torch.cuda.Event]):
        self.tensors = tensors
        self._events = events

    def ready(self) -> Dict[str, torch.Tensor]:
        """The host tensors, once every copy into them has finished."""
        for event in self._events:
            event.synchronize()
        return self.tensors


def _buffer(key: str, like: torch.Tensor) -> torch.Tensor:
    pin = like.device.type == "cuda"
    buffer = _buffers.get(key)
    if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.is_pinned() != pin:
        buffer = _buffers[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
    return buffer


def take_snapshot(tensors: List[Tuple[str, torch.Tensor]], copy: bool) -> Snapshot:
    """Host tensors to write, by stored key; ``copy`` makes them independent of the originals."""
    out: Dict[str, torch.Tensor] = {}
    devices = set()
    for key, tensor in tensors:
        if copy:
            out[key] = _buffer(key, tensor).copy_(tensor, non_blocking=tensor.device.type == "cuda")
            if tensor.device.type == "cuda":
                devices.add(tensor.device)
        else:
            out[key] = tensor.to("cpu").contiguous()
    if copy:
        for key in set(_buffers) - set(out):  # tensors no longer saved
            del _buffers[key]
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(out, events)


def release_snapshot_buffers() -> None:
    """Frees the host buffers kept for asynchronous saves (after waiting for the one in flight)."""
    wait_for_pending_save()
    _buffers.clear()
