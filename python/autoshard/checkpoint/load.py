"""checkpoint.load: fills a model (and optimizer) from a checkpoint saved on any world size
with any plan. Each target tensor reads, from each saved piece that overlaps it, only the
overlapping byte ranges, and every block read is checked against the manifest's crc32."""

import contextlib
import math
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import manifest as mf
from . import rng
from ..runtime.optimizer_partition import piece_of
from .files import CheckpointFiles
from .validate import check_hyperparameters, check_state, step_problem
from .pending import wait_for_pending_save
from .contents import OPTIMIZER_PREFIX, Target, model_targets
from ..tensor_io import CheckpointCorruptError, Selection, full_selection


def _stored_name(target: Target, manifest: mf.Manifest) -> Optional[str]:
    for name in target.aliases:
        if name in manifest.tensors:
            return name
        if name in manifest.aliases:
            return manifest.aliases[name]
    return None


def _check_shape(what: str, record: mf.TensorRecord, shape) -> None:
    if list(record.shape) != list(shape):
        raise ValueError(f"load: {what} has global shape {list(shape)} in the model but {record.shape} "
                         "in the checkpoint")


def _model_reads(model, manifest: mf.Manifest, strict: bool) -> Tuple[Dict[str, Target], List[tuple]]:
    targets = model_targets(model)
    reads, missing, used = [], [], set()
    for name, target in targets.items():
        stored = _stored_name(target, manifest)
        if stored is None:
            missing.append(name)
            continue
        if target.tensor.device.type == "meta":
            raise ValueError(f"load: {name!r} is on the meta device; materialise the model first "
                             "(model.to_empty(device=...)) or load Hugging Face weights with autoshard.load_pretrained")
        _check_shape(repr(name), manifest.tensors[stored], target.selection.shape)
        used.add(stored)
        reads.append((stored, target.tensor.detach(), target.selection))
    unexpected = [k for k in manifest.tensors
                  if not k.startswith((OPTIMIZER_PREFIX, rng.PREFIX, rng.EXTRA_PREFIX)) and k not in used]
    if strict and (missing or unexpected):
        raise ValueError(f"load: the model and the checkpoint differ: missing from the checkpoint {missing}, "
                         f"not in the model {unexpected} (strict=False loads the tensors they share)")
    return targets, reads


def _optimizer_plan(optimizer, manifest: mf.Manifest, targets: Dict[str, Target], path: str = ""):
    """Validates the optimizer against the checkpoint; returns (hyperparameters per group,
    [(param, name, saved entries or None)])."""
    saved = manifest.optimizer
    if saved is None:
        raise ValueError("load: an optimizer was given but the checkpoint holds no optimizer state")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"load: the optimizer has {len(optimizer.param_groups)} param groups, the checkpoint "
                         f"{len(saved['param_groups'])}")
    check_hyperparameters(saved["param_groups"], optimizer, os.path.join(path, mf.MANIFEST))
    check_state(saved, optimizer, manifest.tensors, os.path.join(path, mf.MANIFEST))
    names = {id(t.tensor): name for name, t in targets.items()}
    params = []
    for g, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        group_names = []
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(f"load: optimizer.param_groups[{g}]['params'][{i}] is not a parameter of the model")
            group_names.append(names[id(p)])
            params.append((p, names[id(p)], saved["state"].get(names[id(p)])))
        if group_names != saved_group["params"]:
            raise ValueError(f"load: optimizer.param_groups[{g}] holds parameters {group_names}, the checkpoint's "
                             f"{saved_group['params']}")
    for p, name, entries in params:
        for key, entry in (entries or {}).items():
            if "tensor" in entry:
                record = manifest.tensors.get(entry["tensor"])
                if record is None:
                    raise CheckpointCorruptError(f"load: the manifest names optimizer state {entry['tensor']!r} "
                                                 "but records no such tensor")
                what = f"the optimizer state {key!r} of {name!r}"
                if entry["layout"] == "param":
                    _check_shape(what, record, targets[name].selection.shape)
                elif entry["layout"] == "flat":
                    _check_shape(what + " (flattened)", record, [math.prod(targets[name].selection.shape)])
    return [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]], params


