"""The reduce-scatters and all-gathers that go round a ring of point-to-point transfers on gloo
(csrc/comm/ring.h), against plain local sums and concatenations on 2, 3 and 4 ranks, and
against gloo's own collectives (AUTOSHARD_GLOO_RINGS=0).

The sizes are chosen so that every way a piece goes over the wire is taken: a contiguous piece
in segments, runs of 1 MiB and more cut into segments sent from and received into the tensor
where they lie (over one leading axis and over two merged ones), shorter runs a few at a time
through a contiguous copy (with a last message of fewer runs), a non-contiguous input, and empty
pieces."""

import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core import comm
from multirank import run_on_ranks
from seeded import seeded

# (shape, dim, dtypes). A run of 1 MiB or more goes in segments of about 1 MiB where it lies;
# shorter runs go about 1 MiB of them at a time, copied.
FLOATS_AND_INTS = (torch.float32, torch.bfloat16, torch.int64)
SEQUENCE_CASES = [
    ((2, 1100, 4096), 1, (torch.float32,)),  # runs of 4.3-8.6 MiB (16 KiB a token): 5-9 segments each, in place
    ((3, 40, 2048), 1, FLOATS_AND_INTS),     # shorter runs: one message of a copy
    ((7, 64, 2048), 1, (torch.float32,)),    # runs of 128-256 KiB: messages of 4 (or 8) runs, the last of fewer
    ((2, 2, 1100, 2048), 2, (torch.int64,)),  # two leading axes merged into 4 runs of 4.3-8.6 MiB
    ((40, 2048), 0, FLOATS_AND_INTS),        # each piece one contiguous run
    ((1, 37, 2048), 1, FLOATS_AND_INTS),     # a leading axis of 1: contiguous pieces
]
CHECKS = sum(len(dtypes) for _, _, dtypes in SEQUENCE_CASES)


@contextmanager
def _gloo_rings(on: bool):
    before = os.environ.get("AUTOSHARD_GLOO_RINGS")
    os.environ["AUTOSHARD_GLOO_RINGS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AUTOSHARD_GLOO_RINGS"]
        else:
            os.environ["AUTOSHARD_GLOO_RINGS"] = before


def _rank_tensors(shape, seed, dtype, world):
    return [seeded(shape, seed + r, dtype) for r in range(world)]


