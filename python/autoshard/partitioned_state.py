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

Pieces of unequal sizes go over the wire padded to the largest one (rank 0's), and the
padding is dropped inside.
"""

import weakref
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .nn.spec import sharded_parameters
from .split import split_sizes

DEFAULT_BUCKET_BYTES = 25 * 2**20


def _collective(name: str, older_name: str):
    """torch.distributed's function `name`, or what releases before it called it `older_name`
    (looked up at every call, so that wrappers installed on the module are seen)."""
    return getattr(dist, name, None) or getattr(dist, older_name)


class Piece:
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


_PIECES: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def piece_of(param: torch.Tensor) -> Optional[Piece]:
    """The piece this rank owns of a parameter whose state is partitioned; None for others."""
    return _PIECES.get(param)


def unregister_piece(param: torch.Tensor) -> Optional[Piece]:
    """Takes `param` out of the registry (returning its piece): torch will not swap the storage
    of a tensor held weakly, as loading a model built on meta does."""
    return _PIECES.pop(param, None)


def register_piece(param: torch.Tensor, piece: Piece) -> None:
    _PIECES[param] = piece


def partition_replicated(parameters: Iterable[torch.nn.Parameter], group) -> Set[int]:
    """Partitions the state of every trainable parameter that tensor parallelism replicates
    (absent from all shard_specs, or split over a single rank) across `group`; returns their ids.
    Non-contiguous parameters have no flat view to split and stay replicated."""
    shards = sharded_parameters()
    chosen = set()
    for p in parameters:
        if not p.requires_grad or id(p) in chosen or not p.is_contiguous():
            continue
        spec = shards.get(id(p), (None,))[0]
        if spec is not None and spec.world_size > 1:
            continue
        _PIECES[p] = Piece(p.numel(), group)
        chosen.add(id(p))
    return chosen


def _segments(pieces: List[Piece]) -> Tuple[int, List[int]]:
    """The padded length of one rank's segment, and each rank's unpadded length."""
    world = pieces[0].world_size
    lengths = [sum(piece.sizes[r] for piece in pieces) for r in range(world)]
    return max(lengths), lengths


def _pack(parts: List[torch.Tensor], length: int, padded: int, like: torch.Tensor) -> List[torch.Tensor]:
    if padded > length:
        parts.append(like.new_zeros(padded - length))
    return parts


class ReduceScatterBucket:
    """Gradients of partitioned parameters, reduce-scattered together during backward.

    The input holds, for each rank in turn, that rank's piece of every gradient (padded to
    one length), so that the output is exactly this rank's pieces, back to back."""

    def __init__(self, params: List[torch.nn.Parameter], group, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params = params
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self.pieces = [piece_of(p) for p in params]
        self.group = group
        self.padded, self.lengths = _segments(self.pieces)
        # The gradients into which finish() wrote an average: a later backward that adds to
        # one of them before the optimizer clears it accumulates gradients.
        self._averaged: List[Optional[weakref.ref]] = [None] * len(params)
        self._out: Optional[torch.Tensor] = None
        self._work = None

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
        parts = []
        for r in range(world):
            segment = [piece.of(grad, r) for grad, piece in zip(grads, self.pieces)]
            parts += _pack(segment, self.lengths[r], self.padded, grads[0])
        flat = torch.cat(parts)
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self._out = flat.new_empty(self.padded)
        reduce_scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
        self._work = reduce_scatter(self._out, flat, group=self.group, async_op=True)

    def finish(self) -> None:
        self._work.wait()
        out, self._work = self._out, None
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
        families.setdefault((id(_PIECES[p].group), p.device, p.dtype), []).append(p)
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
    in_flight = []
    for bucket in buckets:
        pieces = [_PIECES[p] for p in bucket]
        padded, lengths = _segments(pieces)
        rank, world = pieces[0].rank, pieces[0].world_size
        flats = [p.detach().view(-1) for p in bucket]
        mine = torch.cat(_pack([piece.of(f) for f, piece in zip(flats, pieces)], lengths[rank], padded, flats[0]))
        out = mine.new_empty(world * padded)
        all_gather = _collective("all_gather_single", "all_gather_into_tensor")
        work = all_gather(out, mine, group=pieces[0].group, async_op=True)
        in_flight.append((flats, pieces, padded, out, work))
    for flats, pieces, padded, out, work in in_flight:
        work.wait()
        targets, sources = [], []
        for r in range(pieces[0].world_size):
            if r == pieces[0].rank:
                continue
            offset = r * padded
            for flat, piece in zip(flats, pieces):
                targets.append(piece.of(flat, r))
                sources.append(out.narrow(0, offset, piece.sizes[r]))
                offset += piece.sizes[r]
        torch._foreach_copy_(targets, sources)
