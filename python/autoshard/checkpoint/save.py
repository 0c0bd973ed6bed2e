"""checkpoint.save: every rank writes its pieces, one rank commits, atomically.

The protocol: rank 0 claims ``<path>.partial/`` exclusively (claim.py: a save to a path that
another save holds fails on every rank, and nothing deletes a ``.partial`` it does not own);
every rank that owns a piece writes ``rank-XXXXX.safetensors`` into it and fsyncs it; the
ranks report to rank 0, which checks its claim, writes ``manifest.json``, then the
``COMMITTED`` marker, fsyncs the directory, checks its claim again, renames it to ``<path>``
and fsyncs the parent. A save that fails removes its ``.partial`` on every failure path; one
that dies half way leaves at most a ``.partial``, which nothing loads; an existing ``<path>``
is never touched.

Each piece is written once: a tensor held whole by every rank (a replicated parameter) or a
shard held by several data-parallel replicas is written by one of its holders, chosen to
balance the bytes each rank writes. The ranks must share the file system that holds ``path``.
"""

import math
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import claim
from . import manifest as mf
from ..model_state import state_of
from .contents import Held, json_value, model_holdings, optimizer_holdings
from .group import CheckpointGroup, checkpoint_group
from .pending import CheckpointSaveError, SaveHandle, track, wait_for_pending_save
from .snapshot import Snapshot, take_snapshot
from ..tensor_io import write_safetensors


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
    json_value(extra, "extra")
    return path


def _describe(held: List[Held]) -> List[tuple]:
    """(key, dtype, global shape, runs) of each held tensor: what the ranks exchange to plan writes."""
    return [(h.key, mf.dtype_name(h.tensor.dtype), list(h.selection.shape), h.selection.to_json()["runs"])
            for h in held]


def _assign_writers(described: List[List[tuple]]) -> Dict[tuple, int]:
    """(key, runs as a tuple) -> the rank that writes that piece: the holder that has been given
    the fewest bytes so far (the same answer on every rank)."""
    holders: Dict[tuple, List[int]] = {}
    sizes: Dict[tuple, int] = {}
    for rank, items in enumerate(described):
        for key, dtype, shape, runs in items:
            piece = (key, repr(runs))
            holders.setdefault(piece, []).append(rank)
            volume = math.prod(sum(length for _, length in dim_runs) for dim_runs in runs)
            sizes[piece] = volume * torch.empty((), dtype=mf.dtype_of(dtype)).element_size()
    load = [0] * len(described)
    writer = {}
    for piece, ranks in holders.items():
        chosen = min(ranks, key=lambda r: (load[r], r))
        writer[piece] = chosen
        load[chosen] += sizes[piece]
    return writer


def _tensor_records(described: List[List[tuple]], writer: Dict[tuple, int]) -> Dict[str, mf.TensorRecord]:
    records: Dict[str, mf.TensorRecord] = {}
    for rank, items in enumerate(described):
        for key, dtype, shape, runs in items:
            record = records.get(key)
            if record is None:
                record = records[key] = mf.TensorRecord(shape, dtype, [])
            elif record.shape != shape or record.dtype != dtype:
                raise ValueError(f"save: the ranks disagree on {key!r}: global shape {record.shape} and dtype "
                                 f"{record.dtype} on one rank, {shape} and {dtype} on rank {rank}")
            if writer[(key, repr(runs))] == rank:
                record.pieces.append(mf.StoredPiece(mf.rank_file(rank), runs))
    return records


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


def _plan_json(model: torch.nn.Module) -> Optional[str]:
    state = state_of(model)  # attached by parallelize
    return None if state is None or state.plan is None else state.plan.to_json()


def _versions() -> Dict[str, str]:
    autoshard = sys.modules.get("autoshard")
    return {"autoshard": getattr(autoshard, "__version__", "unknown"), "torch": torch.__version__}


