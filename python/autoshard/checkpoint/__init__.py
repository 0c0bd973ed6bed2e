"""Sharded checkpoints: each rank reads and writes only its own byte ranges."""

from .safetensors_io import CheckpointCorruptError, SafetensorsReader, write_safetensors
from .selection import Selection, full_selection, selection_of
from .targets import Target, model_targets

__all__ = [
    "CheckpointCorruptError",
    "SafetensorsReader",
    "Selection",
    "Target",
    "full_selection",
    "model_targets",
    "selection_of",
    "write_safetensors",
]
