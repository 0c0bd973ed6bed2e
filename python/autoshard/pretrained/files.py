"""Where each tensor of a Hugging Face safetensors checkpoint lies: a single ``.safetensors``
file, or a directory holding ``model.safetensors.index.json`` (a sharded checkpoint, as
``save_pretrained`` writes once the model exceeds ``max_shard_size``) or ``model.safetensors``.
Only file headers are read here.

A file a checkpoint directory names (the index, or a shard) must resolve inside that directory
or, for a snapshot of a Hugging Face cache repository, inside the repository's ``blobs``: a
symbolic link elsewhere is refused (the rule is in docs/checkpoints.md)."""

import os
from contextlib import ExitStack
from typing import Dict, List

from ..conventions.huggingface import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, hub_cache_blobs
from ..tensor_io import SafetensorsReader, json_input

_MAX_INDEX_DEPTH = 16  # an index is {"metadata": {...}, "weight_map": {name: file}}


def _inside(directory: str, name: str, what: str) -> str:
    """The path of file ``name`` of ``directory``, refused if a symbolic link leads it out of
    the directory and, when it is a snapshot of a Hugging Face cache repository
    (``<repo>/snapshots/<revision>``, whose files are symbolic links to ``../../blobs/<hash>``),
    out of that repository's ``blobs``."""
    path = os.path.join(directory, name)
    real = os.path.realpath(path)
    roots = [os.path.realpath(directory)]
    blobs = hub_cache_blobs(roots[0])
    roots += [] if blobs is None else [blobs]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ValueError(f"load_pretrained: {path} ({what}) is a symbolic link to {real}, outside "
                         f"{' and '.join(roots)}; a checkpoint's files must lie in its directory (or, in a "
                         f"Hugging Face cache, in the repository's blobs)")
    return path


def _index_files(index_path: str) -> List[str]:
    """The files an index names, in the order they first appear, checked to exist."""
    directory = os.path.dirname(index_path)
    _inside(directory, os.path.basename(index_path), "the index")
    try:
        index = json_input.read_file(index_path, max_depth=_MAX_INDEX_DEPTH)
        if not isinstance(index, dict):
            raise TypeError("it is not a JSON object")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except json_input.JSONRefusal as refusal:
        raise ValueError(f"load_pretrained: {index_path}: {refusal.field} {refusal.problem}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"load_pretrained: {index_path} is not a safetensors index "
                         f"(a JSON object with a 'weight_map' of tensor name -> file): {error}") from None
    files = []
    for name in dict.fromkeys(weight_map.values()):
        path = os.path.join(directory, name)
        if os.path.basename(name) != name or name in ("", ".", "..") or not os.path.isfile(path):
            raise FileNotFoundError(f"load_pretrained: {index_path} names file {name!r}, "
                                    f"which is not in {directory}")
        files.append(_inside(directory, name, f"named by {SAFETENSORS_INDEX_FILE}['weight_map']"))
    return files


def checkpoint_files(path) -> List[str]:
    """The safetensors files of the checkpoint at ``path`` (a file or a directory)."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"load_pretrained: path must be a str or os.PathLike, got {type(path).__name__}") from None
    if os.path.isfile(path):
        return [path]  # a file named by the caller is read wherever it lies
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: no checkpoint at {path} (no such file or directory)")
    index_path = os.path.join(path, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(index_path):
        return _index_files(index_path)
    single = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return [_inside(path, SAFETENSORS_FILE, "the checkpoint's only file")]
    raise FileNotFoundError(f"load_pretrained: directory {path} holds neither {SAFETENSORS_INDEX_FILE} nor {SAFETENSORS_FILE}")


def open_checkpoint(path, stack: ExitStack) -> Dict[str, SafetensorsReader]:
    """Checkpoint tensor name -> the open reader of the file that holds it (closed with ``stack``)."""
    where: Dict[str, SafetensorsReader] = {}
    for file in checkpoint_files(path):
        reader = stack.enter_context(SafetensorsReader(file))
        for name in reader.tensors:
            if name in where:
                raise ValueError(f"load_pretrained: tensor {name!r} is stored twice, "
                                 f"in {where[name].path} and in {file}")
            where[name] = reader
    return where
