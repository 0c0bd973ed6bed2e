"""The process group checkpoints talk over, the one asynchronous save allowed in flight, the
writer that runs it, and the handle ``save`` returns.

Saving and loading both need them (a load first waits for a save still being written), as does
freeing the snapshot buffers, so they sit below all of them.

Saving finishes in a background thread, and a collective issued from another thread on the
training group could interleave with the training step's own collectives. Checkpoints
therefore use a gloo group of their own over the whole world, created collectively (from
the main thread) the first time a checkpoint needs one, and held by the background writer
whose thread is the reason for it. Without torch.distributed, the process is a world of one
and every collective is the identity.
"""

import atexit
import concurrent.futures
import os
import pickle
import sys
import threading
import traceback
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


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the checkpoint was not committed."""


class SaveHandle:
    """What ``save`` returns: ``wait()`` blocks until the checkpoint is committed (at once for a
    synchronous save) and raises what went wrong in the background."""

    def __init__(self, path: str):
        self.path = path
        self._finished: Optional[threading.Event] = None  # None: a synchronous save, finished
        self._error: Optional[BaseException] = None
        self._surfaced = False

    def done(self) -> bool:
        return self._finished is None or self._finished.is_set()

    def wait(self) -> str:
        """Blocks until the save is finished; returns the checkpoint's path or raises its error."""
        if self._finished is not None:
            self._finished.wait()
        if self._error is not None:
            self._surfaced = True
            raise self._error
        return self.path

    @classmethod
    def in_background(cls, path: str, run: Callable[[], None]) -> "SaveHandle":
        """A handle of ``run()`` handed to the background writer, made the save in flight; its
        error is kept for wait()."""
        handle = cls(path)
        handle._finished = threading.Event()

        def background():
            try:
                run()
            except BaseException as e:
                handle._error = e
                if not isinstance(e, CheckpointSaveError):
                    traceback.print_exc()
            finally:
                handle._finished.set()

        WRITER.submit(background)
        WRITER._in_flight = handle
        return handle

    def _settle(self) -> None:
        """Finishes the save; raises its error unless wait() already did."""
        if self._finished is not None:
            self._finished.wait()
        if self._error is not None and not self._surfaced:
            self._surfaced = True
            raise CheckpointSaveError(f"save: the previous asynchronous save, of {self.path!r}, failed: "
                                      f"{self._error}") from self._error


class BackgroundWriter:
    """What checkpointing keeps in this process from one save to the next: the writer thread,
    the one asynchronous save in flight, the gloo group the writer's collectives run on, the
    last write agreement the ranks reached (see save_agreement.py) and the snapshot's host
    buffers (snapshot.py). One per process (``WRITER``); ``close`` ends it all at interpreter exit.

    One writer thread, kept between saves: handing a save to a waiting thread costs
    microseconds, starting a thread (and waiting until it runs) costs up to milliseconds on a
    busy machine. An executor's worker finishes the save in flight when the interpreter exits
    (as a plain thread would), and stops when idle. A forked child gets a fresh one (its
    parent's thread is not there)."""

    def __init__(self):
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._executor_pid: Optional[int] = None
        self._in_flight: Optional[SaveHandle] = None
        self.world_group = WorldCheckpointGroup()
        # (agreement id, the agreement, this rank's pieces digest then), reused while every
        # rank's pieces stay the same.
        self.last_agreement = None
        # The host buffers asynchronous saves copy into, kept for the next one (snapshot.py
        # puts its SnapshotBuffers here).
        self.snapshot_buffers = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._executor is None or self._executor_pid != os.getpid():
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoshard-save")
            self._executor_pid = os.getpid()
        self._executor.submit(job)

    def wait_for_pending_save(self) -> None:  # see the module's function of this name
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            handle._settle()

    def close(self) -> None:
        """At interpreter exit: finishes the save in flight (the interpreter has joined the
        writer by then; this only waits if it has not) and reports its error, which no one can
        wait for any more; then stops the writer thread and destroys the checkpoint group."""
        handle = self._in_flight
        try:
            self.wait_for_pending_save()
        except BaseException as error:
            path = handle.path if handle is not None else "?"
            print(f"autoshard: the asynchronous save of {path!r}, still in flight at exit, failed: {error}",
                  file=sys.stderr)
        if self._executor is not None and self._executor_pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor = None
        self.world_group.close()


WRITER = BackgroundWriter()
atexit.register(WRITER.close)


def wait_for_pending_save() -> None:
    """Blocks until the asynchronous save in flight (if any) is finished; raises its error unless
    its handle's wait() already did."""
    WRITER.wait_for_pending_save()
