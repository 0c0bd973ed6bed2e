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

import weakref
from typing import Dict, List, Optional, Set

import torch

from .comm import all_gather_uneven, reduce_scatter_uneven, wait
from .parallel_state import ParallelState, parameter_state
from .split import split_sizes

DEFAULT_BUCKET_BYTES = 25 * 2**20


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


def _segment_lengths(pieces: List[Partition]) -> List[int]:
    """Each rank's segment length: its piece of every parameter, back to back."""
    return [sum(piece.sizes[r] for piece in pieces) for r in range(pieces[0].world_size)]


class ReduceScatterBucket:
    """Gradients of partitioned parameters, reduce-scattered together during backward.

    The input holds, for each rank in turn, that rank's piece of every gradient, so that the
    output is exactly this rank's pieces, back to back."""

    def __init__(self, params: List[torch.nn.Parameter], group, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params = params
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self.pieces = [piece_of(p) for p in params]
        self.group = group
        self.lengths = _segment_lengths(self.pieces)
        # The gradients into which finish() wrote an average: a later backward that adds to
        # one of them before the optimizer clears it accumulates gradients.
        self._averaged: List[Optional[weakref.ref]] = [None] * len(params)
        self._out: Optional[torch.Tensor] = None

    def before_accumulation(self, index: int) -> None:
        """Called as backward is about to add a new gradient into params[index].grad, and
        at launch for a gradient that received none in this pass.

        When that gradient holds an average of earlier passes, only this rank has it, in its
        own piece (zeros elsewhere): scaled by the world size, the reduce-scatter's sum counts
        it once per rank, and its average is that average plus the new gradients' average."""
        held, self._averaged[index] = self._averaged[index], None
        grad = self.params[index].grad
        if grad is not None and held is not None and held() is grad:
            piece = self.pieces[index]
            piece.of(grad).mul_(piece.world_size)

    def launch(self) -> None:
        for i in range(len(self.params)):
            self.before_accumulation(i)
        world = self.pieces[0].world_size
        grads = [p.grad for p in self.params]
        flat = torch.cat([piece.of(grad, r) for r in range(world) for grad, piece in zip(grads, self.pieces)])
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self._out = reduce_scatter_uneven(flat, self.lengths, self.group, async_op=True)

    def finish(self) -> None:
        out, self._out = wait(self._out), None
        out.div_(self.pieces[0].world_size)
        out = out.to(self.params[0].grad.dtype)  # the average, rounded once
        owned, received, elsewhere = [], [], []
        offset = 0
        for p, piece in zip(self.params, self.pieces):
            flat = p.grad.view(-1)
            start, n = piece.starts[piece.rank], piece.numel
            owned.append(flat.narrow(0, start, n))
            received.append(out.narrow(0, offset, n))
            elsewhere += [flat.narrow(0, 0, start), flat.narrow(0, start + n, flat.numel() - start - n)]
            offset += n
        torch._foreach_copy_(owned, received)
        torch._foreach_zero_(elsewhere)
        self._averaged = [weakref.ref(p.grad) for p in self.params]
        self._out = None


def all_gather_pieces(params: List[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """After a step of each rank's own pieces of partitioned `params`: puts every rank's
    pieces back together, in place, so that all replicas hold the whole parameters. Every rank
    of the data-parallel group calls it with the same parameters in the same order."""
    families: Dict[tuple, List[torch.Tensor]] = {}
    for p in params:
        families.setdefault((id(piece_of(p).group), p.device, p.dtype), []).append(p)
    buckets: List[List[torch.Tensor]] = []
    for family in families.values():
        bucket, filled = [], 0
        for p in family:
            bucket.append(p)
            filled += p.numel() * p.element_size()
            if filled >= bucket_bytes:
                buckets.append(bucket)
                bucket, filled = [], 0
        if bucket:
            buckets.append(bucket)
    for bucket in buckets:
        pieces = [piece_of(p) for p in bucket]
        rank, world = pieces[0].rank, pieces[0].world_size
        flats = [p.detach().view(-1) for p in bucket]
        lengths = _segment_lengths(pieces)
        mine = torch.cat([piece.of(f) for f, piece in zip(flats, pieces)])
        out = all_gather_uneven(mine, 0, lengths, pieces[0].group)
        targets, sources = [], []
        offset = 0
        for r in range(world):
            for flat, piece in zip(flats, pieces):
                if r != rank:
                    targets.append(piece.of(flat, r))
                    sources.append(out.narrow(0, offset, piece.sizes[r]))
                offset += piece.sizes[r]
        torch._foreach_copy_(targets, sources)
