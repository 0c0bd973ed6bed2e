"""The manifest of a checkpoint directory, and the marker that commits it.

``manifest.json`` says what the checkpoint holds: for every tensor its global shape and dtype
and, for each saved piece, the file and the selection (the part of the global tensor) it
holds; for every file its size and the crc32 of each block; the world it was saved from;
the plan; the optimizer's hyperparameters; the caller's ``extra``. ``COMMITTED`` is written
last and holds the manifest's own size and crc32: a directory without it was never finished,
and a manifest that does not match it is corrupt.
"""

import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..tensor_io import CheckpointCorruptError, Selection, json_input
from . import validate

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
PARTIAL_SUFFIX = ".partial"
# A manifest is read only if it holds at most json_input.MAX_JSON_BYTES (the safetensors
# library's header limit) and nests at most this deep; save refuses an `extra` (or optimizer
# value) that would nest deeper than MAX_VALUE_DEPTH, which leaves room for the levels above it.
MAX_MANIFEST_DEPTH = 64
MAX_VALUE_DEPTH = 48
_MAX_MARKER_BYTES = 4096


class UncommittedCheckpointError(RuntimeError):
    """A directory that is not a finished checkpoint (no commit marker, or a .partial one)."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class StoredPiece:
    """Part of a tensor as saved: the rank file holding it and the part of the global tensor."""

    file: str
    runs: List[List[List[int]]]  # per dim, [start, length] runs of the global tensor

    def selection(self, shape) -> Selection:
        return Selection.from_json({"shape": list(shape), "runs": self.runs})


@dataclass
class TensorRecord:
    shape: List[int]
    dtype: str
    pieces: List[StoredPiece]


@dataclass
class FileEntry:
    size: int
    block_crc32: List[int]


@dataclass
class Manifest:
    world_size: int
    tensors: Dict[str, TensorRecord]  # model tensors under their names, optimizer state under optimizer/...
    files: Dict[str, FileEntry]
    aliases: Dict[str, str] = field(default_factory=dict)  # a tied tensor's other names -> its stored name
    tp_ranks: Optional[List[int]] = None  # global ranks of the tensor-parallel group
    versions: Dict[str, str] = field(default_factory=dict)
    plan: Optional[str] = None  # ShardingPlan.to_json() of the saving model
    optimizer: Optional[Dict[str, Any]] = None  # {"type", "param_groups", "state"}: see contents.py
    extra: Any = None
    metrics: Optional[Dict[str, float]] = None
    model_config: Optional[str] = None  # a Hugging Face model's config.to_json_string()
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        return cls.from_data(json.loads(text))

    @classmethod
    def from_data(cls, data: dict) -> "Manifest":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version!r}, expected {FORMAT_VERSION}")
        data["tensors"] = {
            name: TensorRecord(t["shape"], t["dtype"], [StoredPiece(**p) for p in t["pieces"]])
            for name, t in data["tensors"].items()
        }
        data["files"] = {name: FileEntry(**f) for name, f in data["files"].items()}
        return cls(**data)


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest_and_commit(directory: str, manifest: Manifest) -> None:
    """Writes manifest.json, then the COMMITTED marker that vouches for it, both fsynced."""
    data = manifest.to_json().encode()
    write_durably(os.path.join(directory, MANIFEST), data)
    marker = {"manifest_size": len(data), "manifest_crc32": zlib.crc32(data)}
    write_durably(os.path.join(directory, COMMITTED), json.dumps(marker).encode())
    fsync_directory(directory)


def is_committed(path: str) -> bool:
    return (not os.fspath(path).rstrip("/").endswith(PARTIAL_SUFFIX)
            and os.path.isfile(os.path.join(path, COMMITTED)))


def read_manifest(path, function: str = "load") -> Manifest:
    """The manifest of the committed checkpoint at ``path``; refuses an unfinished or corrupt one."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{function}: no checkpoint directory at {path!r}")
    if path.rstrip("/").endswith(PARTIAL_SUFFIX):
        raise UncommittedCheckpointError(f"{function}: {path!r} is an unfinished save (a {PARTIAL_SUFFIX} "
                                         "directory); it cannot be loaded")
    marker_path = os.path.join(path, COMMITTED)
    if not os.path.isfile(marker_path):
        raise UncommittedCheckpointError(f"{function}: {path!r} has no {COMMITTED} marker: the save that "
                                         "wrote it did not finish")
    manifest_path = os.path.join(path, MANIFEST)
    for file_path in (marker_path, manifest_path):
        # A symbolic link may not lead out of the checkpoint directory (see files.py).
        if os.path.dirname(os.path.realpath(file_path)) != os.path.realpath(path):
            raise CheckpointCorruptError(f"{function}: {file_path!r} is a symbolic link to "
                                         f"{os.path.realpath(file_path)!r}, outside the checkpoint directory")
    try:
        marker = json_input.read_file(marker_path, max_depth=1, limit=_MAX_MARKER_BYTES)
        size = os.path.getsize(manifest_path)
    except json_input.JSONRefusal as refusal:
        raise CheckpointCorruptError(f"{function}: {marker_path!r}: {refusal.field} {refusal.problem}") from None
    except (OSError, ValueError) as error:
        raise CheckpointCorruptError(f"{function}: cannot read {marker_path!r} or {manifest_path!r}: {error}") from error
    if not isinstance(marker, dict):
        raise CheckpointCorruptError(f"{function}: {marker_path!r} is not a JSON object")
    if size > json_input.MAX_JSON_BYTES:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r} holds {size} bytes, more than the "
                                     f"{json_input.MAX_JSON_BYTES} a manifest may hold")
    try:
        with open(manifest_path, "rb") as f:
            data = f.read(json_input.MAX_JSON_BYTES + 1)
    except OSError as error:
        raise CheckpointCorruptError(f"{function}: cannot read {manifest_path!r}: {error}") from error
    if len(data) != marker.get("manifest_size") or zlib.crc32(data) != marker.get("manifest_crc32"):
        raise CheckpointCorruptError(f"{function}: {manifest_path!r} is corrupt: its size or crc32 differs "
                                     f"from what {COMMITTED} records")
    try:
        raw = json_input.loads(data, MAX_MANIFEST_DEPTH)
    except json_input.JSONRefusal as refusal:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r}: {refusal.field} {refusal.problem}") from None
    except ValueError as error:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r} is not valid JSON: {error}") from error
    if isinstance(raw, dict) and raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r} has format version {raw.get('format_version')!r}, "
                                     f"this autoshard reads {FORMAT_VERSION}")
    validate.check_manifest_data(raw, manifest_path, function)
    try:
        manifest = Manifest.from_data(raw)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r} is not a valid manifest: {error}") from error
    validate.check_coverage(manifest.tensors, manifest_path, function)
    return manifest
