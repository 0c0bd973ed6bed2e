"""Where a sharded parameter's local tensor sits inside the full (unsharded) tensor.

Sharded modules record one ``ShardSpec`` per sharded parameter in ``module.shard_specs``
(name -> spec; a parameter absent from it is replicated). Loading, saving, gathering the
full state dict and gradient clipping all read these records, so a module's layout is
described in exactly one place.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ops
from .split import shard


@dataclass(frozen=True)
class ShardSpec:
    dim: int  # the split dimension (non-negative)
    full_size: int  # that dimension's length in the full tensor
    rank: int
    world_size: int
    # Each part is split in `units` whole units (attention heads, so that no head is cut in
    # two); None splits element by element.
    units: Optional[int] = None
    # A fused layout (QKV in one Linear): the dimension is these consecutive parts, each split
    # on its own, and the local tensor is the concatenation of this rank's piece of each.
    parts: Optional[Tuple[int, ...]] = None
    # KV heads shared by query heads (grouped-query attention on more ranks than KV heads):
    # the dimension's `units` each serve `repeat` consecutive finer units (query heads); those
    # `units * repeat` are split over the ranks with split_sizes, and a rank holds the run of
    # units its finer units use. Neighbouring ranks' runs may overlap.
    repeat: Optional[int] = None
    # Parts held whole by every rank (indices into parts): a fused layer's one KV head beside
    # its query heads. The other parts are split as above.
    whole_parts: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        parts = self.part_sizes()
        if sum(parts) != self.full_size:
            raise ValueError(f"ShardSpec: parts {parts} must add up to full_size {self.full_size}")
        if self.units is not None:
            if self.units <= 0:
                raise ValueError(f"ShardSpec: units must be positive, got {self.units}")
            for index, size in enumerate(parts):
                if size % self.units and index not in (self.whole_parts or ()):
                    raise ValueError(f"ShardSpec: part of size {size} does not split into {self.units} whole units")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardSpec: rank must be in [0, {self.world_size}), got {self.rank}")
        if self.repeat is not None:
            if self.units is None or self.parts is not None or self.repeat <= 0:
                raise ValueError(f"ShardSpec: repeat must be a positive int given with units and without parts, "
                                 f"got repeat={self.repeat}, units={self.units}, parts={self.parts}")
            if self.units * self.repeat < self.world_size:
                raise ValueError(f"ShardSpec: units * repeat = {self.units * self.repeat} finer units cannot give "
                                 f"each of {self.world_size} ranks one")
        if self.whole_parts is not None:
            if (self.parts is None or self.repeat is not None or not self.whole_parts
                    or len(set(self.whole_parts)) != len(self.whole_parts)
                    or not all(0 <= i < len(self.parts) for i in self.whole_parts)
                    or len(self.whole_parts) == len(self.parts)):
                raise ValueError(f"ShardSpec: whole_parts must name some but not all of the parts {self.parts} by "
                                 f"index, once each, without repeat; got {self.whole_parts}")

    @property
    def overlaps(self) -> bool:
        """Whether a unit may be held by several ranks (each holder keeps the same values)."""
        return self.repeat is not None or self.whole_parts is not None

    def part_sizes(self) -> Tuple[int, ...]:
        return tuple(self.parts) if self.parts is not None else (self.full_size,)

    def local_ranges(self) -> List[Tuple[int, int]]:
        """(start, length) runs of the full dimension that this rank holds, in local order."""
        return self._ranges_of(self.rank)

    def _ranges_of(self, rank: int) -> List[Tuple[int, int]]:
        if self.whole_parts is None:
            return ops.shard_ranges(self.full_size, self.world_size, rank, self.units, self.parts, self.repeat)
        ranges, start = [], 0
        for index, size in enumerate(self.parts):
            if index in self.whole_parts:
                ranges.append((start, size))
            else:
                ranges += [(start + s, n) for s, n in ops.shard_ranges(size, self.world_size, rank, self.units)]
            start += size
        return ranges

    def owned_ranges(self) -> List[Tuple[int, int]]:
        """The part of local_ranges() this rank stands for where several ranks hold the same
        units (the lowest-ranked holder of each), as (start, length) in full coordinates:
        over all ranks these runs cover the dimension exactly once."""
        if self.whole_parts is not None:  # the first rank stands for the whole parts
            whole = self._whole_ranges()
            return [r for r in self.local_ranges() if self.rank == 0 or r not in whole]
        if self.repeat is None:
            return self.local_ranges()
        ((start, length),) = self.local_ranges()
        end = start + length
        if self.rank > 0:
            ((previous_start, previous_length),) = self._ranges_of(self.rank - 1)
            start = max(start, previous_start + previous_length)
        return [(start, end - start)] if end > start else []

    def _whole_ranges(self) -> List[Tuple[int, int]]:
        starts = [sum(self.parts[:i]) for i in range(len(self.parts))]
        return [(starts[i], self.parts[i]) for i in self.whole_parts]

    def owned_part(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """The part of `local` (this rank's tensor) that owned_ranges() describes, or None: a
        view, except with whole parts off the first rank (this rank's split pieces, joined)."""
        owned = self.owned_ranges()
        if self.whole_parts is not None:
            if self.rank == 0:
                return local
            pieces, offset = [], 0
            for start, length in self.local_ranges():
                if (start, length) in owned:
                    pieces.append(local.narrow(self.dim, offset, length))
                offset += length
            return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]
        if self.repeat is None:
            return local
        if not owned:
            return None
        ((start, length),) = owned
        return local.narrow(self.dim, start - self.local_ranges()[0][0], length)

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        return (*local_shape[:self.dim], self.full_size, *local_shape[self.dim + 1:])

    def local_size(self) -> int:
        return sum(length for _, length in self.local_ranges())

    def local_shape(self, full_shape: Sequence[int]) -> Tuple[int, ...]:
        return (*full_shape[:self.dim], self.local_size(), *full_shape[self.dim + 1:])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor, cut from the full one (contiguous)."""
        if self.parts is None and self.units is None:
            return shard(full, self.rank, self.world_size, self.dim)
        pieces = [full.narrow(self.dim, start, length) for start, length in self.local_ranges()]
        return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def take_owned(self, full: torch.Tensor) -> torch.Tensor:
        """take(), detached and holding its own storage: a sharded parameter must not keep the
        full source tensor alive, nor change with it."""
        local = self.take(full.detach())
        return local.clone() if local._is_view() else local


def module_shards(modules: Iterable[torch.nn.Module]) -> Dict[int, Tuple[ShardSpec, object]]:
    """id(parameter) -> (its ShardSpec, the module's process group or None), for the sharded
    parameters of `modules`, read from their shard_specs as they are now."""
    found = {}
    for module in modules:
        for name, spec in getattr(module, "shard_specs", {}).items():
            param = getattr(module, name, None)
            if isinstance(param, torch.Tensor):
                found[id(param)] = (spec, getattr(module, "group", None))
    return found

