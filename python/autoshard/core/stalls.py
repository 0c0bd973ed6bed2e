"""Ranks that stall or fall out of step: a bounded wait and an error that says where.

torch.distributed waits 30 minutes by default for a peer that never joins a collective (a
rank stuck in a loop or a hung data loader, or one that caught an exception and skipped a
collective the others entered). ``init_distributed`` sets a shorter timeout (DEFAULT_TIMEOUT);
when it expires, gloo raises a bare "Timed out waiting ..." or "Connection reset by peer" on
the ranks that waited. The collectives autoshard issues from Python (the forward check, the
replica fingerprint, the agreement on non-finite gradients) turn that into a RankStallError
naming the collective, this rank's forward count, and the ranks that never reported: each
rank that fails writes where it is to the default store and reads the others' reports for a
few seconds; a rank with no report is the one that did not arrive.
"""

import contextlib
import numbers
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# Ten minutes: longer than anything a healthy rank legitimately does while its peers wait in a
# collective (a first step under torch.compile, one rank writing save_pretrained or an
# evaluation of its own, loading a checkpoint shard), a third of torch's 30.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_PREFIX = "autoshard/stall/"


class RankStallError(RuntimeError):
    """A collective over the tensor-parallel ranks did not complete: a rank stalled or skipped it."""


def check_timeout(function: str, timeout) -> timedelta:
    """`timeout` (a datetime.timedelta or a number of seconds) as a positive, finite timedelta."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{function}: timeout must be a datetime.timedelta or a number of seconds, "
                        f"got {type(timeout).__name__}")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{function}: timeout must be a positive, finite duration, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def _reports(group: dist.ProcessGroup, where: str, wait: float) -> dict:
    """Writes this rank's position; returns {rank: position} of the group's ranks that wrote one
    within `wait` seconds (recent reports only: a store outlives one incident)."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    now = time.time()
    try:  # no default store, or one that cannot be written: no reports
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_PREFIX}{group.group_name}/{me}", f"{now}|{where}")
    except Exception:
        return {}
    found = {me: where}
    deadline = time.monotonic() + wait
    while True:
        for r in ranks:
            if r in found:
                continue
            key = f"{_PREFIX}{group.group_name}/{r}"
            try:
                if store.check([key]):
                    stamp, _, theirs = store.get(key).decode().partition("|")
                    if abs(float(stamp) - now) < max(2 * wait, 60.0):
                        found[r] = theirs
            except Exception:
                pass
        if len(found) == len(ranks) or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return any(words in text for words in ("timed out", "timeout", "connection reset", "connection closed",
                                           "broken pipe", "read error", "socket", "peer"))


@contextlib.contextmanager
def named(collective: str, group: dist.ProcessGroup, forward: Optional[int] = None, report_wait: float = 5.0):
    """Runs a collective; a failure of a peer (a timeout, a closed connection) becomes a
    RankStallError naming `collective`, the forward count and the ranks that did not arrive."""
    try:
        yield
    except RankStallError:
        raise
    except RuntimeError as error:
        if not _is_peer_failure(error):
            raise
        step = f" at forward {forward} of the model" if forward is not None else ""
        where = f"{collective}{step}"
        found = _reports(group, where, report_wait)
        ranks = dist.get_process_group_ranks(group)
        missing = [r for r in ranks if r not in found]
        others = "; ".join(f"rank {r} failed in {w}" for r, w in sorted(found.items()) if r != dist.get_rank())
        if missing:
            who = (f"rank(s) {missing} did not arrive (stalled, or skipped this collective) and reported "
                   "nothing")
        else:
            who = "every rank reported a failure, each in its own place (a rank skipped a collective)"
        raise RankStallError(
            f"autoshard: {where} over the tensor-parallel ranks {ranks} failed on rank {dist.get_rank()}: {who}"
            + (f"; {others}" if others else "")
            + f". The process group's timeout bounds the wait (autoshard.init_distributed(timeout=...)). "
            f"Cause from torch.distributed: {str(error).strip().splitlines()[0][:300]}") from error
