"""Which part of a full tensor a local tensor holds.

A selection lists, for each dimension of the full tensor, the ``(start, length)`` runs the
local tensor holds, in local order; the local tensor is the row-major, contiguous product of
those runs. A rank's shard, a tensor stored whole in a file and a shard saved on another
world size are all selections, so moving data between any two of them is one computation:
the overlap of two selections (``byte_runs``, done in C++).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..core import ops
from ..core.spec import ShardSpec

Run = Tuple[int, int]


@dataclass(frozen=True)
class Selection:
    shape: Tuple[int, ...]  # the full tensor's shape
    runs: Tuple[Tuple[Run, ...], ...]  # per dim, (start, length) runs in local order

    def __post_init__(self):
        if len(self.runs) != len(self.shape):
            raise ValueError(f"Selection: {len(self.runs)} lists of runs for a {len(self.shape)}-dim shape {self.shape}")
        for dim, (size, runs) in enumerate(zip(self.shape, self.runs)):
            for start, length in runs:
                if start < 0 or length < 0 or start + length > size:
                    raise ValueError(f"Selection: run ({start}, {length}) of dim {dim} lies outside [0, {size})")
            ordered = sorted(run for run in runs if run[1])
            for (start, length), (next_start, _) in zip(ordered, ordered[1:]):
                if start + length > next_start:  # a local tensor holds each element once
                    raise ValueError(f"Selection: runs of dim {dim} overlap: {runs}")

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(sum(length for _, length in runs) for runs in self.runs)

    def is_full(self) -> bool:
        return all(runs == ((0, size),) for size, runs in zip(self.shape, self.runs)) or 0 in self.shape

    def flat(self) -> List[int]:
        """The encoding the C++ ops take: per dim [count, start, length, ...]."""
        out: List[int] = []
        for runs in self.runs:
            out.append(len(runs))
            for start, length in runs:
                out += [start, length]
        return out

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "runs": [[list(run) for run in runs] for runs in self.runs]}

    @classmethod
    def from_json(cls, obj: dict) -> "Selection":
        return cls(tuple(obj["shape"]), tuple(tuple((int(s), int(n)) for s, n in runs) for runs in obj["runs"]))


def full_selection(shape: Sequence[int]) -> Selection:
    shape = tuple(int(n) for n in shape)
    return Selection(shape, tuple(((0, n),) for n in shape))


def selection_of(spec: Optional[ShardSpec], full_shape: Sequence[int]) -> Selection:
    """The selection a shard described by ``spec`` holds (the full tensor when ``spec`` is None)."""
    selection = full_selection(full_shape)
    if spec is None:
        return selection
    runs = list(selection.runs)
    runs[spec.dim] = tuple(spec.local_ranges())
    return Selection(selection.shape, tuple(runs))


def byte_runs(src: Selection, dst: Selection, itemsize: int) -> torch.Tensor:
    """int64 [n, 3]: (src byte, dst byte, nbytes) runs copying the overlap of ``src`` into ``dst``,
    offsets relative to each contiguous local tensor, sorted by source offset."""
    if src.shape != dst.shape:
        raise ValueError(f"byte_runs: the selections are of different full shapes {src.shape} and {dst.shape}")
    return ops.copy_runs(src.shape, itemsize, src.flat(), dst.flat())