def _assert_sum(got, xs, pick, dtype):
    """got is pick(the sum of xs), within the rounding of a sum in another order."""
    want = pick(sum(x.double() for x in xs)).to(dtype)
    if dtype == torch.int64:
        assert torch.equal(got, want)
    else:
        tolerance = 0.1 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def _sequence_rings_match_definitions(rings: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    with _gloo_rings(rings):
        for shape, dim, dtypes in SEQUENCE_CASES:
            for dtype in dtypes:
                xs = _rank_tensors(shape, 10, dtype, world)
                mine = comm.reduce_scatter_to_sequence(xs[rank], dim)
                assert mine.is_contiguous() and mine.dtype == dtype
                _assert_sum(mine, xs, lambda total: autoshard.shard(total, rank, world, dim), dtype)
                # The same tensor laid out tokens-first (not contiguous along the pieces): the
                # same sums, bit for bit.
                strided = xs[rank].movedim(dim, 0).contiguous().movedim(0, dim)
                assert torch.equal(comm.reduce_scatter_to_sequence(strided, dim), mine)
                # Each rank gathers its own piece of its own tensor: exactly their concatenation.
                gathered = comm.all_gather_from_sequence(autoshard.shard(xs[rank], rank, world, dim), dim, shape[dim])
                assert gathered.is_contiguous()
                assert torch.equal(gathered, torch.cat([autoshard.shard(xs[r], r, world, dim) for r in range(world)], dim))
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sequence_rings_match_their_definitions(world_size):
    assert run_on_ranks(_sequence_rings_match_definitions, world_size, True) == [CHECKS] * world_size


def _uneven_rings_match_definitions():
    rank, world = dist.get_rank(), dist.get_world_size()
    # Pieces of 0, 300 (runs of 4.7 MiB in segments, in place) and 2 tokens (32 KiB, through a copy), and so on.
    sizes = ([0, 300, 2] + [9] * world)[:world]
    length = sum(sizes)
    pieces = [seeded((2, n, 4096), 50 + r) for r, n in enumerate(sizes)]
    gathered = comm.all_gather_uneven(pieces[rank], 1, sizes)
    assert torch.equal(gathered, torch.cat(pieces, 1))
    flats = _rank_tensors((length * 16,), 70, torch.float32, world)
    flat_sizes = [n * 16 for n in sizes]
    want = sum(flats[1:], flats[0].clone()).split(flat_sizes)[rank]
    torch.testing.assert_close(comm.reduce_scatter_uneven(flats[rank], flat_sizes), want)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_rings_with_empty_pieces(world_size):
    assert run_on_ranks(_uneven_rings_match_definitions, world_size) == [True] * world_size


def _rings_against_gloo():
    """The rings give what gloo's own collectives give: exactly for a gather, and for a sum
    within rounding (the order of the sum differs)."""
    rank = dist.get_rank()
    x = seeded((3, 40, 2048), 90 + rank, torch.float64)
    answers = {}
    for rings in (True, False):
        with _gloo_rings(rings):
            mine = comm.reduce_scatter_to_sequence(x, 1)
            answers[rings] = (mine, comm.all_gather_from_sequence(mine, 1, 40))
    torch.testing.assert_close(answers[True][0], answers[False][0], rtol=1e-15, atol=1e-15)
    assert torch.equal(comm.all_gather_from_sequence(answers[False][0], 1, 40), answers[False][1])
    return True


def test_rings_agree_with_gloo_collectives():
    assert run_on_ranks(_rings_against_gloo, 3) == [True] * 3


def _async_rings():
    """A reduce-scatter started with async_op gives, once waited for, bit for bit what the
    synchronous one gives, also from the tokens laid out first (as backward's overlap sends
    them); two in flight at once and a synchronous gather between them keep their messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = seeded((3, 40, 2048), 30 + rank)
    sizes = autoshard.split_sizes(40, world)
    sync = comm.reduce_scatter_to_sequence(x, 1)
    front = x.movedim(1, 0).contiguous().view(-1)
    flat_sizes = [n * 3 * 2048 for n in sizes]
    first = comm.reduce_scatter_uneven(front, flat_sizes, async_op=True)
    second = comm.reduce_scatter_uneven(front * 2, flat_sizes, async_op=True)
    between = comm.all_gather_uneven(sync, 1, sizes)
    first, second = comm.wait(first), comm.wait(second)
    local = (sizes[rank], 3, 2048)
    assert torch.equal(first.view(local).movedim(0, 1), sync)
    assert torch.equal(second.view(local).movedim(0, 1), 2 * sync)
    want = sum(seeded((3, 40, 2048), 30 + r) for r in range(world))
    torch.testing.assert_close(between, want)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_async_rings_are_bit_identical_and_keep_their_messages(world_size):
    assert run_on_ranks(_async_rings, world_size) == [True] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_own_collectives_when_rings_are_off(world_size):
    # The padded path every backend without rings takes (NCCL), run here on gloo.
    assert run_on_ranks(_sequence_rings_match_definitions, world_size, False) == [CHECKS] * world_size


def _return_groups():
    """At two ranks a ring's data from the higher rank to the lower goes on a second group over
    the same ranks, made by the first collective; results are bit for bit those of one group
    carrying both directions (a group whose return group was never made). Two-rank subgroups of
    a larger world make theirs among their own ranks; larger groups have none."""
    from autoshard.core import distributed

    rank, world = dist.get_rank(), dist.get_world_size()
    pair = [r for r in range(world) if r // 2 == rank // 2]
    pairs = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world, 2)]
    mine_group = pairs[rank // 2]
    bare = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world, 2)][rank // 2]
    x = seeded((3, 1100, 1024), 40 + rank)
    name = mine_group.group_name
    piece = comm.reduce_scatter_to_sequence(x, 1, mine_group)
    gathered = comm.all_gather_from_sequence(piece, 1, 1100, mine_group)
    returning = distributed._ring_return_groups[name][1]
    assert returning is not None and dist.get_process_group_ranks(returning) == pair
    # The ops called directly on a group nothing prepared: both directions on the one group.
    alone = torch.ops.autoshard.reduce_scatter_to_sequence(x, 1, bare.group_name)
    assert bare.group_name not in distributed._ring_return_groups
    assert torch.equal(alone, piece)
    assert torch.equal(torch.ops.autoshard.all_gather_from_sequence(alone, 1, 1100, bare.group_name), gathered)
    want = sum(seeded((3, 1100, 1024), 40 + r) for r in pair)
    torch.testing.assert_close(gathered, want)
    if world > 2:
        comm.reduce_scatter_to_sequence(x, 1)
        assert distributed._ring_return_groups[dist.group.WORLD.group_name][1] is None
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_rank_rings_return_on_a_group_of_their_own(world_size):
    assert run_on_ranks(_return_groups, world_size) == [True] * world_size


def _only_collectives_prepare():
    """Preparing is collective, so only collectives do it: reading a counter by group on one
    rank alone, or a collective of tensors on another device, makes no return group."""
    from autoshard.core import distributed

    group = dist.new_group([0, 1], backend="gloo")
    if dist.get_rank() == 0:
        with autoshard.CommCounter() as counter:
            pass
        assert counter.counts_of(group) == {} and counter.bytes_of(group) == {}
    meta = torch.empty(4, 6, device="meta")
    comm.all_reduce_(meta, group=group)
    made = group.group_name in distributed._ring_return_groups
    dist.barrier()
    return made


def test_only_collectives_of_cpu_tensors_prepare_rings():
    assert run_on_ranks(_only_collectives_prepare, 2) == [False, False]
