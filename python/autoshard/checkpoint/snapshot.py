"""Copies of the tensors a rank writes, taken at the moment ``save`` is called.

A synchronous save writes CPU tensors as they are (the caller waits anyway). An asynchronous
save copies them to host memory first, so that training can change the originals while the
copy is written: CUDA tensors into pinned buffers, which are kept for the next save (pinning
is slow) and filled by asynchronous copies whose completion the writer waits for; the copies
are queued on the current stream, so kernels queued after ``save`` returns (the next
optimizer step) run after them.
"""

from typing import Dict, List, Optional, Tuple

import torch

# stored key -> pinned buffer, reused by the next asynchronous save of the same tensor.
_pinned: Dict[str, torch.Tensor] = {}


class Snapshot:
    def __init__(self, tensors: Dict[str, torch.Tensor], events: List[torch.cuda.Event]):
        self.tensors = tensors
        self._events = events

    def ready(self) -> Dict[str, torch.Tensor]:
        """The host tensors, once every copy into them has finished."""
        for event in self._events:
            event.synchronize()
        return self.tensors


def _pinned_buffer(key: str, like: torch.Tensor) -> torch.Tensor:
    buffer = _pinned.get(key)
    if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
        buffer = _pinned[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return buffer


def take_snapshot(tensors: List[Tuple[str, torch.Tensor]], copy: bool) -> Snapshot:
    """Host tensors to write, by stored key; ``copy`` makes them independent of the originals."""
    out: Dict[str, torch.Tensor] = {}
    devices = set()
    for key, tensor in tensors:
        if tensor.device.type == "cpu":
            out[key] = tensor.clone(memory_format=torch.contiguous_format) if copy else tensor.contiguous()
        elif tensor.device.type == "cuda" and copy:
            out[key] = _pinned_buffer(key, tensor).copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
        else:
            out[key] = tensor.to("cpu", memory_format=torch.contiguous_format)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(out, events)


def release_pinned_buffers(keep: Optional[set] = None) -> None:
    """Drops the pinned buffers of keys not in ``keep`` (all of them by default)."""
    for key in list(_pinned):
        if keep is None or key not in keep:
            del _pinned[key]
