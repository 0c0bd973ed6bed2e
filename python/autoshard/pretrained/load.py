"""load_pretrained(): a Hugging Face safetensors checkpoint into a (parallelized) model, each
rank reading only the byte ranges of its own slices.

The model may still be on the meta device (built under ``torch.device("meta")`` and
parallelized there): its tensors get storage at their local shape on the target device and
are read straight into it, so no rank ever holds a tensor it does not keep. Which part of
each full tensor a rank holds comes from the sharded modules' ``shard_specs``; the byte runs
that part occupies in the file (one run for a row slice, one per row for a column slice, one
per fused part for QKV) are computed in C++ (``autoshard.ops.copy_runs``).
"""

import math
import os
import re
from contextlib import ExitStack
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import Target, model_targets
from ..conventions.huggingface import IGNORED_MISSING_KEYS, IGNORED_UNEXPECTED_KEYS
from ..tensor_io import SafetensorsReader, Selection
from .files import open_checkpoint
from .initialise import check_computable, check_movable, initialise_remaining, materialize
from .names import StackedExpert, match_names, stacked_experts

_LISTED = 20  # names shown in an error before "... and N more"


def _listing(names: List[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _non_persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    found: Dict[str, torch.Tensor] = {}
    seen = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            buffer = module._buffers.get(name)
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                found[f"{module_name}.{name}" if module_name else name] = buffer
    return found


def _ignore_patterns(model: nn.Module, attribute: str) -> Optional[re.Pattern]:
    patterns = list(getattr(model, attribute, None) or ())
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def _target_device(model: nn.Module, device) -> torch.device:
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"load_pretrained: device must name a torch device (e.g. 'cpu', 'cuda:0'), "
                             f"got {device!r}") from None
    real = {t.device for t in list(model.parameters()) + list(model.buffers()) if t.device.type != "meta"}
    if len(real) == 1:
        return real.pop()
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def _check_arguments(model, dtype, strict, progress) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_pretrained: model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_pretrained: dtype must be None or a floating-point torch.dtype, got {dtype!r}")
    for name, value in (("strict", strict), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"load_pretrained: {name} must be a bool, got {type(value).__name__}")


def _expert_blocks(target: Target, entries: List[Tuple[str, StackedExpert]], where: Dict[str, SafetensorsReader]
                   ) -> Tuple[List[Tuple[str, Selection]], Optional[str]]:
    """(key, the block of the target's full tensor it holds) for per-expert checkpoint tensors
    stacked into `target` (see names.stacked_experts), or a problem: they must cover it exactly."""
    shape = tuple(target.selection.shape)
    first = entries[0][1]
    by_block = {(stacked.expert, stacked.part): key for key, stacked in entries}
    wanted = {(e, p) for e in range(shape[0]) for p in range(first.parts)} if len(shape) == 3 else set()
    if set(by_block) != wanted or len(by_block) != len(entries):
        return [], f"{target.name!r}: the per-expert tensors do not cover its {shape[0] if shape else 0} experts"
    blocks = []
    for (expert, part), key in sorted(by_block.items()):
        stored = tuple(where[key].tensors[key].shape)
        runs = [((expert, 1),)]
        for dim in (1, 2):
            size = stored[dim - 1] if len(stored) == 2 else -1
            offset = 0
            if dim == first.concat_dim:
                offset = sum(where[k].tensors[k].shape[dim - 1] for (e, p), k in by_block.items()
                             if e == expert and p < part)
            runs.append(((offset, size),))
        try:
            block = Selection(shape, tuple(runs))
        except ValueError:
            block = None
        if block is None or len(stored) != 2:
            return [], f"{key!r} of shape {list(stored)} is no block of {target.name!r} {list(shape)}"
        blocks.append((key, block))
    covered = sum(b.local_shape[1] * b.local_shape[2] for _, b in blocks)
    if covered != shape[0] * shape[1] * shape[2]:
        return [], f"the per-expert tensors of {target.name!r} do not cover its shape {list(shape)} exactly"
    return blocks, None


def _plan_reads(model: nn.Module, path, where: Dict[str, SafetensorsReader], targets: Dict[str, Target],
                computed: Dict[str, torch.Tensor], strict: bool
                ) -> List[Tuple[Target, str, SafetensorsReader, Optional[Selection]]]:
    """(target, checkpoint key, reader, the part of the target's full tensor the key holds (None:
    all of it)) for every tensor to read; every check is made here, before anything is changed."""
    by_alias = {alias: target for target in targets.values() for alias in target.aliases}
    matched, converted = match_names(model, where, list(by_alias) + list(computed))
    stacked: Dict[str, List[Tuple[str, StackedExpert]]] = {}
    for key, expert in stacked_experts(model, converted, by_alias).items():
        stacked.setdefault(by_alias[expert.name].name, []).append((key, expert))
    stacked_keys = {key for entries in stacked.values() for key, _ in entries}
    ignore_unexpected = _ignore_patterns(model, IGNORED_UNEXPECTED_KEYS)
    ignore_missing = _ignore_patterns(model, IGNORED_MISSING_KEYS)

    source: Dict[str, str] = {}  # target name -> checkpoint key; a tied tensor stored twice is read once
    unexpected = []
    for key in sorted(where):
        name = matched.get(key)
        if name in by_alias:
            source.setdefault(by_alias[name].name, key)
        elif name is None and key not in converted and not (ignore_unexpected and ignore_unexpected.search(key)):
            unexpected.append(key)
        # else: a buffer the model computes itself (older checkpoints saved some), or a key
        # that needs a conversion, reported below.
    mismatched = []
    stacked_reads = []
    for name, entries in stacked.items():
        if name in source:
            continue  # stored whole as well: read whole
        blocks, problem = _expert_blocks(targets[name], entries, where)
        if problem:
            mismatched.append(problem)
        stacked_reads += [(targets[name], key, where[key], block) for key, block in blocks]
    missing = [name for name in targets if name not in source and name not in stacked
               and not (ignore_missing and ignore_missing.search(name))]
    for name, key in source.items():
        target, info = targets[name], where[key].tensors[key]
        if tuple(info.shape) != tuple(target.selection.shape):
            mismatched.append(f"{key!r} in {where[key].path} has shape {list(info.shape)}, "
                              f"the model's {name!r} needs {list(target.selection.shape)}")
    problems = []
    if mismatched:
        problems.append("shapes differ: " + "; ".join(mismatched[:_LISTED]))
    converted = [key for key in converted if key not in stacked_keys]
    if converted:
        problems.append(f"tensors that only a conversion beyond renaming would load (not supported slice by "
                        f"slice): {_listing(converted)}")
    if strict and missing:
        problems.append(f"missing (the model has them, the checkpoint does not): {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected (the checkpoint has them, the model does not): {_listing(unexpected)}")
    if problems:
        raise ValueError(f"load_pretrained: the checkpoint at {os.fspath(path)} does not fit the model "
                         f"({type(model).__name__}): " + "; ".join(problems)
                         + ("; pass strict=False to load what matches" if strict and not (converted or mismatched) else ""))
    reads = [(targets[name], key, where[key], None) for name, key in source.items()] + stacked_reads
    reads.sort(key=lambda r: (r[2].path, r[2].tensors[r[1]].begin))  # each file front to back
    return reads


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415  (tqdm is optional)

    first = not dist.is_initialized() or dist.get_rank() == 0
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="load_pretrained",
                disable=not (enabled and first))


