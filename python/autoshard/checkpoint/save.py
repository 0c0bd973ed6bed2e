"""checkpoint.save: every rank writes its pieces, one rank commits, atomically.

The protocol: rank 0 claims ``<path>.partial/`` exclusively (claim.py: a save to a path that
another save holds fails on every rank, and nothing deletes a ``.partial`` it does not own);
every rank that owns a piece writes ``rank-XXXXX.safetensors`` into it and fsyncs it; the
ranks report to rank 0, which checks its claim, writes ``manifest.json``, then the
``COMMITTED`` marker, fsyncs the directory, checks its claim again, renames it to ``<path>``
and fsyncs the parent. A save that fails removes its ``.partial`` on every failure path; one
that dies half way leaves at most a ``.partial``, which nothing loads; an existing ``<path>``
is never touched.

Each piece is written once, by one of its holders (save_agreement.py). The ranks must share the
file system that holds ``path``.

Before ``save`` returns, only what must be: the arguments are checked, the ranks agree that the
save may start (save_agreement.py: one small collective in steady state, so a bad path, an existing
``path`` or a rank's error is raised by ``save`` on every rank), and the tensors are copied
(snapshot.py); everything that reads only those copies and autoshard's own state (the claim,
the manifest, the files, the commit) runs in the background writer. What the caller may change
afterwards (``extra``, the optimizer's hyperparameters) is copied before ``save`` returns.
"""

import os
import sys
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from . import claim
from . import manifest as mf
from . import rng
from ..conventions.huggingface import config_json
from ..core.parallel_state import state_of
from .save_agreement import Agreement, PendingAgreement, claimed_message
from .contents import Held, json_value, model_holdings, optimizer_holdings
from .pending import WRITER, CheckpointGroup, CheckpointSaveError, SaveHandle, wait_for_pending_save
from .snapshot import Snapshot, SnapshotError, forget_buffers, take_snapshot
from ..tensor_io import full_selection, write_safetensors


