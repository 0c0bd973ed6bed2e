"""The one asynchronous save allowed in flight, and the handle ``save`` returns.

Saving and loading both need it (a load first waits for a save still being written), as does
freeing the snapshot buffers, so it sits below all of them."""

import concurrent.futures
import os
import sys
import threading
import traceback
from typing import Callable, Optional


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

        _writer().submit(background)
        return handle

    def _settle(self) -> None:
        """Finishes the save; raises its error unless wait() already did."""
        if self._finished is not None:
            self._finished.wait()
        if self._error is not None and not self._surfaced:
            self._surfaced = True
            raise CheckpointSaveError(f"save: the previous asynchronous save, of {self.path!r}, failed: "
                                      f"{self._error}") from self._error


# One writer thread, kept between saves: handing a save to a waiting thread costs microseconds,
# starting a thread (and waiting until it runs) costs up to milliseconds on a busy machine. An
# executor's worker finishes the save in flight when the interpreter exits (as a plain thread
# would), and stops when idle. A forked child gets a fresh one (its parent's thread is not there).
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_executor_pid: Optional[int] = None


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    global _executor, _executor_pid
    if _executor is None or _executor_pid != os.getpid():
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoshard-save")
        _executor_pid = os.getpid()
    return _executor


# The one asynchronous save allowed in flight.
_in_flight: Optional[SaveHandle] = None


def wait_for_pending_save() -> None:
    """Blocks until the asynchronous save in flight (if any) is finished; raises its error unless
    its handle's wait() already did."""
    global _in_flight
    handle, _in_flight = _in_flight, None
    if handle is not None:
        handle._settle()


def finish_at_exit() -> None:
    """At interpreter exit: finishes the save in flight (the interpreter has joined the writer
    by then; this only waits if it has not) and reports its error, which no one can wait for
    any more; then stops the writer thread."""
    global _executor
    handle = _in_flight
    try:
        wait_for_pending_save()
    except BaseException as error:
        path = handle.path if handle is not None else "?"
        print(f"autoshard: the asynchronous save of {path!r}, still in flight at exit, failed: {error}",
              file=sys.stderr)
    if _executor is not None and _executor_pid == os.getpid():
        _executor.shutdown(wait=True)
    _executor = None


def track(handle: SaveHandle) -> SaveHandle:
    """Makes ``handle`` the save in flight; returns it."""
    global _in_flight
    _in_flight = handle
    return handle
