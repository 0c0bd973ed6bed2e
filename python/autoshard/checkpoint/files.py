"""The files of one committed checkpoint, read piece by piece: each rank file is opened, and
its size checked against the manifest, the first time a tensor needs it."""

import contextlib
import os
from typing import Dict

import torch

from . import manifest as mf
from .validate import plain_file_name
from ..tensor_io import CheckpointCorruptError, SafetensorsReader, Selection, full_selection


def _overlaps(a: Selection, b: Selection) -> bool:
    for runs_a, runs_b in zip(a.runs, b.runs):
        if not any(sa < sb + nb and sb < sa + na for sa, na in runs_a for sb, nb in runs_b if na and nb):
            return False
    return True


class CheckpointFiles:
    """Readers of a checkpoint's files, each opened (and its size checked) on first use."""

    def __init__(self, path: str, manifest: mf.Manifest, stack: contextlib.ExitStack):
        self.path = path
        self.manifest = manifest
        self.stack = stack
        self.readers: Dict[str, SafetensorsReader] = {}

    def reader(self, name: str) -> SafetensorsReader:
        if name not in self.readers:
            file_path = os.path.join(self.path, name)
            # read_manifest admits plain file names only; a symbolic link may still lead out.
            if not plain_file_name(name) or os.path.dirname(os.path.realpath(file_path)) != os.path.realpath(self.path):
                raise CheckpointCorruptError(f"load: {os.path.join(self.path, mf.MANIFEST)!r} names {name!r}, which is "
                                             f"not a file inside {self.path!r}")
            entry = self.manifest.files.get(name)
            if entry is None:
                raise CheckpointCorruptError(f"load: {os.path.join(self.path, mf.MANIFEST)!r} names {name!r} "
                                             "but records no size or checksums for it")
            try:
                size = os.path.getsize(file_path)
            except OSError as error:
                raise CheckpointCorruptError(f"load: cannot read {file_path!r}: {error}") from error
            if size != entry.size:
                raise CheckpointCorruptError(f"load: {file_path!r} has {size} bytes; the manifest records {entry.size}")
            self.readers[name] = self.stack.enter_context(SafetensorsReader(file_path, block_crc32=entry.block_crc32))
        return self.readers[name]

    def _sources(self, key: str, dest_selection: Selection):
        """(reader, the piece's selection or None when whole) for each saved piece of ``key``
        that overlaps ``dest_selection``."""
        record = self.manifest.tensors[key]
        for piece in record.pieces:
            source = piece.selection(record.shape)
            if not _overlaps(source, dest_selection):
                continue
            reader = self.reader(piece.file)
            info = reader.tensors.get(key)
            if info is None or tuple(info.shape) != source.local_shape:
                got = None if info is None else tuple(info.shape)
                raise CheckpointCorruptError(f"load: {os.path.join(self.path, piece.file)!r} should hold {key!r} "
                                             f"with shape {source.local_shape}, found {got}")
            if info.dtype != mf.dtype_of(record.dtype):
                raise CheckpointCorruptError(f"load: {os.path.join(self.path, piece.file)!r} holds {key!r} as "
                                             f"{mf.dtype_name(info.dtype)}; the manifest records {record.dtype}")
            yield reader, None if source.is_full() else source

    def verify(self, key: str, dest_selection: Selection) -> None:
        """Checks every block that filling ``dest_selection`` of ``key`` will read."""
        for reader, source in self._sources(key, dest_selection):
            reader.verify(key, dest_selection, source)

    def fill(self, key: str, dest: torch.Tensor, dest_selection: Selection) -> None:
        """Copies the part of stored tensor ``key`` that ``dest_selection`` covers into ``dest``."""
        out = dest if dest.is_contiguous() else torch.empty_like(dest, memory_format=torch.contiguous_format)
        # A read that goes through a staging buffer (another dtype, a GPU) writes all of `out`:
        # every read after the first keeps what the ones before it filled in.
        for i, (reader, source) in enumerate(self._sources(key, dest_selection)):
            reader.read_into(key, out, dest_selection, source, keep_rest=i > 0)
        if out is not dest:
            dest.copy_(out)

    def read_whole(self, key: str) -> torch.Tensor:
        """Stored tensor ``key`` whole, on the CPU, its blocks verified."""
        record = self.manifest.tensors[key]
        selection = full_selection(record.shape)
        self.verify(key, selection)
        tensor = torch.empty(record.shape, dtype=mf.dtype_of(record.dtype))
        self.fill(key, tensor, selection)
        return tensor
