"""Exclusive ownership of a save's ``<path>.partial`` directory.

Two jobs saving to the same path must not write into one directory, nor delete each other's
work. A save claims ``<path>.partial`` by building a private directory that holds an ``OWNER``
record (a random token, host, pid, time) and renaming it to ``<path>.partial``: the rename
fails when a claimed (hence non-empty) ``.partial`` is there, so exactly one job wins, and a
claimed ``.partial`` always holds its ``OWNER``. The owner checks its token again before it
commits, and only ever deletes a ``.partial`` whose token is its own.

A ``.partial`` left by a save that died stays until someone clears it: ``save`` refuses the path
with an error naming the directory and its owner, and ``CheckpointManager`` removes, when it
starts, the leftovers that are ``stale``: no ``OWNER`` record, an owner process on this host
that is gone, or older than its ``stale_after``.
"""

import errno
import json
import os
import shutil
import socket
import time
import uuid
from typing import Optional

from .manifest import PARTIAL_SUFFIX, write_durably

OWNER = "OWNER"
_STAGING = ".claim-"  # <path>.claim-<token>.partial: a claim being prepared
_STAGING_GRACE_S = 60.0  # a staging directory younger than this may still be on its way


class ClaimedError(FileExistsError):
    """``<path>.partial`` belongs to another save (running, or dead and not cleared yet)."""


def _staging_path(partial: str, token: str) -> str:
    return partial[: -len(PARTIAL_SUFFIX)] + _STAGING + token + PARTIAL_SUFFIX


def read_owner(partial: str) -> Optional[dict]:
    try:
        with open(os.path.join(partial, OWNER), "rb") as f:
            owner = json.loads(f.read())
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def describe_owner(partial: str) -> str:
    owner = read_owner(partial)
    if owner is None:
        return "it has no OWNER record (made by hand, or by an older autoshard)"
    when = owner.get("created")
    age = f", {time.time() - when:.0f} s ago" if isinstance(when, (int, float)) else ""
    return f"claimed by pid {owner.get('pid')} on host {owner.get('host')!r}{age}"


def claim(partial: str) -> str:
    """Claims ``partial`` for this process; returns the owner token. Raises ClaimedError if it
    exists, OSError if it cannot be made (nothing is left behind either way)."""
    token = uuid.uuid4().hex
    staging = _staging_path(partial, token)
    os.mkdir(staging)
    try:
        owner = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "created": time.time()}
        write_durably(os.path.join(staging, OWNER), json.dumps(owner).encode())
        try:
            # rename(2) replaces only an empty directory: a claimed .partial never is.
            os.rename(staging, partial)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise ClaimedError(f"{partial!r} already exists: {describe_owner(partial)}") from None
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return token


def owns(partial: str, token: Optional[str]) -> bool:
    owner = read_owner(partial)
    return token is not None and owner is not None and owner.get("token") == token


def release(partial: str, token: Optional[str]) -> bool:
    """Deletes ``partial`` if it is still ours (moved aside first, so that a claim made after
    ours was lost is never touched); returns whether it was ours."""
    if not owns(partial, token):
        return False
    doomed = _staging_path(partial, token)
    try:
        os.rename(partial, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def _process_gone(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by someone else
    return False


def is_stale(partial: str, stale_after: Optional[float]) -> bool:
    """Whether a ``.partial`` can be removed without harming a save in progress."""
    try:
        age = time.time() - os.stat(partial).st_mtime
    except OSError:
        return False
    owner = read_owner(partial)
    if owner is None:
        # A claim is renamed into place with its OWNER; only a staging directory lacks it briefly.
        return _STAGING not in os.path.basename(partial) or age > _STAGING_GRACE_S
    if owner.get("host") == socket.gethostname() and _process_gone(owner.get("pid")):
        return True
    created = owner.get("created")
    return stale_after is not None and isinstance(created, (int, float)) and time.time() - created > stale_after
