"""Reading byte ranges of safetensors files, and writing them with block checksums.

A reader never loads a whole file: it reads the runs ``byte_runs`` computes for the part of a
tensor the caller wants (one run for a row slice, one per row for a column slice), small runs
through a block-sized window so that a strided slice costs a few large reads rather than one
system call per row. When the file's block checksums are known (autoshard's own
checkpoints), every block is read whole and verified before any of its bytes are used.
"""

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..core import ops
from .json_input import JSONRefusal, parse_header
from .selection import Selection, byte_runs, full_selection

BLOCK_SIZE = 4 << 20  # checksum granularity, and the window small runs are read through
_DIRECT_READ_BYTES = 1 << 20  # runs at least this long go straight into their destination
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit (its MAX_HEADER_SIZE)

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: Dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is damaged, truncated or not what its manifest says; names the file."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # byte offsets in the file (header included)
    end: int


@dataclass
class FileRecord:
    name: str
    size: int
    block_crc32: List[int] = field(default_factory=list)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bytes: expected a contiguous CPU tensor, got one on {tensor.device}")
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class SafetensorsReader:
    def __init__(self, path: str, block_crc32: Optional[List[int]] = None):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise FileNotFoundError(f"cannot open safetensors file {self.path}: {error.strerror}") from error
        try:
            self.size = os.fstat(self._fd).st_size
            self._block_crc32 = block_crc32
            if block_crc32 is not None and len(block_crc32) != max(1, -(-self.size // BLOCK_SIZE)):
                raise CheckpointCorruptError(
                    f"{self.path}: {self.size} bytes do not match the {len(block_crc32)} checksummed blocks recorded for it")
            self._verified: set = set()
            self._window: Optional[Tuple[int, torch.Tensor]] = None
            self.bytes_read = 0
            self.tensors, self.metadata = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _corrupt(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: {what}")

    def _parse_header(self):
        if self.size < 8:
            raise self._corrupt("too short to be a safetensors file")
        (length,) = struct.unpack("<Q", self._read_bytes(0, 8))
        if length > MAX_HEADER_BYTES:
            raise self._corrupt(f"header length {length} is more than {MAX_HEADER_BYTES} bytes, the most a "
                                "safetensors header may hold")
        if length > self.size - 8:
            raise self._corrupt(f"header length {length} does not fit in the file's {self.size} bytes")
        try:
            text = bytes(self._read_bytes(8, length)).decode("utf-8")
        except UnicodeDecodeError as error:
            raise self._corrupt(f"unreadable header ({error})") from None
        try:
            entries, metadata = parse_header(text)
        except JSONRefusal as refusal:
            raise self._corrupt(f"safetensors header: {refusal.field} {refusal.problem}") from None
        data_start = 8 + length
        tensors = {}
        for name, entry in entries.items():
            dtype = DTYPES.get(entry["dtype"])
            if dtype is None:
                raise self._corrupt(f"safetensors header: tensor {name!r}['dtype'] is {entry['dtype']!r}, "
                                    f"not one of {sorted(DTYPES)}")
            shape = tuple(entry["shape"])
            begin, end = (data_start + x for x in entry["data_offsets"])
            if not data_start <= begin <= end <= self.size or end - begin != math.prod(shape) * dtype.itemsize:
                raise self._corrupt(f"tensor {name!r} ({entry['dtype']} {list(shape)}) does not fit its byte range")
            tensors[name] = TensorInfo(dtype, shape, begin, end)
        ranges = sorted((info.begin, info.end, name) for name, info in tensors.items() if info.end > info.begin)
        for (_, end, name), (begin, _, following) in zip(ranges, ranges[1:]):
            if begin < end:
                raise self._corrupt(f"safetensors header: tensor {following!r}['data_offsets'] overlaps the bytes "
                                    f"of tensor {name!r} (file bytes [{begin}, {end}) are claimed by both)")
        return tensors, metadata

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} holds no tensor named {name!r}") from None

    def read(self, name: str, device="cpu") -> torch.Tensor:
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype, device=device)
        selection = full_selection(info.shape)
        self.read_into(name, out, selection, selection)
        return out

    def _runs(self, name: str, dest_selection: Selection, src_selection: Optional[Selection]):
        info = self.info(name)
        if src_selection is None:
            src_selection = full_selection(info.shape)
        # A stored tensor may be a block of the full tensor with fewer dims (one expert of a
        # stack of experts): the same bytes when only dims of size 1 differ.
        if src_selection.local_shape != info.shape and _squeezed(src_selection.local_shape) != _squeezed(info.shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {list(info.shape)}, "
                             f"but the selection it is said to hold has shape {list(src_selection.local_shape)}")
        if src_selection.shape != dest_selection.shape:
            raise ValueError(f"{self.path}: tensor {name!r} is part of a full tensor of shape "
                             f"{list(src_selection.shape)}, the destination of one of shape {list(dest_selection.shape)}")
        return info, byte_runs(src_selection, dest_selection, info.dtype.itemsize)

    def verify(self, name: str, dest_selection: Selection, src_selection: Optional[Selection] = None) -> None:
        """Checks the blocks that ``read_into`` with these arguments would read, writing
        nothing, so that a caller can refuse a damaged file before it changes anything."""
        info, runs = self._runs(name, dest_selection, src_selection)
        if self._block_crc32 is None or runs.numel() == 0:
            return
        starts = runs[:, 0] + info.begin
        firsts = (starts // BLOCK_SIZE).tolist()
        lasts = ((starts + runs[:, 2] - 1) // BLOCK_SIZE).tolist()
        blocks = set()
        for first, last in zip(firsts, lasts):
            blocks.update(range(first, last + 1))
        for block in sorted(blocks - self._verified):
            self._block(block)

    def read_into(self, name: str, dest: torch.Tensor, dest_selection: Selection,
                  src_selection: Optional[Selection] = None, keep_rest: bool = False) -> None:
        """Copies the overlap of tensor ``name`` (holding ``src_selection`` of the full tensor;
        None: the whole of it) and ``dest_selection`` into ``dest``, cast to its dtype. With
        ``keep_rest`` the rest of ``dest`` keeps its values (it is filled by several reads)."""
        if tuple(dest.shape) != dest_selection.local_shape:
            raise ValueError(f"read_into: dest has shape {list(dest.shape)}, "
                             f"its selection needs {list(dest_selection.local_shape)}")
        info, runs = self._runs(name, dest_selection, src_selection)
        if runs.numel() == 0:
            return
        direct = dest.device.type == "cpu" and dest.dtype == info.dtype and dest.is_contiguous()
        staging = dest.detach() if direct else torch.empty(
            dest.shape, dtype=info.dtype, pin_memory=dest.device.type == "cuda" and torch.cuda.is_available())
        if keep_rest and not direct:
            # Values read before came from the file, so this round trip through its dtype is exact.
            staging.copy_(dest.detach())
        self._copy_runs(runs, info.begin, staging)
        if not direct:
            with torch.no_grad():
                dest.copy_(staging, non_blocking=dest.device.type == "cuda")
            if dest.device.type == "cuda":
                torch.cuda.current_stream(dest.device).synchronize()  # the staging buffer is freed next

    def _copy_runs(self, runs: torch.Tensor, base: int, staging: torch.Tensor) -> None:
        """Fills ``staging`` from the file: runs (src, dst, nbytes) with src relative to ``base``."""
        runs = runs.clone()
        runs[:, 0] += base
        out = staging.detach().reshape(-1).view(torch.uint8) if staging.numel() else staging.new_empty(0, dtype=torch.uint8)
        if self._block_crc32 is None:  # long runs go straight into place; unverified bytes need no window
            direct = runs[:, 2] >= _DIRECT_READ_BYTES
            view = tensor_bytes(out)
            for src, dst, nbytes in runs[direct].tolist():
                self._read_into(src, view[dst:dst + nbytes])
            runs = runs[~direct].contiguous()
        if runs.numel() == 0:
            return
        # The runs are disjoint and sorted in the file, so those touching a block are a slice.
        starts, ends = runs[:, 0].contiguous(), runs[:, 0] + runs[:, 2]
        for block in range(int(starts[0]) // BLOCK_SIZE, (int(ends[-1]) - 1) // BLOCK_SIZE + 1):
            block_start = block * BLOCK_SIZE
            first = int(torch.searchsorted(ends, block_start, right=True))
            last = int(torch.searchsorted(starts, block_start + BLOCK_SIZE))
            if first < last:
                ops.copy_byte_runs_(out, self._block(block), runs[first:last], block_start)

    def _block(self, index: int) -> torch.Tensor:
        """Block ``index`` of the file (verified when checksums are known), as a uint8 tensor."""
        if self._window is not None and self._window[0] == index:
            return self._window[1]
        start = index * BLOCK_SIZE
        data = self._read_bytes(start, min(BLOCK_SIZE, self.size - start))
        if self._block_crc32 is not None and index not in self._verified:
            if zlib.crc32(data) != self._block_crc32[index]:
                raise self._corrupt(f"checksum mismatch in bytes [{start}, {start + len(data)}): the file is damaged")
            self._verified.add(index)
        window = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        self._window = (index, window)
        return window

    def _read_bytes(self, offset: int, length: int) -> memoryview:
        buffer = memoryview(bytearray(length))
        self._read_into(offset, buffer)
        return buffer

    def _read_into(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n <= 0:
                raise self._corrupt(f"ends at byte {offset + done}, before the {len(out)} bytes at {offset} it should hold")
            done += n
        self.bytes_read += len(out)


def safetensors_header(tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]],
                       metadata: Optional[Dict[str, str]] = None) -> Tuple[bytes, Dict[str, Tuple[int, int]]]:
    """The header bytes (length prefix included, padded to 8 bytes) for tensors written in
    the given order, and each tensor's data offsets."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets = {}
    position = 0
    for name, (dtype, shape) in tensors.items():
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"safetensors cannot store tensor {name!r} of dtype {dtype}")
        offsets[name] = (position, position + math.prod(shape) * dtype.itemsize)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": list(offsets[name])}
        position = offsets[name][1]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, offsets


class SafetensorsWriter:
    """Streams a safetensors file whose header is known up front; checksums blocks as it goes."""

    _CHUNK = 64 << 20

    def __init__(self, path: str, tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None):
        self.path = os.fspath(path)
        self._header, self._offsets = safetensors_header(tensors, metadata)
        self._order = list(tensors)
        self._next = 0
        self._crcs: List[int] = []  # crc32 of every whole BLOCK_SIZE block written so far
        self._crc = 0  # of the block being written
        self._file = open(self.path, "wb")
        self._size = 0
        self._write(memoryview(self._header))

    def _write(self, data: memoryview) -> None:
        for start in range(0, len(data), self._CHUNK):
            piece = data[start:start + self._CHUNK]
            self._file.write(piece)
            while len(piece):
                take = min(len(piece), BLOCK_SIZE - self._size % BLOCK_SIZE)
                self._crc = zlib.crc32(piece[:take], self._crc)
                self._size += take
                piece = piece[take:]
                if self._size % BLOCK_SIZE == 0:
                    self._crcs.append(self._crc)
                    self._crc = 0

    def write(self, name: str, data: memoryview) -> None:
        """Appends (part of) the bytes of tensor ``name``; tensors come in header order."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"{self.path}: tensor {name!r} written out of order (expected {expected!r})")
        self._write(data)
        if self._size - len(self._header) == self._offsets[name][1]:
            self._next += 1
        elif self._size - len(self._header) > self._offsets[name][1]:
            raise ValueError(f"{self.path}: more bytes written for tensor {name!r} than its shape holds")

    def close(self) -> FileRecord:
        """Flushes and fsyncs the file; the record to keep in a manifest."""
        if self._next != len(self._order):
            self._file.close()
            raise ValueError(f"{self.path}: closed before tensor {self._order[self._next]!r} was written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._size % BLOCK_SIZE or not self._crcs:
            self._crcs.append(self._crc)
        return FileRecord(os.path.basename(self.path), self._size, self._crcs)

    def abort(self) -> None:
        self._file.close()


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> FileRecord:
    """Writes contiguous CPU tensors as a standard safetensors file, fsynced; its record."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"write_safetensors: tensor {name!r} is on {tensor.device}; snapshot it to CPU first")
    writer = SafetensorsWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata)
    try:
        for name, tensor in tensors.items():
            writer.write(name, tensor_bytes(tensor.contiguous()))
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _squeezed(shape) -> tuple:
    return tuple(n for n in shape if n != 1)
