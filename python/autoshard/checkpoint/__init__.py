"""Sharded checkpoints: each rank reads and writes only its own byte ranges.

``save`` writes a checkpoint atomically (optionally in the background), ``load`` reads it
back on any world size and plan, ``CheckpointManager`` keeps a rolling set of them, and
``consolidate`` turns one into a plain Hugging Face safetensors checkpoint.
"""

from .consolidate import consolidate
from .load import load
from .manager import CheckpointManager
from .manifest import Manifest, UncommittedCheckpointError, read_manifest
from .pending import CheckpointSaveError, SaveHandle, wait_for_pending_save
from .save import save
from .snapshot import release_snapshot_buffers
from .contents import Target, model_targets
from ..tensor_io import (
    CheckpointCorruptError,
    SafetensorsReader,
    Selection,
    full_selection,
    selection_of,
    write_safetensors,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointSaveError",
    "Manifest",
    "SafetensorsReader",
    "SaveHandle",
    "Selection",
    "Target",
    "UncommittedCheckpointError",
    "consolidate",
    "full_selection",
    "load",
    "model_targets",
    "read_manifest",
    "release_snapshot_buffers",
    "save",
    "selection_of",
    "wait_for_pending_save",
    "write_safetensors",
]
