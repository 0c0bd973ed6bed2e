"""The one asynchronous save allowed in flight, the writer that runs it, and the handle ``save`` returns.

Saving and loading both need it (a load first waits for a save still being written), as does
freeing the snapshot buffers, so it sits below all of them."""

import atexit
import concurrent.futures
import os
import sys
import threading
import traceback
from typing import Callable, Optional

from .group import WorldCheckpointGroup


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
        """A handle of ``run()`` handed to the background writer; its error is kept for wait()."""
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
    the one asynchronous save in flight, the gloo group the writer's collectives run on (see
    group.py), the last write agreement the ranks reached (see save_agreement.py) and the
    snapshot's host buffers (snapshot.py). One per
    process (``WRITER``); ``close`` ends it all at interpreter exit.

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

    def track(self, handle: SaveHandle) -> SaveHandle:
        """Makes ``handle`` the save in flight; returns it."""
        self._in_flight = handle
        return handle

    def wait_for_pending_save(self) -> None:
        """Blocks until the save in flight (if any) is finished; raises its error unless its
        handle's wait() already did."""
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
