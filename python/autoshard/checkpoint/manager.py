"""CheckpointManager: a directory of ``step-<N>`` checkpoints, saved every N steps, of which
the last K and the best by a metric are kept, and from which training resumes."""

import numbers
import os
import re
import shutil
import warnings
from typing import Dict, List, Optional, Set

import torch

from . import claim
from . import manifest as mf
from .load import load
from .pending import WRITER, SaveHandle, wait_for_pending_save
from .save import save_checkpoint

_STEP_DIR = re.compile(r"^step-(\d+)$")
# What a save writes into a checkpoint directory: a directory holding anything else is not
# ours to delete.
_OURS = re.compile(r"^(rank-\d{5}\.safetensors|manifest\.json|COMMITTED|OWNER)$")


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"CheckpointManager: {name} must be a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")


class CheckpointManager:
    """Saves ``step-<N>`` checkpoints under ``directory`` when ``step % save_every == 0``, keeps
    the last ``max_to_keep`` (None: all) plus the best by metric ``keep_best`` (``mode`` "min"
    or "max"), and deletes the others once a new one is committed. Every rank constructs it
    and calls ``save``.

    Construction removes the ``.partial`` leftovers of interrupted saves that are stale (see
    claim.is_stale: the owner process is gone, there is no owner record, or the claim is older
    than ``stale_after`` seconds; None: never by age) and leaves the others, with a warning.
    Retention never fails a save that committed: a directory it cannot read, or that holds
    files a save does not write, is skipped and reported once (a warning). A ``step-<N>``
    directory without ``COMMITTED`` that holds only what a save writes, older than the newest
    committed step, is removed."""

    def __init__(self, directory, max_to_keep: Optional[int] = 3, keep_best: Optional[str] = None,
                 mode: str = "min", save_every: int = 1, stale_after: Optional[float] = 24 * 3600.0):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"CheckpointManager: directory must be a str or os.PathLike, got {type(directory).__name__}")
        _check_positive_int("max_to_keep", max_to_keep, allow_none=True)
        _check_positive_int("save_every", save_every)
        if keep_best is not None and not isinstance(keep_best, str):
            raise TypeError(f"CheckpointManager: keep_best must be a metric name (str) or None, got {keep_best!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"CheckpointManager: mode must be 'min' or 'max', got {mode!r}")
        if stale_after is not None and (isinstance(stale_after, bool) or not isinstance(stale_after, numbers.Real)
                                        or not stale_after >= 0):
            raise ValueError(f"CheckpointManager: stale_after must be a number of seconds >= 0 or None, "
                             f"got {stale_after!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep, self.keep_best, self.mode, self.save_every = max_to_keep, keep_best, mode, save_every
        self.stale_after = stale_after
        self._reported: Set[str] = set()
        wait_for_pending_save()
        comm = WRITER.world_group.current()
        error = None
        if comm.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                for name in os.listdir(self.directory):
                    leftover = os.path.join(self.directory, name)
                    if not name.endswith(mf.PARTIAL_SUFFIX):
                        continue
                    if claim.is_stale(leftover, stale_after):
                        shutil.rmtree(leftover)
                    else:
                        self._report(leftover, f"CheckpointManager: left {leftover!r} alone: "
                                               f"{claim.describe_owner(leftover)}; delete it if no save is running")
            except OSError as e:
                error = f"CheckpointManager: cannot prepare {self.directory!r}: {e}"
        error = comm.broadcast(error)
        if error is not None:
            raise OSError(error)

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}")

    def steps(self) -> List[int]:
        """The steps of the committed checkpoints, oldest first."""
        matches = [(_STEP_DIR.match(name), os.path.join(self.directory, name)) for name in os.listdir(self.directory)]
        return sorted(int(match.group(1)) for match, path in matches if match and mf.is_committed(path))

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def latest(self) -> Optional[str]:
        """The path of the newest committed checkpoint, or None."""
        step = self.latest_step()
        return None if step is None else self.path_for(step)

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             metrics: Optional[Dict[str, float]] = None, extra=None, async_save: bool = False,
             rank_extra=None) -> Optional[SaveHandle]:
        """Saves ``step-<step>`` if ``step`` is a multiple of ``save_every`` (else returns None);
        ``metrics`` (name -> number) are recorded for ``keep_best``; ``extra`` and ``rank_extra``
        as ``checkpoint.save`` stores them."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        if metrics is not None:
            if not isinstance(metrics, dict) or not all(
                    isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                    for k, v in metrics.items()):
                raise ValueError(f"CheckpointManager.save: metrics must be a dict of name -> number, got {metrics!r}")
            metrics = {k: float(v) for k, v in metrics.items()}
        if self.keep_best is not None and (metrics is None or self.keep_best not in metrics):
            raise ValueError(f"CheckpointManager.save: metrics must hold {self.keep_best!r} (keep_best), got {metrics!r}")
        if step % self.save_every:
            return None
        return save_checkpoint(self.path_for(step), model, optimizer, extra, async_save, metrics=metrics,
                               after_commit=self._retain, rank_extra=rank_extra)

    def _report(self, key: str, message: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _ours(self, path: str) -> bool:
        try:
            names = os.listdir(path)
        except OSError as e:
            self._report(path, f"CheckpointManager: skipped {path!r}, which it cannot read: {e}")
            return False
        foreign = [n for n in names if not _OURS.match(n)]
        if foreign:
            self._report(path, f"CheckpointManager: left {path!r} alone: it holds {sorted(foreign)[:5]}, which no "
                               "save writes")
        return not foreign

    def _delete(self, path: str) -> None:
        # Uncommitted first (a .partial name), so that a crash half way leaves a leftover that
        # is cleaned up, never a committed checkpoint with files missing.
        doomed = path + mf.PARTIAL_SUFFIX
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            self._report(path, f"CheckpointManager: could not delete {path!r}: {e}")

    def _retain(self) -> None:
        """Deletes the checkpoints that are neither among the last max_to_keep nor the best.
        Runs after a commit: it reports what it cannot do and never raises."""
        try:
            steps, scored = [], []
            for step in self.steps():
                path = self.path_for(step)
                if self.keep_best is not None:
                    try:
                        value = (mf.read_manifest(path, "CheckpointManager").metrics or {}).get(self.keep_best)
                    except Exception as e:
                        self._report(path, f"CheckpointManager: skipped {path!r}, which it cannot read: {e}")
                        continue
                    if isinstance(value, numbers.Real) and not isinstance(value, bool):
                        scored.append((value if self.mode == "min" else -value, -step, step))
                steps.append(step)
            keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep:])
            if scored:
                keep.add(min(scored)[2])
            for step in steps:
                if step not in keep and self._ours(self.path_for(step)):
                    self._delete(self.path_for(step))
            # Step directories a save never committed (copied in part, or written by an old version).
            newest = steps[-1] if steps else None
            for name in os.listdir(self.directory):
                match = _STEP_DIR.match(name)
                path = os.path.join(self.directory, name)
                if (match and newest is not None and int(match.group(1)) < newest and os.path.isdir(path)
                        and not mf.is_committed(path) and self._ours(path)):
                    self._delete(path)
        except Exception as e:
            self._report(f"retain:{e}", f"CheckpointManager: retention in {self.directory!r} failed: {e}")

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises its error."""
        wait_for_pending_save()

    def restore(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                restore_rng: bool = True, return_rank_extra: bool = False):
        """Loads the newest checkpoint (each rank's generator states too, see ``load``); returns
        its ``extra``, or None when there is none (with ``return_rank_extra``: the pair
        ``(extra, this rank's rank_extra)``, ``(None, None)`` when there is none)."""
        wait_for_pending_save()
        path = self.latest()
        if path is None:
            return (None, None) if return_rank_extra else None
        return load(path, model, optimizer, restore_rng=restore_rng, return_rank_extra=return_rank_extra)
