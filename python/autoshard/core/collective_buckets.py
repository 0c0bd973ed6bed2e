"""Several tensors sent through one collective as one flat buffer, and read back out of it.

One collective per bucket instead of one per tensor: fewer, larger messages, and during
backward a bucket's collective can start as soon as its last gradient is in. Every bucket of
autoshard's runtime is a CollectiveBucket:

- data_parallel: gradients averaged over the data-parallel replicas, all-reduced, or
  reduce-scattered for parameters whose optimizer state is partitioned;
- partial_gradients: replicated parameters' partial gradients summed over the tensor-parallel
  group (and averaged over "dp");
- optimizer_partition: after a step, the owned pieces of partitioned parameters all-gathered.

A bucket packs its tensors in a layout, hands the pieces to the collective it is given, waits
for it and divides, and splits the result back into views laid out the same way. What is then
written where stays with each user: that is where they really differ (an average replaces a
gradient; a partial sum is added to the gradient from before the pass).

Layouts, for a bucket of parameters partitioned across a group (see optimizer_partition):
``WHOLE`` every tensor, whole, back to back; ``EVERY_RANK`` for each rank in turn, that
rank's piece of every tensor (what a reduce-scatter takes and an all-gather returns); ``OWN``
this rank's piece of every tensor (what a reduce-scatter returns and an all-gather takes).

Capacity is stated in bytes of the tensors in their own dtype (a ``reduce_dtype`` changes
what goes over the wire, not how tensors are grouped). The planner sizes partial-gradient
buckets in elements (csrc/plan/emit.cpp); the plan converts them to bytes when it is read
(``PartialGradientBucket.bytes``) and the runtime takes the planner's buckets as they are.
"""

from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch

from .comm import all_gather_uneven, all_reduce_bucket, reduce_scatter_uneven, wait

DEFAULT_BUCKET_BYTES = 25 * 2**20

WHOLE, EVERY_RANK, OWN = "whole", "every rank", "own"

# The pieces of a bucket, in its layout -> the collective's result (maybe still in flight).
Collective = Callable[[List[torch.Tensor]], torch.Tensor]


def fill_buckets(tensors: Sequence[torch.Tensor], capacity_bytes: int,
                 kind: Callable[[torch.Tensor], Hashable] = lambda t: None) -> List[Tuple[Hashable, List[torch.Tensor]]]:
    """`tensors`, in order, into buckets of one `kind` each (a collective takes one dtype on
    one device); a bucket closes once it holds `capacity_bytes` or more. Closed buckets come
    first, in the order they closed, then the ones left open: that is the order in which
    backward fills them, so every rank launches them in the same order."""
    open_buckets, filled, grouped = {}, {}, []
    for t in tensors:
        key = kind(t)
        open_buckets.setdefault(key, []).append(t)
        filled[key] = filled.get(key, 0) + t.numel() * t.element_size()
        if filled[key] >= capacity_bytes:
            grouped.append((key, open_buckets.pop(key)))
            filled[key] = 0
    return grouped + list(open_buckets.items())


def _cast(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)


def all_reduce(group, reduce_dtype: Optional[torch.dtype] = None) -> Collective:
    """The sum over `group`, started without waiting. The C++ op packs the pieces itself (one
    copy, not two), so each is cast to `reduce_dtype` first."""
    return lambda pieces: all_reduce_bucket([_cast(x, reduce_dtype) for x in pieces], group, async_op=True)


def reduce_scatter(lengths: List[int], group, reduce_dtype: Optional[torch.dtype] = None) -> Collective:
    """This rank's `lengths[rank]` elements of the sum over `group`, started without waiting;
    packed, then cast once."""
    return lambda pieces: reduce_scatter_uneven(_cast(torch.cat(pieces), reduce_dtype), lengths, group,
                                                async_op=True)


def all_gather(lengths: List[int], group) -> Collective:
    """Every rank's pieces, rank r's `lengths[r]` elements, back to back in rank order."""
    return lambda pieces: all_gather_uneven(torch.cat(pieces), 0, lengths, group)


class CollectiveBucket:
    """`params` whose tensors (gradients, or the parameters themselves) go through one
    collective together. `pieces` (a Partition per parameter, all over one group) gives the
    layouts by rank; without it a bucket has only WHOLE."""

    __slots__ = ("params", "pieces", "_result", "_in_flight")

    def __init__(self, params: List[torch.Tensor], pieces: Optional[List] = None) -> None:
        self.params = params
        self.pieces = pieces
        self._result: Optional[torch.Tensor] = None
        self._in_flight = False

    @property
    def world_size(self) -> int:
        return self.pieces[0].world_size

    @property
    def lengths(self) -> List[int]:
        """Each rank's elements in the OWN layout: its piece of every tensor, back to back."""
        return [sum(piece.sizes[r] for piece in self.pieces) for r in range(self.world_size)]

    def _spans(self, layout: str) -> List[Tuple[int, int, int]]:
        """(tensor index, start, length) within each flattened tensor, in the layout's order."""
        if layout == WHOLE:
            return [(i, 0, p.numel()) for i, p in enumerate(self.params)]
        ranks = range(self.world_size) if layout == EVERY_RANK else [self.pieces[0].rank]
        return [(i, piece.starts[r], piece.sizes[r]) for r in ranks for i, piece in enumerate(self.pieces)]

    def segments(self, tensors: Sequence[torch.Tensor], layout: str = WHOLE) -> List[torch.Tensor]:
        """Views of `tensors` (one per parameter, each of its shape), flattened, in `layout`."""
        if layout == WHOLE:
            return [t.reshape(-1) for t in tensors]
        return [tensors[i].view(-1).narrow(0, start, n) for i, start, n in self._spans(layout)]

    def launch(self, collective: Collective, tensors: Sequence[torch.Tensor], layout: str = WHOLE,
               in_flight: bool = False) -> None:
        """Starts `collective` on `tensors` packed in `layout`; `in_flight`: it returns before
        its result is ready, and result() waits for it."""
        self._result = collective(self.segments(tensors, layout))
        self._in_flight = in_flight

    def result(self, divide_by: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The collective's flat result, divided in place by `divide_by` (an average: divided
        in the dtype it was reduced in), then cast to `dtype` (rounded once)."""
        flat, self._result = self._result, None
        if self._in_flight:
            flat = wait(flat)
        if divide_by is not None:
            flat.div_(divide_by)
        return _cast(flat, dtype)

    def split(self, flat: torch.Tensor, layout: str = WHOLE) -> List[torch.Tensor]:
        """Views of `flat` laid out as `layout`, in the order of segments(); WHOLE ones shaped
        like their parameters."""
        views, offset = [], 0
        for i, _, n in self._spans(layout):
            view = flat.narrow(0, offset, n)
            views.append(view.view_as(self.params[i]) if layout == WHOLE else view)
            offset += n
        return views
