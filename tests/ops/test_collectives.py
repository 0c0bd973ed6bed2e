"""The collective ops beside the mappings (all_reduce_, all_gather_uneven,
reduce_scatter_uneven, all_reduce_bucket, broadcast_) against plain local computations on 1
to 4 gloo ranks, opcheck, Meta shapes, CommCounter by group, and bad input.

Every tensor is derived from a seed, so each rank can rebuild what the others hold."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core.distributed import default_group
from autoshard.core import comm
from checks import expect_errors, opcheck_all
from multirank import run_on_ranks
from seeded import seeded


def _uneven_cases(world):
    """Piece sizes: numpy's rule, a larger last piece, empty pieces, all equal."""
    return [autoshard.split_sizes(7, world), [1] * (world - 1) + [4], [0] * (world - 1) + [3], [2] * world,
            [0] * world]


def _collectives_match_definitions(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0

    for dtype in (torch.float32, torch.int64):
        for op, combine in (("sum", lambda ts: sum(ts)), ("max", lambda ts: torch.stack(ts).amax(0))):
            x = seeded((3, 4), 100 + rank, dtype, device)
            want = combine([seeded((3, 4), 100 + r, dtype, device) for r in range(world)])
            assert comm.all_reduce_(x, op) is x
            torch.testing.assert_close(x, want)
            # A non-contiguous tensor is reduced in place too.
            y = seeded((4, 3), 150 + rank, dtype, device).t()
            comm.all_reduce_(y, op)
            torch.testing.assert_close(y, combine([seeded((4, 3), 150 + r, dtype, device).t() for r in range(world)]))
            checked += 1

    for sizes in _uneven_cases(world):
        for dim in (0, 1, -1):
            shape = [2, 3, 2]
            pieces = []
            for r in range(world):
                shape[dim] = sizes[r]
                pieces.append(seeded(tuple(shape), 200 + r, device=device))
            got = comm.all_gather_uneven(pieces[rank], dim, sizes)
            torch.testing.assert_close(got, torch.cat(pieces, dim), rtol=0, atol=0)
            assert got.is_contiguous()
            checked += 1

        flats = [seeded((sum(sizes),), 300 + r, device=device) for r in range(world)]
        total = sum(flats)
        start = sum(sizes[:rank])
        for async_op in (False, True):
            got = comm.reduce_scatter_uneven(flats[rank], sizes, async_op=async_op)
            if async_op:
                got = comm.wait(got)
            torch.testing.assert_close(got, total[start:start + sizes[rank]])
            checked += 1

    for async_op in (False, True):
        tensors = [seeded((2, 3), 400 + rank, device=device), seeded((5,), 410 + rank, device=device),
                   seeded((4, 2), 420 + rank, device=device).t()]
        bucket = comm.all_reduce_bucket(tensors, async_op=async_op)
        if async_op:
            bucket = comm.wait(bucket)
        want = sum(torch.cat([seeded((2, 3), 400 + r).reshape(-1), seeded((5,), 410 + r),
                              seeded((4, 2), 420 + r).t().reshape(-1)]) for r in range(world))
        torch.testing.assert_close(bucket, want.to(device))
        checked += 1

    for src in range(world):
        x = seeded((3, 2), 500 + rank, device=device)
        assert comm.broadcast_(x, src) is x
        torch.testing.assert_close(x, seeded((3, 2), 500 + src, device=device), rtol=0, atol=0)
        checked += 1
    return checked


def on_devices(cpu_worlds):
    """(device, world size) cases: gloo drives CUDA tensors across ranks on one GPU, and the
    CUDA cases skip without one."""
    return [("cpu", w) for w in cpu_worlds] + [pytest.param("cuda", w, marks=pytest.mark.gpu) for w in (1, 2)]


@pytest.mark.parametrize("device, world_size", on_devices((1, 2, 3, 4)))
def test_collectives_match_their_definitions(device, world_size):
    # 4 all-reduces, 5 sizes x (3 gathers + 2 reduce-scatters), 2 buckets, one broadcast per rank.
    assert run_on_ranks(_collectives_match_definitions, world_size, device) == [4 + 25 + 2 + world_size] * world_size


def _opcheck_cases(device):
    group = default_group()
    name = group.group_name
    rank, world = group.rank(), group.size()
    sizes = [3] + [1] * (world - 1)
    ops_ = torch.ops.autoshard
    return [
        (ops_.all_reduce_.default, (seeded((3, 4), 1, device=device), "sum", name)),
        (ops_.all_reduce_.default, (seeded((4, 3), 2, device=device).t(), "max", name)),
        (ops_.all_gather_uneven.default, (seeded((2, sizes[rank]), 3, device=device), 1, sizes, name)),
        (ops_.all_gather_uneven.default, (seeded((sizes[rank], 2), 4, device=device), -2, sizes, name)),
        (ops_.reduce_scatter_uneven.default, (seeded((sum(sizes),), 5, device=device), sizes, name)),
        (ops_.all_reduce_bucket.default, ([seeded((2, 2), 6, device=device), seeded((3,), 7, device=device)], name)),
        (ops_.broadcast_.default, (seeded((2, 3), 8 + rank, device=device), 0, name)),
    ]


@pytest.mark.parametrize("device, world_size", on_devices((1, 2)))
def test_opcheck(device, world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, device) == [7] * world_size


def _meta_shapes():
    rank = dist.get_rank()
    sizes = [4, 1]
    return [
        tuple(comm.all_gather_uneven(torch.empty(2, sizes[rank], device="meta"), 1, sizes).shape),
        tuple(comm.reduce_scatter_uneven(torch.empty(5, device="meta"), sizes).shape),
        tuple(comm.all_reduce_bucket([torch.empty(2, 3, device="meta"), torch.empty(4, device="meta")]).shape),
        comm.all_reduce_(torch.empty(3, device="meta")).device.type,
        comm.broadcast_(torch.empty(3, device="meta"), 1).device.type,
    ]


def test_meta_kernels_give_shapes():
    assert run_on_ranks(_meta_shapes, 2) == [[(2, 5), (4,), (10,), "meta", "meta"], [(2, 5), (1,), (10,), "meta", "meta"]]


def _counts_by_group():
    """A subgroup of ranks 1.. and the world: each collective is counted under its own group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(range(1, world)))
    x = torch.ones(4)
    with autoshard.CommCounter() as counter:
        comm.all_reduce_(x.clone())
        if rank > 0:
            comm.all_reduce_(x.clone(), "sum", sub)
            comm.reduce_scatter_uneven(torch.ones(5), [3, 2], sub)
            comm.all_gather_uneven(torch.ones(3 if rank == 1 else 2), 0, [3, 2], sub)
        comm.broadcast_(x.clone(), 0)
    world_counts, world_bytes = counter.counts_of(dist.group.WORLD), counter.bytes_of(dist.group.WORLD)
    answer = [world_counts, world_bytes, counter.counts]
    if rank > 0:
        answer += [counter.counts_of(sub), counter.bytes_of(sub), len(counter.groups)]
        dist.destroy_process_group(sub)
    return answer


def test_comm_counter_counts_by_kind_bytes_and_group():
    results = run_on_ranks(_counts_by_group, 3)
    world = [{"all_reduce": 1, "broadcast": 1}, {"all_reduce": 16, "broadcast": 16}]
    assert results[0] == world + [{"all_reduce": 1, "broadcast": 1}]
    for r in (1, 2):
        # On gloo pieces of 3 and 2 elements go round a ring as they are, unpadded: a gather
        # counts the rank's own piece, a reduce-scatter the 5 floats it sums.
        gathered = 4 * (3 if r == 1 else 2)
        assert results[r] == world + [{"all_reduce": 2, "broadcast": 1, "reduce_scatter": 1, "all_gather": 1},
                                      {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1},
                                      {"all_reduce": 16, "reduce_scatter": 20, "all_gather": gathered}, 2]


def _errors_on_ranks():
    cases = [
        (lambda: comm.all_reduce_(torch.ones(2), "mean"), ValueError, ["all_reduce_", "reduce_op", "'sum' or 'max'",
                                                                       "mean"]),
        (lambda: comm.all_gather_uneven(torch.ones(2, 3), 1, [3]), ValueError, ["all_gather_uneven", "sizes",
                                                                               "one size per rank", "(2)", "1"]),
        (lambda: comm.all_gather_uneven(torch.ones(2, 3), 1, [3, -1]), ValueError, ["sizes", ">= 0", "-1"]),
        (lambda: comm.all_gather_uneven(torch.ones(2, 2), 1, [3, 3]), ValueError, ["all_gather_uneven", "x", "sizes[",
                                                                                  "dim 1", "got 2"]),
        (lambda: comm.all_gather_uneven(torch.ones(2, 2, device="meta"), 1, [3, 3]), ValueError, ["sizes[", "got 2"]),
        (lambda: comm.all_gather_uneven(torch.ones(2), 2, [2, 2]), IndexError, ["all_gather_uneven", "dim"]),
        (lambda: comm.reduce_scatter_uneven(torch.ones(2, 2), [2, 2]), ValueError, ["reduce_scatter_uneven", "x",
                                                                                   "1-d", "2 dims"]),
        (lambda: comm.reduce_scatter_uneven(torch.ones(5), [2, 2]), ValueError, ["reduce_scatter_uneven",
                                                                                "sum(sizes) = 4", "got 5"]),
        (lambda: comm.all_reduce_bucket([]), ValueError, ["all_reduce_bucket", "tensors", "empty"]),
        (lambda: comm.all_reduce_bucket([torch.ones(2), torch.ones(2, dtype=torch.float64)]), TypeError,
         ["all_reduce_bucket", "tensors[1]", "Double", "Float"]),
        (lambda: comm.broadcast_(torch.ones(2), 2), ValueError, ["broadcast_", "src", "[0, 2)", "2"]),
        (lambda: comm.broadcast_(torch.ones(2), 0.5), TypeError, ["src", "float"]),
        (lambda: comm.all_reduce_([1.0]), TypeError, ["x", "torch.Tensor", "list"]),
    ]
    return expect_errors(cases)


def test_bad_input_names_the_argument():
    results = run_on_ranks(_errors_on_ranks, 2)
    assert results[0] == results[1] and len(results[0]) == 13


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.ops.autoshard.all_reduce_.default(torch.ones(2), "sum", "no-such-group"),
        lambda: torch.ops.autoshard.all_gather_uneven.default(torch.ones(2), 0, [2], "no-such-group"),
        lambda: torch.ops.autoshard.reduce_scatter_uneven.default(torch.ones(2), [2], "no-such-group"),
        lambda: torch.ops.autoshard.all_reduce_bucket.default([torch.ones(2)], "no-such-group"),
        lambda: torch.ops.autoshard.broadcast_.default(torch.ones(2), 0, "no-such-group"),
    ],
)
def test_unknown_group_name_is_named(call):
    with pytest.raises(ValueError, match="group_name 'no-such-group' names no registered process group"):
        call()
