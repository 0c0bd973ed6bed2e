"""Copies of the tensors a rank writes, taken at the moment ``save`` is called.

A synchronous save writes CPU tensors as they are (the caller waits anyway). An asynchronous
save copies them to host memory first, so that training can change the originals while the
copy is written; that copy is all the caller waits for. The host buffers are kept for the
next asynchronous save: filling an existing buffer is several times faster than allocating a
new one (no page faults), and pinning memory for CUDA copies is slow. The price is one host
copy of what this rank writes, held between saves; ``release_snapshot_buffers()`` frees it.
CPU tensors are copied in one batch (``torch._foreach_copy_``), so many small tensors cost one
call, not one each.

CUDA tensors are copied into pinned buffers on a side stream of their device, which first
waits for the current stream (the copies see every kernel queued before ``save``); the
current stream then waits for the copies' event, so the kernels queued after ``save`` returns
(the next optimizer step) cannot change a tensor before it is copied, and a freed source
block is only reused by the current stream after the copy. Neither wait blocks the host:
``save`` returns once the copies are queued, and the writer thread waits for the event.
Only one save is in flight at a time, so a buffer is never refilled while being written.

A save that fails on a rank (the copy ran out of memory, a file could not be written, another
rank failed) drops that rank's kept buffers (``forget_buffers``): memory is what a failed save
most often lacked, and the next save allocates them again. The failure is reported as a
message, with no traceback: a traceback keeps the frames that held the buffers alive.
"""

from typing import Dict, List, Tuple

import torch

from .pending import WRITER, wait_for_pending_save


class Snapshot:
    def __init__(self, tensors: Dict[str, torch.Tensor], events: List["torch.cuda.Event"]):
        self.tensors = tensors
        self._events = events

    def ready(self) -> Dict[str, torch.Tensor]:
        """The host tensors, once every copy into them has finished."""
        for event in self._events:
            event.synchronize()
        return self.tensors


class SnapshotBuffers:
    """The host buffers kept from one asynchronous save to the next, and the side streams CUDA
    copies run on; the background writer holds the one instance (``WRITER.snapshot_buffers``)."""

    def __init__(self):
        # stored key -> (host buffer, pinned), reused by the next asynchronous save of the same tensor.
        self.buffers: Dict[str, Tuple[torch.Tensor, bool]] = {}
        # CUDA device -> (side stream, its copies' event), made once per device.
        self.streams: Dict[torch.device, Tuple["torch.cuda.Stream", "torch.cuda.Event"]] = {}

    def buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The kept buffer for `key` if it fits `like`, else a new one (kept in its place)."""
        pin = like.device.type == "cuda"
        kept = self.buffers.get(key)
        if kept is None or kept[1] != pin or kept[0].shape != like.shape or kept[0].dtype != like.dtype:
            kept = self.buffers[key] = (torch.empty(like.shape, dtype=like.dtype, pin_memory=pin), pin)
        return kept[0]

    def copy_from_cuda(self, device: torch.device, sources: List[torch.Tensor],
                       buffers: List[torch.Tensor]) -> "torch.cuda.Event":
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.Event())
        side, copied = self.streams[device]
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            for buffer, source in zip(buffers, sources):
                buffer.copy_(source, non_blocking=True)  # queued: the host goes on at once
        copied.record(side)
        current.wait_event(copied)
        return copied

    def keep_only(self, keys) -> None:
        """Drops the buffers of tensors no longer saved."""
        for key in set(self.buffers) - set(keys):
            del self.buffers[key]

    def forget(self) -> None:
        """Drops the kept host buffers (once the copies into them, if any, have finished); what
        still uses one (a save being written) keeps it until it is done with it."""
        for _, copied in self.streams.values():
            copied.synchronize()  # a save that failed early may not have waited for its copies
        self.buffers.clear()


WRITER.snapshot_buffers = SnapshotBuffers()


class SnapshotError(RuntimeError):
    """Copying a rank's tensors failed: the original error's type and message, without the
    traceback (whose frames held the buffers)."""


def take_snapshot(tensors: List[Tuple[str, torch.Tensor]], copy: bool) -> Snapshot:
    """Host tensors to write, by stored key; ``copy`` makes them independent of the originals.
    Raises SnapshotError, having dropped every kept buffer, when the copy fails."""
    message = None
    try:
        return _take_snapshot(tensors, copy, WRITER.snapshot_buffers)
    except Exception as e:  # MemoryError, torch.OutOfMemoryError, a RuntimeError from an allocator...
        message = f"{type(e).__name__}: {e}"
    forget_buffers()  # outside the except block: the traceback (and the frames holding buffers) is gone
    raise SnapshotError(message)


def _take_snapshot(tensors: List[Tuple[str, torch.Tensor]], copy: bool, kept: SnapshotBuffers) -> Snapshot:
    if not copy:
        return Snapshot({key: tensor.to("cpu").contiguous() for key, tensor in tensors}, [])
    out: Dict[str, torch.Tensor] = {}
    batches: Dict[torch.device, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
    for key, tensor in tensors:
        buffer = out[key] = kept.buffer(key, tensor)
        sources, buffers = batches.setdefault(tensor.device, ([], []))
        sources.append(tensor)
        buffers.append(buffer)
    kept.keep_only(out)
    events = []
    for device, (sources, buffers) in batches.items():
        if device.type == "cuda":
            events.append(kept.copy_from_cuda(device, sources, buffers))
        else:
            torch._foreach_copy_(buffers, sources)
    return Snapshot(out, events)


def forget_buffers() -> None:
    """Drops the kept host buffers (see SnapshotBuffers.forget)."""
    WRITER.snapshot_buffers.forget()


def kept_bytes() -> int:
    """How many bytes of host buffers are kept for the next asynchronous save."""
    return sum(buffer.numel() * buffer.element_size() for buffer, _ in WRITER.snapshot_buffers.buffers.values())


def release_snapshot_buffers() -> None:
    """Frees the host buffers kept for asynchronous saves (after waiting for the one in flight)."""
    try:
        wait_for_pending_save()
    finally:
        forget_buffers()