def _local_bytes(target: Target, reader: SafetensorsReader, key: str, block: Optional[Selection] = None) -> int:
    sizes = target.selection.local_shape
    if block is not None:  # the part of the block this rank holds
        sizes = [sum(max(0, min(s + k, b + m) - max(s, b)) for s, k in runs for b, m in block_runs)
                 for runs, block_runs in zip(target.selection.runs, block.runs)]
    return math.prod(sizes) * reader.tensors[key].dtype.itemsize


def _check_dtype_applies(targets: Dict[str, Target], dtype: Optional[torch.dtype]) -> None:
    """`dtype` chooses the dtype of tensors given storage here (those on meta); a materialised
    floating-point tensor of another dtype would silently keep its own, so that is refused."""
    if dtype is None:
        return
    for target in targets.values():
        tensor = target.tensor
        if tensor.device.type != "meta" and tensor.is_floating_point() and tensor.dtype != dtype:
            raise ValueError(f"load_pretrained: dtype={dtype} applies to tensors on the meta device, but "
                             f"{target.name!r} is already materialised as {tensor.dtype}; convert the model first "
                             f"(model.to({dtype})) or pass dtype=None to load into the model's own dtypes")


def load_pretrained(model: nn.Module, path, device=None, dtype: Optional[torch.dtype] = None,
                    strict: bool = True, progress: bool = True) -> nn.Module:
    """Loads the Hugging Face safetensors checkpoint at ``path`` (a ``.safetensors`` file, or a
    directory with ``model.safetensors.index.json`` or ``model.safetensors``) into ``model``,
    parallelized or not, on the meta device or materialized; returns the model.

    Each rank reads only the bytes of the slices it holds. Tensors on the meta device get
    storage on ``device`` (default: the device of the model's other tensors, else
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), in ``dtype`` for floating-point
    ones (default: the model's own); materialized tensors are filled where they are, cast to
    their dtype (a ``dtype`` other than theirs is an error, raised before anything changes).
    A file's tensors of the destination's dtype (bf16 into a bf16 model) are read straight into
    place, with no copy in another dtype on the way. Buffers the checkpoint does not hold (rotary ``inv_freq``, ``position_ids``)
    are computed by the model's own initialisation. With ``strict``, tensors the model has
    and the checkpoint lacks, or the reverse, are an error (raised before anything changes).
    A progress bar over the bytes read shows on rank 0 when ``progress``."""
    _check_arguments(model, dtype, strict, progress)
    target_device = _target_device(model, device)
    with ExitStack() as stack:
        where = open_checkpoint(path, stack)
        targets = model_targets(model)
        computed = _non_persistent_buffers(model)
        reads = _plan_reads(model, path, where, targets, computed, strict)
        read_names = {target.name for target, _, _, _ in reads}
        left = {**{t.name: t.tensor for t in targets.values() if t.name not in read_names}, **computed}

        check_movable({**{t.name: t.tensor for t in targets.values()}, **computed})
        _check_dtype_applies(targets, dtype)
        check_computable(model, left)

        def dtype_of(tensor: torch.Tensor) -> torch.dtype:
            return dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype

        loaded: Dict[str, torch.Tensor] = {}
        for target, _, _, _ in reads:
            if target.tensor.device.type == "meta":
                materialize(target.tensor, target_device, dtype_of(target.tensor))
            loaded[target.name] = target.tensor
        pending: Dict[str, torch.Tensor] = {}
        for name, tensor in left.items():
            if tensor.device.type == "meta":
                materialize(tensor, target_device, dtype_of(tensor) if isinstance(tensor, nn.Parameter) else tensor.dtype)
                pending[name] = tensor

        total = sum(_local_bytes(t, rd, k, b) for t, k, rd, b in reads)
        with torch.no_grad(), _progress_bar(total, progress) as bar:
            for target, key, reader, block in reads:
                dest = target.tensor
                staging = dest if dest.is_contiguous() else torch.empty(dest.shape, dtype=dest.dtype,
                                                                        device=dest.device)
                if block is not None and staging is not dest:
                    staging.copy_(dest)  # other blocks already read into it
                reader.read_into(key, staging, target.selection, block, keep_rest=block is not None)
                if staging is not dest:
                    dest.copy_(staging)
                bar.update(_local_bytes(target, reader, key, block))
    initialise_remaining(model, pending, loaded)
    return model
