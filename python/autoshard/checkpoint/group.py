"""The process group checkpoints talk over.

Saving finishes in a background thread, and a collective issued from another thread on the
training group could interleave with the training step's own collectives. Checkpoints
therefore use a gloo group of their own over the whole world, created collectively (from
the main thread) the first time a checkpoint needs one, and held by the background writer
(pending.BackgroundWriter) whose thread is the reason for it. Without torch.distributed, the
process is a world of one and every collective is the identity.
"""

import pickle
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..core.comm import all_gather_uneven, all_reduce_bucket, broadcast_, wait


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


class CheckpointGroup:
    """Rank, size and the collectives a save needs (on a dedicated gloo group): objects sent as
    pickled bytes through autoshard's collective ops, and a one-collective gather of a few
    integers for what must be agreed before ``save`` returns."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank()
        self.size = 1 if group is None else dist.get_world_size()

    def start_all_gather_ints(self, values: List[int]) -> Callable[[], List[List[int]]]:
        """Starts gathering every rank's ``values`` (int64s, as many on every rank) in one
        collective, which runs while the caller works on; returns the function that waits for
        them. No other collective of this group may be issued before that function is called."""
        if self.group is None:
            return lambda: [list(values)]
        table = torch.zeros(self.size, len(values), dtype=torch.int64)
        table[self.rank] = torch.tensor(values, dtype=torch.int64)
        summed = all_reduce_bucket([table], self.group, async_op=True)  # every other row is 0
        return lambda: wait(summed).view(self.size, len(values)).tolist()

    def all_gather(self, obj: Any) -> List[Any]:
        if self.group is None:
            return [obj]
        data = _encode(obj)
        lengths = all_gather_uneven(torch.tensor([data.numel()]), 0, [1] * self.size, self.group).tolist()
        gathered = all_gather_uneven(data, 0, lengths, self.group)
        return [_decode(piece) for piece in gathered.split(lengths)]

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's obj on rank 0 (None elsewhere)."""
        gathered = self.all_gather(obj)
        return gathered if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank."""
        if self.group is None:
            return obj
        data = _encode(obj) if self.rank == 0 else None
        length = torch.tensor([0 if data is None else data.numel()])
        broadcast_(length, 0, self.group)
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        return _decode(broadcast_(data, 0, self.group))

    def barrier(self) -> None:
        self.broadcast(None)


class WorldCheckpointGroup:
    """The checkpoint group of the current world: made the first time a checkpoint needs it,
    made again once the world is destroyed and started anew (the old group went with the old
    world), destroyed by ``close``."""

    def __init__(self):
        self._made_for: Optional[dist.ProcessGroup] = None  # the default group it was made for
        self._group: Optional[dist.ProcessGroup] = None

    def current(self) -> CheckpointGroup:
        """The checkpoint group of the current world (a collective call the first time)."""
        if not (dist.is_available() and dist.is_initialized()):
            return CheckpointGroup(None)
        default = dist.distributed_c10d._get_default_group()
        if self._group is None or self._made_for is not default:
            self._made_for, self._group = default, dist.new_group(backend="gloo")
        return CheckpointGroup(self._group)

    def close(self) -> None:
        """Destroys the group while the world it belongs to still exists, so that its threads are
        joined now, not during the interpreter's teardown, where they could outlive the objects
        they use."""
        made_for, group = self._made_for, self._group
        self._made_for = self._group = None
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return  # the world was destroyed (and our group with it), or none was made
        if made_for is dist.distributed_c10d._get_default_group():
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass  # it is gone already: destroying the world destroys its subgroups
