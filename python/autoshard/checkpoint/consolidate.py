"""consolidate: a sharded checkpoint turned into a plain Hugging Face safetensors checkpoint.

Streamed: every output file's header is computed first from the manifest, then each tensor is
assembled and written a block of rows at a time, each block read from the overlapping pieces
of the rank files. At most one block of rows (about 64 MiB) is held in memory at once, never
a whole tensor, let alone the model. Tied tensors are written once, under their first name,
as ``save_pretrained`` does; optimizer state is left out.
"""

import contextlib
import json
import math
import os
import re
from typing import Dict, List, Optional

import torch

from . import manifest as mf
from . import rng
from .contents import OPTIMIZER_PREFIX
from .files import CheckpointFiles
from ..conventions.huggingface import CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, safetensors_shard_file
from ..tensor_io import SafetensorsWriter, Selection, tensor_bytes

_ROW_BLOCK_BYTES = 64 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", value.upper())
        if match and match.group(2) in _UNITS and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[match.group(2)])
    raise ValueError(f"consolidate: max_shard_size must be a positive number of bytes or a size such as '5GB', "
                     f"got {value!r}")


def _nbytes(record: mf.TensorRecord) -> int:
    return math.prod(record.shape) * mf.dtype_of(record.dtype).itemsize


def _group_files(names: List[str], tensors: Dict[str, mf.TensorRecord], limit: Optional[int]) -> List[List[str]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    files, current, filled = [], [], 0
    for name in names:
        size = _nbytes(tensors[name])
        if current and limit is not None and filled + size > limit:
            files.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current or not files:
        files.append(current)
    return files


def _row_blocks(shape: List[int], itemsize: int):
    """Selections of consecutive rows (dim 0) of about _ROW_BLOCK_BYTES each covering the tensor."""
    if not shape:
        yield Selection((), ())
        return
    rows = max(1, _ROW_BLOCK_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    rest = tuple(((0, size),) for size in shape[1:])
    for start in range(0, max(shape[0], 1), rows):
        length = min(rows, shape[0] - start)
        yield Selection(tuple(shape), (((start, length),),) + rest)


def _write_file(path: str, names: List[str], files: CheckpointFiles, tensors: Dict[str, mf.TensorRecord]) -> None:
    writer = SafetensorsWriter(path, {n: (mf.dtype_of(tensors[n].dtype), tuple(tensors[n].shape)) for n in names},
                               {"format": "pt"})
    try:
        for name in names:
            record = tensors[name]
            dtype = mf.dtype_of(record.dtype)
            for block in _row_blocks(record.shape, dtype.itemsize):
                buffer = torch.empty(block.local_shape, dtype=dtype)
                files.fill(name, buffer, block)
                writer.write(name, tensor_bytes(buffer))
        writer.close()
    except BaseException:
        writer.abort()
        os.remove(path)
        raise


def consolidate(path, out_dir, max_shard_size=None) -> List[str]:
    """Writes the model tensors of the checkpoint at ``path`` into ``out_dir`` as a Hugging Face
    checkpoint: ``model.safetensors``, or with ``max_shard_size`` (bytes, or "5GB") several
    ``model-XXXXX-of-YYYYY.safetensors`` files and ``model.safetensors.index.json``; plus
    ``config.json`` when the saved model had a Hugging Face config. Runs in one process; no
    torch.distributed needed. Returns the paths written."""
    for name, value in (("path", path), ("out_dir", out_dir)):
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"consolidate: {name} must be a str or os.PathLike, got {type(value).__name__}")
    limit = _parse_size(max_shard_size)
    path, out_dir = os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(out_dir))
    manifest = mf.read_manifest(path, "consolidate")
    names = [k for k in manifest.tensors if not k.startswith((OPTIMIZER_PREFIX, rng.PREFIX, rng.EXTRA_PREFIX))]
    groups = _group_files(names, manifest.tensors, limit)
    file_names = ([SAFETENSORS_FILE] if len(groups) == 1 else
                  [safetensors_shard_file(i + 1, len(groups)) for i in range(len(groups))])
    outputs = [os.path.join(out_dir, n) for n in file_names]
    if len(groups) > 1:
        outputs.append(os.path.join(out_dir, SAFETENSORS_INDEX_FILE))
    if manifest.model_config is not None:
        outputs.append(os.path.join(out_dir, CONFIG_FILE))
    clashes = [p for p in outputs + [os.path.join(out_dir, SAFETENSORS_FILE), os.path.join(out_dir, SAFETENSORS_INDEX_FILE)]
               if os.path.exists(p)]
    if clashes:
        raise FileExistsError(f"consolidate: {clashes[0]!r} already exists; choose an empty out_dir")
    os.makedirs(out_dir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        files = CheckpointFiles(path, manifest, stack)
        for file_name, group in zip(file_names, groups):
            _write_file(os.path.join(out_dir, file_name), group, files, manifest.tensors)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(manifest.tensors[n]) for n in names)},
                 "weight_map": {n: f for f, group in zip(file_names, groups) for n in group}}
        with open(os.path.join(out_dir, SAFETENSORS_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    if manifest.model_config is not None:
        with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
            f.write(manifest.model_config)
    return outputs
