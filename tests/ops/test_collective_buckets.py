"""CollectiveBucket against ground truths that do not use it: packing then splitting gives
back the tensors bit for bit, in every layout; fill_buckets closes buckets by bytes; and on 2
and 3 gloo ranks an all-reduce, a reduce-scatter and an all-gather through one bucket (one
collective) equal torch.distributed run on each tensor separately.

Values are small integers, so that sums are exact whatever order a collective adds in: a
mismatch can only come from a tensor read or written at the wrong place."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core.collective_buckets import (
    EVERY_RANK,
    OWN,
    WHOLE,
    CollectiveBucket,
    all_gather,
    all_reduce,
    fill_buckets,
    reduce_scatter,
)
from autoshard.runtime.optimizer_partition import Partition
from autoshard.core.split import split_sizes
from multirank import run_on_ranks

SHAPES = [(3, 5), (7,), (2, 3, 2), (1,), (4, 1)]


class _Group:
    """A stand-in for a process group of `size` ranks, seen from `rank`: enough for Partition."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _tensors(seed, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-40, 41, shape, generator=g).to(dtype) for shape in shapes]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.shape, w.shape)
        assert torch.equal(_bits(g), _bits(w))


def _pieces_by_hand(tensors, world, ranks):
    """Each rank's split_sizes piece of every flattened tensor, by slicing, rank after rank."""
    out = []
    for r in ranks:
        for t in tensors:
            sizes = split_sizes(t.numel(), world)
            out.append(t.reshape(-1)[sum(sizes[:r]):sum(sizes[:r + 1])])
    return out


def test_whole_packing_splits_back_to_the_tensors_bit_for_bit():
    tensors = _tensors(0, torch.bfloat16)
    tensors[0] = tensors[0].t()  # not contiguous: packed as a copy, split back in its shape
    bucket = CollectiveBucket(tensors)
    flat = torch.cat(bucket.segments(tensors, WHOLE))
    assert flat.numel() == sum(t.numel() for t in tensors)
    _same_bits(bucket.split(flat, WHOLE), tensors)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layouts_by_rank_hold_each_ranks_pieces_in_order(world):
    tensors = _tensors(1)
    for rank in range(world):
        pieces = [Partition(t.numel(), _Group(rank, world)) for t in tensors]
        bucket = CollectiveBucket(tensors, pieces)
        every, own = bucket.segments(tensors, EVERY_RANK), bucket.segments(tensors, OWN)
        _same_bits(every, _pieces_by_hand(tensors, world, range(world)))
        _same_bits(own, _pieces_by_hand(tensors, world, [rank]))
        # The OWN layout is one rank's run of EVERY_RANK: what a reduce-scatter hands each rank.
        assert bucket.lengths == [sum(split_sizes(t.numel(), world)[r] for t in tensors) for r in range(world)]
        _same_bits(bucket.split(torch.cat(every), EVERY_RANK), every)
        _same_bits(bucket.split(torch.cat(own), OWN), own)
        # Segments are views: writing one writes the tensor.
        assert all(s._base is not None for s in own)


def test_fill_buckets_closes_a_bucket_at_its_capacity_in_bytes_per_kind():
    small = [torch.zeros(10) for _ in range(5)]  # 40 bytes each
    halves = [torch.zeros(10, dtype=torch.bfloat16) for _ in range(3)]  # 20 bytes each
    tensors = [small[0], halves[0], small[1], small[2], halves[1], small[3], halves[2], small[4]]
    grouped = fill_buckets(tensors, 80, lambda t: t.dtype)
    ids = [(kind, [id(t) for t in members]) for kind, members in grouped]
    assert ids == [
        (torch.float32, [id(small[0]), id(small[1])]),  # 80 bytes: closed first
        (torch.float32, [id(small[2]), id(small[3])]),
        (torch.bfloat16, [id(h) for h in halves]),  # 60 bytes: still open, in the order opened
        (torch.float32, [id(small[4])]),
    ]
    assert [len(m) for _, m in fill_buckets(small, 10**9)] == [5]
    assert [len(m) for _, m in fill_buckets(small, 1)] == [1] * 5


def _through_buckets():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = {}

    # All-reduce, in flight, of bf16 tensors summed in fp32 and averaged: against each tensor
    # all-reduced alone in fp32, averaged, rounded once.
    mine = _tensors(10 + rank, torch.bfloat16)
    bucket = CollectiveBucket(mine)
    with autoshard.CommCounter() as counter:
        bucket.launch(all_reduce(group, torch.float32), mine, WHOLE, in_flight=True)
        averages = bucket.split(bucket.result(divide_by=world, dtype=torch.bfloat16))
    want = []
    for t in mine:
        alone = t.float()
        dist.all_reduce(alone)
        want.append(alone.div_(world).to(torch.bfloat16))
    _same_bits(averages, want)
    out["all_reduce_calls"] = counter.counts

    # Reduce-scatter of uneven pieces: this rank's piece of each tensor's sum.
    mine = _tensors(20 + rank)
    pieces = [Partition(t.numel(), group) for t in mine]
    bucket = CollectiveBucket(mine, pieces)
    with autoshard.CommCounter() as counter:
        bucket.launch(reduce_scatter(bucket.lengths, group), mine, EVERY_RANK, in_flight=True)
        received = bucket.split(bucket.result(), OWN)
    sums = [t.clone() for t in mine]
    for t in sums:
        dist.all_reduce(t)
    _same_bits(received, _pieces_by_hand(sums, world, [rank]))
    out["reduce_scatter_calls"] = counter.counts

    # All-gather: every rank's own pieces back into whole tensors.
    whole = _tensors(30)  # the same on every rank: what the pieces come from
    targets = [torch.full_like(t, float("nan")) for t in whole]
    bucket = CollectiveBucket(targets, [Partition(t.numel(), group) for t in targets])
    for target, piece in zip(bucket.segments(targets, OWN), _pieces_by_hand(whole, world, [rank])):
        target.copy_(piece)
    with autoshard.CommCounter() as counter:
        bucket.launch(all_gather(bucket.lengths, group), targets, OWN)
        gathered = bucket.split(bucket.result(), EVERY_RANK)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, [p.clone() for p in _pieces_by_hand(whole, world, [rank])])
    _same_bits(gathered, [p for r in range(world) for p in every_rank[r]])
    torch._foreach_copy_(bucket.segments(targets, EVERY_RANK), gathered)
    _same_bits(targets, whole)
    out["all_gather_calls"] = counter.counts
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_collective_per_bucket_equals_torch_distributed_per_tensor(world_size):
    for r in run_on_ranks(_through_buckets, world_size, timeout=300):
        assert r == {"all_reduce_calls": {"all_reduce": 1}, "reduce_scatter_calls": {"reduce_scatter": 1},
                     "all_gather_calls": {"all_gather": 1}}, r
