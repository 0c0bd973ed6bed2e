"""CheckpointManager: a directory of ``step-<N>`` checkpoints, saved every N steps, of which
the last K and the best by a metric are kept, and from which training resumes."""

import numbers
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from . import manifest as mf
from .group import checkpoint_group
from .load import load
from .pending import SaveHandle, wait_for_pending_save
from .save import save_checkpoint

_STEP_DIR = re.compile(r"^step-(\d+)$")


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
    and calls ``save``; construction removes the ``.partial`` leftovers of interrupted saves."""

    def __init__(self, directory, max_to_keep: Optional[int] = 3, keep_best: Optional[str] = None,
                 mode: str = "min", save_every: int = 1):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"CheckpointManager: directory must be a str or os.PathLike, got {type(directory).__name__}")
        _check_positive_int("max_to_keep", max_to_keep, allow_none=True)
        _check_positive_int("save_every", save_every)
        if keep_best is not None and not isinstance(keep_best, str):
            raise TypeError(f"CheckpointManager: keep_best must be a metric name (str) or None, got {keep_best!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"CheckpointManager: mode must be 'min' or 'max', got {mode!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep, self.keep_best, self.mode, self.save_every = max_to_keep, keep_best, mode, save_every
        wait_for_pending_save()
        comm = checkpoint_group()
        error = None
        if comm.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                for name in os.listdir(self.directory):
                    if name.endswith(mf.PARTIAL_SUFFIX):
                        shutil.rmtree(os.path.join(self.directory, name))
            except OSError as e:
                error = f"CheckpointManager: cannot prepare {self.directory!r}: {e}"
        error = comm.broadcast(error)
        if error is not None:
            raise OSError(error)

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}")

    def steps(self) -> List[int]:
        """The steps of the committed checkpoints, oldest first."""
        found = []
        for name in os.listdir(self.directory):
            match = _STEP_DIR.match(name)
            if match and mf.is_committed(os.path.join(self.directory, name)):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def latest(self) -> Optional[str]:
        """The path of the newest committed checkpoint, or None."""
        step = self.latest_step()
        return None if step is None else self.path_for(step)

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             metrics: Optional[Dict[str, float]] = None, extra=None, async_save: bool = False) -> Optional[SaveHandle]:
        """Saves ``step-<step>`` if ``step`` is a multiple of ``save_every`` (else returns None);
        ``metrics`` (name -> number) are recorded for ``keep_best``."""
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
                               after_commit=self._retain)

    def _retain(self) -> None:
        """Deletes the checkpoints that are neither among the last max_to_keep nor the best."""
        steps = self.steps()
        keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep:])
        if self.keep_best is not None:
            scored = []
            for step in steps:
                metrics = mf.read_manifest(self.path_for(step), "CheckpointManager").metrics or {}
                if self.keep_best in metrics:
                    value = metrics[self.keep_best]
                    scored.append((value if self.mode == "min" else -value, -step, step))
            if scored:
                keep.add(min(scored)[2])
        for step in steps:
            if step not in keep:
                # Uncommitted first (a .partial name), so that a crash half way leaves a leftover
                # that is cleaned up, never a committed checkpoint with files missing.
                doomed = self.path_for(step) + mf.PARTIAL_SUFFIX
                os.rename(self.path_for(step), doomed)
                shutil.rmtree(doomed)

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises its error."""
        wait_for_pending_save()

    def restore(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        """Loads the newest checkpoint; returns its ``extra``, or None when there is none."""
        wait_for_pending_save()
        path = self.latest()
        return None if path is None else load(path, model, optimizer)
