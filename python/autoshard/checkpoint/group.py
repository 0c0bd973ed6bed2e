"""The process group checkpoints talk over.

Saving finishes in a background thread, and a collective issued from another thread on the
training group could interleave with the training step's own collectives. Checkpoints
therefore use a gloo group of their own over the whole world, created collectively (from
the main thread) the first time a checkpoint needs one. Without torch.distributed, the
process is a world of one and every collective is the identity.
"""

from typing import Any, List, Optional

import torch.distributed as dist

_cached = None  # (the default group it was made for, the checkpoint group)


class CheckpointGroup:
    """Rank, size and the three object collectives a save needs (on a dedicated gloo group)."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank()
        self.size = 1 if group is None else dist.get_world_size()

    def all_gather(self, obj: Any) -> List[Any]:
        if self.group is None:
            return [obj]
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's obj on rank 0 (None elsewhere)."""
        if self.group is None:
            return [obj]
        out: Optional[List[Any]] = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        self.broadcast(None)


def checkpoint_group() -> CheckpointGroup:
    """The checkpoint group of the current world (a collective call the first time)."""
    global _cached
    if not (dist.is_available() and dist.is_initialized()):
        return CheckpointGroup(None)
    default = dist.distributed_c10d._get_default_group()
    if _cached is None or _cached[0] is not default:
        _cached = (default, dist.new_group(backend="gloo"))
    return CheckpointGroup(_cached[1])