def _apply_hyperparameters(optimizer, hyperparameters: List[dict]) -> None:
    for group, values in zip(optimizer.param_groups, hyperparameters):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value


def _cut(full: torch.Tensor, selection: Selection) -> torch.Tensor:
    for dim, runs in enumerate(selection.runs):
        if runs != ((0, full.shape[dim]),):
            full = torch.cat([full.narrow(dim, start, length) for start, length in runs], dim=dim)
    return full.contiguous()


def _state_through_full(files: CheckpointFiles, key: str, record: mf.TensorRecord, p: torch.Tensor,
                        selection: Selection) -> torch.Tensor:
    """A parameter's state tensor read whole, then cut to what this rank keeps: its piece when
    the parameter's state is partitioned (flattened), else the parameter's selection. Used
    where the stored and the kept layout differ (one side partitioned); such parameters are
    replicated on that side, so the whole tensor is no larger than the parameter itself."""
    full = files.read_whole(key).reshape(selection.shape)
    piece = piece_of(p)
    if piece is not None:
        kept = full.reshape(-1).narrow(0, piece.starts[piece.rank], piece.numel)
    else:
        kept = _cut(full, selection)
    return kept.to(device=p.device, dtype=_state_dtype(p, record), copy=True)


def _state_dtype(p: torch.Tensor, record: mf.TensorRecord) -> torch.dtype:
    """A parameter's state tensor keeps the dtype it was saved in when that is fp32 (master
    weights and the states stepped with them, for bf16 parameters); otherwise the parameter's."""
    saved = mf.dtype_of(record.dtype)
    return saved if saved == torch.float32 and p.is_floating_point() else p.dtype


def _state_tensor(existing, shape, dtype, device) -> torch.Tensor:
    if (isinstance(existing, torch.Tensor) and tuple(existing.shape) == tuple(shape) and existing.dtype == dtype
            and existing.device == device):
        return existing
    return torch.empty(shape, dtype=dtype, device=device)


def _optimizer_reads(params, targets: Dict[str, Target], manifest: mf.Manifest):
    """(stored key, selection read) of every optimizer state tensor the load reads."""
    for p, name, entries in params:
        for entry in (entries or {}).values():
            if "tensor" not in entry:
                continue
            record = manifest.tensors[entry["tensor"]]
            if entry["layout"] == "param" and piece_of(p) is None:
                yield entry["tensor"], targets[name].selection
            else:
                yield entry["tensor"], full_selection(record.shape)


def _check_stored_steps(params, manifest: mf.Manifest, files: CheckpointFiles, manifest_path: str) -> None:
    """Reads each ``step`` the checkpoint stores as a tensor and refuses one that is not a whole
    number >= 0 (after its blocks were verified; before anything is changed)."""
    for _, name, entries in params:
        entry = (entries or {}).get("step")
        if entry is None or "tensor" not in entry:
            continue
        if math.prod(manifest.tensors[entry["tensor"]].shape) != 1:
            continue  # refused by check_state for the optimizers whose state is known
        number = files.read_whole(entry["tensor"]).item()
        problem = step_problem(number if isinstance(number, (int, float)) else None)
        if problem is not None:
            raise CheckpointCorruptError(f"load: {manifest_path!r}: optimizer.state[{name!r}]['step'] (stored in "
                                         f"{entry['tensor']!r}) {problem}, got {number!r}")


