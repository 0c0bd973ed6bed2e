"""Where each tensor of a Hugging Face safetensors checkpoint lies: a single ``.safetensors``
file, or a directory holding ``model.safetensors.index.json`` (a sharded checkpoint, as
``save_pretrained`` writes once the model exceeds ``max_shard_size``) or ``model.safetensors``.
Only file headers are read here."""

import json
import os
from contextlib import ExitStack
from typing import Dict, List

from ..tensor_io import SafetensorsReader

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _index_files(index_path: str) -> List[str]:
    """The files an index names, in the order they first appear, checked to exist."""
    try:
        with open(index_path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"load_pretrained: {index_path} is not a safetensors index "
                         f"(a JSON object with a 'weight_map' of tensor name -> file): {error}") from None
    directory = os.path.dirname(index_path)
    files = []
    for name in dict.fromkeys(weight_map.values()):
        path = os.path.join(directory, name)
        if os.path.basename(name) != name or not os.path.isfile(path):
            raise FileNotFoundError(f"load_pretrained: {index_path} names file {name!r}, "
                                    f"which is not in {directory}")
        files.append(path)
    return files


def checkpoint_files(path) -> List[str]:
    """The safetensors files of the checkpoint at ``path`` (a file or a directory)."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"load_pretrained: path must be a str or os.PathLike, got {type(path).__name__}") from None
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: no checkpoint at {path} (no such file or directory)")
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index_path):
        return _index_files(index_path)
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"load_pretrained: directory {path} holds neither {INDEX_NAME} nor {SINGLE_NAME}")


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