def _check_arguments(path, model, optimizer, extra, async_save) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if path.endswith(mf.PARTIAL_SUFFIX):
        raise ValueError(f"save: path must not end with {mf.PARTIAL_SUFFIX!r} (kept for unfinished saves), got {path!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"save: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if not isinstance(async_save, bool):
        raise TypeError(f"save: async_save must be a bool, got {type(async_save).__name__}")
    return path


def _merge_optimizers(descriptions: List[Optional[dict]]) -> Optional[dict]:
    merged = None
    for description in descriptions:
        if description is None:
            continue
        if merged is None:
            merged = {**description, "state": dict(description["state"])}
        else:
            for name, entries in description["state"].items():
                merged["state"].setdefault(name, entries)
    return merged


def _tp_ranks(model: torch.nn.Module) -> Optional[List[int]]:
    """The global ranks of the group the model's sharded layers split over (None: no sharded layer)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    for module in model.modules():
        group = getattr(module, "group", None)
        if getattr(module, "shard_specs", None) and isinstance(group, dist.ProcessGroup):
            return list(dist.get_process_group_ranks(group))
    return None


def _manifest_start(comm: CheckpointGroup, model: torch.nn.Module, agreement: Agreement, aliases: Dict[str, str],
                    extra, metrics: Optional[Dict[str, float]]) -> mf.Manifest:
    """Rank 0's manifest as far as it is known before ``save`` returns; the background writer
    adds the plan's JSON (the plan is never changed once parallelize attached it), the merged
    optimizer description and the files."""
    autoshard = sys.modules.get("autoshard")
    versions = {"autoshard": getattr(autoshard, "__version__", "unknown"), "torch": torch.__version__}
    return mf.Manifest(world_size=comm.size, tensors=agreement.records, files={}, aliases=aliases,
                       tp_ranks=_tp_ranks(model), versions=versions, extra=extra, metrics=metrics,
                       model_config=config_json(model))


class _Job:
    """The part of a save that runs after the snapshot: claim, write, report, commit."""

    def __init__(self, comm: CheckpointGroup, path: str, snapshot: Union[Snapshot, str],
                 optimizer_description: Optional[dict], manifest: Optional[mf.Manifest], plan,
                 after_commit: Optional[Callable[[], None]], keeps_buffers: bool):
        self.comm = comm
        self.path = path
        self.partial = path + mf.PARTIAL_SUFFIX
        self.snapshot = snapshot
        self.optimizer_description = optimizer_description
        self.manifest, self.plan = manifest, plan  # on rank 0 only
        self.after_commit = after_commit
        self.token: Optional[str] = None  # rank 0's claim on self.partial
        self.keeps_buffers = keeps_buffers  # the snapshot's buffers are kept for the next save (async)

    def _agree(self, error: Optional[str]) -> None:
        """Rank 0's verdict, on every rank."""
        error = self.comm.broadcast(error)
        if error is not None:
            raise CheckpointSaveError(error)

    def run(self) -> None:
        """Claims, writes, reports and commits; a failure on any rank fails it on every rank,
        and then this rank drops its kept snapshot buffers."""
        finished = False
        try:
            self._run()
            finished = True
        finally:
            self.snapshot = None  # the host copy is not needed any more
            if not finished and self.keeps_buffers:
                forget_buffers()

    def _run(self) -> None:
        rank = self.comm.rank
        error = None
        if rank == 0:
            try:
                self.token = claim.claim(self.partial)
            except claim.ClaimedError as e:
                error = claimed_message(self.path, str(e))
            except Exception as e:
                error = f"save: cannot create {self.partial!r}: {e}"
        self._agree(error)

        record, error = None, None
        if isinstance(self.snapshot, str):
            error = f"rank {rank} could not copy its tensors for {self.path!r}: {self.snapshot}"
        else:
            try:
                tensors = self.snapshot.ready()
                if tensors:
                    record = write_safetensors(os.path.join(self.partial, mf.rank_file(rank)), tensors)
            except Exception as e:
                error = f"rank {rank} could not write {mf.rank_file(rank)!r} in {self.partial!r}: {type(e).__name__}: {e}"
            tensors = None
        self.snapshot = None  # the host copy is not needed any more
        reports = self.comm.all_gather((record, self.optimizer_description, error))

        error = None
        if rank == 0:
            errors = [e for _, _, e in reports if e is not None]
            if errors:
                error = "save: " + "; ".join(errors)
                claim.release(self.partial, self.token)
            else:
                error = self._commit([r for r, _, _ in reports], [o for _, o, _ in reports])
        self._agree(error)

    def _commit(self, records, optimizer_descriptions) -> Optional[str]:
        # Every failure before the rename removes our .partial (it holds the space a retry needs),
        # and none touches a .partial that is no longer ours.
        try:
            manifest = self.manifest
            manifest.plan = None if self.plan is None else self.plan.to_json()
            manifest.optimizer = _merge_optimizers(optimizer_descriptions)
            manifest.files = {
                mf.rank_file(r): mf.FileEntry(rec.size, list(rec.block_crc32))
                for r, rec in enumerate(records) if rec is not None
            }
            if not claim.owns(self.partial, self.token):
                return (f"save: {self.partial!r} is no longer this save's (it was removed or claimed by another job "
                        f"while the ranks wrote); {self.path!r} was not committed and that directory was left as it is")
            mf.write_manifest_and_commit(self.partial, manifest)
            if os.path.exists(self.path):
                claim.release(self.partial, self.token)
                return f"save: {self.path!r} appeared while saving; it was left as it is and this save was discarded"
            if not claim.owns(self.partial, self.token):
                return f"save: {self.partial!r} was taken over by another job before the commit; nothing was committed"
            os.rename(self.partial, self.path)
        except Exception as e:
            claim.release(self.partial, self.token)
            return f"save: committing {self.path!r} failed, and the unfinished save was removed: {e}"
        try:
            mf.fsync_directory(os.path.dirname(self.path))
        except Exception as e:
            return f"save: {self.path!r} was committed, but syncing its parent directory failed: {e}"
        if self.after_commit is not None:
            try:
                self.after_commit()
            except Exception as e:
                return f"save: {self.path!r} was committed, but what follows the commit failed: {e}"
        return None


def save(path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, extra=None,
         async_save: bool = False, rank_extra=None) -> SaveHandle:
    """Saves the model (and optimizer state, and JSON-able ``extra``) as a sharded checkpoint at
    ``path``, a directory that must not exist yet. Every rank calls it.

    ``extra`` is rank 0's (one value for the whole job, in the manifest); ``rank_extra`` is a
    JSON-able value of each rank's own (None: none), stored in that rank's file and returned to
    the same rank by ``load(..., return_rank_extra=True)`` at the same world size.

    With ``async_save``, the tensors are copied to host memory and written by a background
    thread; the returned handle's ``wait()`` blocks until the checkpoint is committed, and an
    error in the background is raised there or by the next save. One save is in flight at a
    time: a new save first waits for the previous one."""
    return save_checkpoint(path, model, optimizer, extra, async_save, rank_extra=rank_extra)


def save_checkpoint(path, model, optimizer=None, extra=None, async_save=False, metrics=None,
                    after_commit: Optional[Callable[[], None]] = None, rank_extra=None) -> SaveHandle:
    """save(), plus ``metrics`` recorded in the manifest and ``after_commit`` run on rank 0 once
    the checkpoint is committed (CheckpointManager's retention)."""
    generators = rng.capture()  # before anything else can draw from them
    path = _check_arguments(path, model, optimizer, extra, async_save)
    extra = json_value(extra, "extra")  # a copy: the caller may change theirs once save returns
    wait_for_pending_save()
    comm = WRITER.world_group.current()

    error, held, aliases, optimizer_description = None, [], {}, None
    try:
        targets, held, aliases = model_holdings(model)
        if optimizer is not None:
            optimizer_held, optimizer_description = optimizer_holdings(optimizer, targets)
            held += optimizer_held
        held += [Held(rng.key(comm.rank, name), state, full_selection(state.shape))
                 for name, state in generators.items()]
        if rank_extra is not None:
            own = rng.encode_extra(rank_extra)  # a copy: the caller may change theirs once save returns
            held.append(Held(rng.extra_key(comm.rank), own, full_selection(own.shape)))
    except (TypeError, ValueError) as e:
        error = f"rank {comm.rank}: {e}"
    if comm.rank == 0:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            missing = (f"save: the parent directory {parent!r} of {path!r} "
                       + ("is not a directory" if os.path.exists(parent) else "does not exist")
                       + "; create it first (nothing was written)")
            error = missing if error is None else f"{error}; {missing}"
    exists = comm.rank == 0 and os.path.exists(path)
    claimed = comm.rank == 0 and os.path.lexists(path + mf.PARTIAL_SUFFIX)
    pending = PendingAgreement(comm, path, held, error, exists, claimed)
    snapshot = None
    if async_save and pending.guess is not None:
        snapshot = _snapshot(held, pending.guess, comm.rank, copy=True)  # while the summaries travel
    agreement = pending.finish()
    if snapshot is None or agreement is not pending.guess:
        snapshot = _snapshot(held, agreement, comm.rank, copy=async_save)

    manifest = _manifest_start(comm, model, agreement, aliases, extra, metrics) if comm.rank == 0 else None
    plan = getattr(state_of(model), "plan", None)
    job = _Job(comm, path, snapshot, optimizer_description, manifest, plan, after_commit, async_save)
    if not async_save:
        job.run()
        return SaveHandle(path)
    return SaveHandle.in_background(path, job.run)


def _snapshot(held: List[Held], agreement: Agreement, rank: int, copy: bool) -> Union[Snapshot, str]:
    """The snapshot of what this rank writes, or the message of the error that stopped it
    (reported by the writer, so that every rank fails the save instead of the others waiting
    for this one; a message, not the exception, whose traceback would keep the buffers)."""
    mine = [(h.key, h.tensor) for h in held if agreement.writer[(h.key, repr(h.selection.to_json()["runs"]))] == rank]
    try:
        return take_snapshot(mine, copy=copy)
    except SnapshotError as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