def _load_optimizer_state(optimizer, params, targets: Dict[str, Target], manifest: mf.Manifest, files: CheckpointFiles) -> None:
    for p, name, entries in params:
        if not entries:
            optimizer.state.pop(p, None)
            continue
        existing = optimizer.state.get(p, {})
        state = {}
        for key, entry in entries.items():
            if "value" in entry:
                state[key] = entry["value"]
                continue
            record = manifest.tensors[entry["tensor"]]
            old = existing.get(key)
            if entry["layout"] == "flat" or (entry["layout"] == "param" and piece_of(p) is not None):
                state[key] = _state_through_full(files, entry["tensor"], record, p, targets[name].selection)
                continue
            if entry["layout"] == "param":
                tensor = _state_tensor(old, p.shape, _state_dtype(p, record), p.device)
                selection = targets[name].selection
            else:
                # Scalars (AdamW's step) live on the CPU, as torch's optimizers keep them.
                device = old.device if isinstance(old, torch.Tensor) else (
                    torch.device("cpu") if not record.shape else p.device)
                tensor = _state_tensor(old, record.shape, mf.dtype_of(record.dtype), device)
                selection = full_selection(record.shape)
            files.fill(entry["tensor"], tensor, selection)
            state[key] = tensor
        optimizer.state[p] = state


@torch.no_grad()
def load(path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True,
         restore_rng: bool = True, return_rank_extra: bool = False):
    """Loads the committed checkpoint at ``path`` into ``model`` (and ``optimizer``'s state and
    hyperparameters), whatever world size and plan saved it; returns the ``extra`` it was saved
    with, or with ``return_rank_extra`` the pair ``(extra, this rank's rank_extra)`` (None
    where this rank saved none; a checkpoint whose ranks saved one, loaded by another number
    of ranks, is refused before anything is changed). Refuses an unfinished or corrupt checkpoint with an error naming the file. Each rank
    reads only what it holds; no collective is issued. The model must be materialised.

    With ``restore_rng`` (the default), each rank's random number generators (torch's CPU and
    CUDA ones, Python's ``random``, numpy's global one) get back the states that same rank had
    when ``save`` was called, if as many ranks saved the checkpoint as load it; on another world
    size none is restored, with a warning (see rng.py)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load: path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"load: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if not isinstance(restore_rng, bool):
        raise TypeError(f"load: restore_rng must be a bool, got {type(restore_rng).__name__}")
    if not isinstance(return_rank_extra, bool):
        raise TypeError(f"load: return_rank_extra must be a bool, got {type(return_rank_extra).__name__}")
    path = os.path.abspath(os.fspath(path))
    wait_for_pending_save()  # a checkpoint still being written becomes loadable
    manifest = mf.read_manifest(path)
    targets, reads = _model_reads(model, manifest, strict)
    optimizer_plan = _optimizer_plan(optimizer, manifest, targets, path) if optimizer is not None else None
    with contextlib.ExitStack() as stack:
        files = CheckpointFiles(path, manifest, stack)
        # Every block the load will read is checked first (and then read again from the page
        # cache), so that a damaged checkpoint is refused before the model or optimizer changes.
        for key, _, selection in reads:
            files.verify(key, selection)
        if optimizer_plan is not None:
            for key, selection in _optimizer_reads(optimizer_plan[1], targets, manifest):
                files.verify(key, selection)
            _check_stored_steps(optimizer_plan[1], manifest, files, os.path.join(path, mf.MANIFEST))
        rank, world_size = _rank_and_world()
        own = (manifest.tensors, rank, world_size, manifest.world_size, files.read_whole, path)
        own_extra = rng.read_extra(*own) if return_rank_extra else None
        restore = rng.restorer(*own) if restore_rng else (lambda: None)
        for key, tensor, selection in reads:
            files.fill(key, tensor, selection)
        if optimizer_plan is not None:
            hyperparameters, params = optimizer_plan
            _load_optimizer_state(optimizer, params, targets, manifest, files)
            _apply_hyperparameters(optimizer, hyperparameters)
            # autoshard.optim makes the loaded state fit its master_weights setting.
            conform = getattr(optimizer, "conform_loaded_state", None)
            if callable(conform):
                conform()
        restore()
    return (manifest.extra, own_extra) if return_rank_extra else manifest.extra


def _rank_and_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
