"""Optimizer state of replicated parameters, partitioned across data-parallel replicas.

A parameter that tensor parallelism leaves whole (a norm's weight, a row layer's bias) is
the same on every rank of a data-parallel group. Instead of every replica all-reducing its
gradient and stepping all of it, the replicas share the work: flattened, the parameter is
split by ``split_sizes(numel, dp_size)`` and dp rank ``r`` owns piece ``r``.

- Backward reduce-scatters the gradient (averaged over the group), so each rank receives only
  its own piece; ``param.grad`` then holds that piece of the average, and zeros elsewhere.
- autoshard's optimizers step only the owned piece, and keep state tensors for it alone
  (1-D, of the piece's length).
- After the step the pieces are all-gathered, so that every replica holds the whole
  parameter again.

Pieces of unequal sizes go over the wire padded to the largest one (rank 0's); the collective
ops pad and unpad them (autoshard.comm).
"""

from typing import Dict, List, Optional, Set

import torch

from ..core.collective_buckets import DEFAULT_BUCKET_BYTES, EVERY_RANK, OWN, CollectiveBucket, all_gather, fill_buckets
from ..core.parallel_state import ParallelState, parameter_state
from ..core.split import split_sizes


class Partition:
    """Which elements of a flattened parameter each rank of a data-parallel group owns."""

    __slots__ = ("group", "rank", "world_size", "sizes", "starts")

    def __init__(self, numel: int, group) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.sizes: List[int] = split_sizes(numel, self.world_size)
        self.starts = [sum(self.sizes[:r]) for r in range(self.world_size)]

    @property
    def numel(self) -> int:
        return self.sizes[self.rank]

    def of(self, tensor: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """Rank `rank`'s (default: this rank's) piece of `tensor`, a view into it."""
        r = self.rank if rank is None else rank
        return tensor.view(-1).narrow(0, self.starts[r], self.sizes[r])


def piece_of(param: torch.Tensor) -> Optional[Partition]:
    """The piece this rank owns of a parameter whose state is partitioned (kept by the state
    of the model it belongs to); None for others."""
    state = parameter_state(param)
    return None if state is None else state.partition_of(param)


def partition_replicated(state: ParallelState, group, exclude: Set[int] = frozenset()) -> Set[int]:
    """Partitions across `group` the state of every trainable parameter of `state`'s model that
    tensor parallelism replicates (absent from all shard_specs, or split over a single rank),
    except those whose ids are in `exclude`; records the partitions in `state` and returns their
    ids. Non-contiguous parameters have no flat view to split and stay replicated."""
    shards = state.shards()
    chosen = set()
    for p in state.model.parameters():
        if not p.requires_grad or id(p) in chosen or id(p) in exclude or not p.is_contiguous():
            continue
        spec = shards.get(id(p), (None,))[0]
        if spec is not None and spec.world_size > 1:
            continue
        state.partitions[id(p)] = Partition(p.numel(), group)
        chosen.add(id(p))
    return chosen


def all_gather_pieces(params: List[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """After a step of each rank's own pieces of partitioned `params`: puts every rank's
    pieces back together, in place, so that all replicas hold the whole parameters. Every rank
    of the data-parallel group calls it with the same parameters in the same order."""
    families: Dict[tuple, List[torch.Tensor]] = {}
    for p in params:
        families.setdefault((id(piece_of(p).group), p.device, p.dtype), []).append(p)
    for family in families.values():
        for _, members in fill_buckets(family, bucket_bytes):
            bucket = CollectiveBucket(members, [piece_of(p) for p in members])
            flats = [p.detach() for p in members]
            bucket.launch(all_gather(bucket.lengths, bucket.pieces[0].group), flats, OWN)
            # This rank's own pieces are already in place.
            own = slice(bucket.pieces[0].rank * len(members), (bucket.pieces[0].rank + 1) * len(members))
            targets, sources = bucket.segments(flats, EVERY_RANK), bucket.split(bucket.result(), EVERY_RANK)
            del targets[own], sources[own]
            torch._foreach_copy_(targets, sources)