def _model_config(model: torch.nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


class _Job:
    """The part of a save that runs after the snapshot: write, report, commit."""

    def __init__(self, comm: CheckpointGroup, path: str, snapshot: Snapshot, manifest: Optional[mf.Manifest],
                 after_commit: Optional[Callable[[], None]]):
        self.comm = comm
        self.path = path
        self.partial = path + mf.PARTIAL_SUFFIX
        self.snapshot = snapshot
        self.manifest = manifest  # on rank 0 only
        self.after_commit = after_commit
        self.token: Optional[str] = None  # rank 0's claim on self.partial

    def _agree(self, error: Optional[str]) -> None:
        """Rank 0's verdict, on every rank."""
        error = self.comm.broadcast(error)
        if error is not None:
            raise CheckpointSaveError(error)

    def run(self) -> None:
        rank = self.comm.rank
        error = None
        if rank == 0:
            try:
                self.token = claim.claim(self.partial)
            except claim.ClaimedError as e:
                error = _claimed_message(self.path, str(e))
            except Exception as e:
                error = f"save: cannot create {self.partial!r}: {e}"
        self._agree(error)

        record, error = None, None
        try:
            tensors = self.snapshot.ready()
            if tensors:
                record = write_safetensors(os.path.join(self.partial, mf.rank_file(rank)), tensors)
        except Exception as e:
            error = f"rank {rank} could not write {mf.rank_file(rank)!r} in {self.partial!r}: {e}"
        finally:
            self.snapshot = None  # release the host copy as soon as it is written
        reports = self.comm.gather((record, error))

        error = None
        if rank == 0:
            errors = [e for _, e in reports if e is not None]
            if errors:
                error = "save: " + "; ".join(errors)
                claim.release(self.partial, self.token)
            else:
                error = self._commit([r for r, _ in reports])
        self._agree(error)

    def _commit(self, records) -> Optional[str]:
        # Every failure before the rename removes our .partial (it holds the space a retry needs),
        # and none touches a .partial that is no longer ours.
        try:
            self.manifest.files = {
                mf.rank_file(r): mf.FileEntry(rec.size, list(rec.block_crc32))
                for r, rec in enumerate(records) if rec is not None
            }
            if not claim.owns(self.partial, self.token):
                return (f"save: {self.partial!r} is no longer this save's (it was removed or claimed by another job "
                        f"while the ranks wrote); {self.path!r} was not committed and that directory was left as it is")
            mf.write_manifest_and_commit(self.partial, self.manifest)
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


def _claimed_message(path: str, detail: str) -> str:
    return (f"save: another save to {path!r} is in progress, or one that died left its work behind: {detail}. "
            f"Nothing was written. If no job is saving there, delete that directory (CheckpointManager removes "
            f"the leftovers of dead saves when it starts)")


def save(path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, extra=None,
         async_save: bool = False) -> SaveHandle:
    """Saves the model (and optimizer state, and JSON-able ``extra``) as a sharded checkpoint at
    ``path``, a directory that must not exist yet. Every rank calls it.

    With ``async_save``, the tensors are copied to host memory and written by a background
    thread; the returned handle's ``wait()`` blocks until the checkpoint is committed, and an
    error in the background is raised there or by the next save. One save is in flight at a
    time: a new save first waits for the previous one."""
    return save_checkpoint(path, model, optimizer, extra, async_save)


def save_checkpoint(path, model, optimizer=None, extra=None, async_save=False, metrics=None,
                    after_commit: Optional[Callable[[], None]] = None) -> SaveHandle:
    """save(), plus ``metrics`` recorded in the manifest and ``after_commit`` run on rank 0 once
    the checkpoint is committed (CheckpointManager's retention)."""
    path = _check_arguments(path, model, optimizer, extra, async_save)
    wait_for_pending_save()
    comm = checkpoint_group()

    error, held, aliases, optimizer_description, targets = None, [], {}, None, None
    try:
        targets, held, aliases = model_holdings(model)
        if optimizer is not None:
            optimizer_held, optimizer_description = optimizer_holdings(optimizer, targets)
            held += optimizer_held
    except (TypeError, ValueError) as e:
        error = f"rank {comm.rank}: {e}"
    exists = os.path.exists(path) if comm.rank == 0 else False
    claimed = os.path.lexists(path + mf.PARTIAL_SUFFIX) if comm.rank == 0 else False
    reports = comm.all_gather((error, (exists, claimed), _describe(held), optimizer_description, path))
    errors = [e for e, _, _, _, _ in reports if e is not None]
    paths = sorted({p for *_, p in reports})
    if len(paths) > 1:
        errors.append(f"every rank must pass the same path, got {paths}")
    if errors:
        raise ValueError("; ".join(errors))
    exists, claimed = reports[0][1]
    if claimed and not exists:
        partial = path + mf.PARTIAL_SUFFIX
        raise CheckpointSaveError(_claimed_message(path, f"{partial!r} exists: {claim.describe_owner(partial)}"))
    if exists:
        raise FileExistsError(f"save: {path!r} already exists; a checkpoint is never overwritten, "
                              "choose a new path or delete the old one first")

    described = [d for _, _, d, _, _ in reports]
    writer = _assign_writers(described)
    records = _tensor_records(described, writer)  # on every rank, so that a mismatch raises on all
    manifest = None
    if comm.rank == 0:
        manifest = mf.Manifest(
            world_size=comm.size, tensors=records, files={}, aliases=aliases,
            tp_ranks=_tp_ranks(model), versions=_versions(), plan=_plan_json(model),
            optimizer=_merge_optimizers([o for _, _, _, o, _ in reports]), extra=json_value(extra, "extra"),
            metrics=metrics, model_config=_model_config(model))
    mine = [(h.key, h.tensor) for h in held if writer[(h.key, repr(h.selection.to_json()["runs"]))] == comm.rank]
    job = _Job(comm, path, take_snapshot(mine, copy=async_save), manifest, after_commit)
    if not async_save:
        job.run()
        return SaveHandle(path)
    return track(SaveHandle.in_background(path, job.run))
