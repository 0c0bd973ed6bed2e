"""The one asynchronous save allowed in flight, and the handle ``save`` returns.

Saving and loading both need it (a load first waits for a save still being written), as does
freeing the snapshot buffers, so it sits below all of them."""

import os
import threading
import traceback
from typing import Callable, Optional


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the checkpoint was not committed."""


class SaveHandle:
    """What ``save`` returns: ``wait()`` blocks until the checkpoint is committed (at once for a
    synchronous save) and raises what went wrong in the background."""

    def __init__(self, path: str, thread: Optional[threading.Thread] = None):
        self.path = path
        self._thread = thread
        self._error: Optional[BaseException] = None
        self._surfaced = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Blocks until the save is finished; returns the checkpoint's path or raises its error."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._surfaced = True
            raise self._error
        return self.path

    @classmethod
    def in_background(cls, path: str, run: Callable[[], None]) -> "SaveHandle":
        """A handle of ``run()`` started in a background thread; its error is kept for wait()."""
        handle = cls(path)

        def background():
            try:
                run()
            except BaseException as e:
                handle._error = e
                if not isinstance(e, CheckpointSaveError):
                    traceback.print_exc()

        handle._thread = threading.Thread(target=background, name=f"autoshard-save:{os.path.basename(path)}")
        handle._thread.start()
        return handle

    def _settle(self) -> None:
        """Finishes the save; raises its error unless wait() already did."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._surfaced:
            self._surfaced = True
            raise CheckpointSaveError(f"save: the previous asynchronous save, of {self.path!r}, failed: "
                                      f"{self._error}") from self._error


# The one asynchronous save allowed in flight.
_in_flight: Optional[SaveHandle] = None


def wait_for_pending_save() -> None:
    """Blocks until the asynchronous save in flight (if any) is finished; raises its error unless
    its handle's wait() already did."""
    global _in_flight
    handle, _in_flight = _in_flight, None
    if handle is not None:
        handle._settle()


def track(handle: SaveHandle) -> SaveHandle:
    """Makes ``handle`` the save in flight; returns it."""
    global _in_flight
    _in_flight = handle
    return handle
