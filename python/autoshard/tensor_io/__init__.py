"""Tensors in files, part by part: which part of a full tensor a local one holds
(``Selection``), and reading and writing those parts of safetensors files byte range by byte
range. Both autoshard's checkpoints and the loading of Hugging Face checkpoints stand on it."""

from .safetensors import (
    BLOCK_SIZE,
    CheckpointCorruptError,
    FileRecord,
    SafetensorsReader,
    SafetensorsWriter,
    TensorInfo,
    tensor_bytes,
    write_safetensors,
)
from .selection import Selection, byte_runs, full_selection, selection_of

__all__ = [
    "BLOCK_SIZE",
    "CheckpointCorruptError",
    "FileRecord",
    "SafetensorsReader",
    "SafetensorsWriter",
    "Selection",
    "TensorInfo",
    "byte_runs",
    "full_selection",
    "selection_of",
    "tensor_bytes",
    "write_safetensors",
]
