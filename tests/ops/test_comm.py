"""The mappings of tensor parallelism against their definitions on 1 to 4 gloo ranks,
gradcheck (float64, 2 ranks), opcheck, CommCounter and bad input.

Every tensor is derived from a seed, so each rank can rebuild what the others hold and
check a collective's result against a plain local computation.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.library import opcheck

import autoshard
from autoshard.core.distributed import default_group
from autoshard.core import comm, ops
from multirank import run_on_ranks
from seeded import seeded
from checks import expect_errors, opcheck_all


def piece_shape(shape, dim, size):
    shape = list(shape)
    shape[dim] = size
    return tuple(shape)


# Shapes and (dim, length) cases: uneven splits, an empty piece on 3 and 4 ranks (length 2),
# an even split (the no-padding path), a non-contiguous input.
GATHER_CASES = [((7, 3), 0), ((2, 7, 3), 1), ((2, 3, 7), -1), ((2, 5), 1), ((2, 2), 1), ((12, 2), 0), ((0, 4), 1),
                ((3, 0), 1)]


def _mappings_match_definitions(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = default_group()
    checked = 0

    # copy: identity forward (a new tensor), gradient summed over ranks.
    x = seeded((4, 5), 1, device=device).requires_grad_()
    y = comm.copy_to_parallel(x)
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert y.data_ptr() != x.data_ptr()
    y.backward(seeded((4, 5), 100 + rank, device=device))
    want = sum(seeded((4, 5), 100 + r, device=device) for r in range(world))
    torch.testing.assert_close(x.grad, want)
    checked += 1

    # reduce: sum over ranks forward, identity backward; also integers.
    for dtype in (torch.float32, torch.int64):
        x = seeded((3, 6), 200 + rank, dtype, device)
        want = sum(seeded((3, 6), 200 + r, dtype, device) for r in range(world))
        torch.testing.assert_close(comm.reduce_from_parallel(x, group), want)
        checked += 1
    x = seeded((3, 6), 200 + rank, device=device).t().requires_grad_()  # non-contiguous
    upstream = seeded((6, 3), 300 + rank, device=device)
    comm.reduce_from_parallel(x).backward(upstream)
    torch.testing.assert_close(x.grad, upstream, rtol=0, atol=0)
    checked += 1

    # gather: the full tensor from split_sizes pieces; backward keeps this rank's piece.
    for shape, dim in GATHER_CASES:
        length = shape[dim]
        for dtype in (torch.float32, torch.int64):
            full = seeded(shape, 400, dtype, device)
            local = autoshard.shard(full, rank, world, dim)
            with autoshard.CommCounter() as counter:
                got = comm.gather_from_parallel(local, dim, length)
            torch.testing.assert_close(got, full, rtol=0, atol=0)
            assert got.is_contiguous()
            # This rank's piece: on gloo as it is (a ring), on NCCL padded to the widest piece.
            sent = local.shape[dim] if full.device.type == "cpu" else autoshard.split_sizes(length, world)[0]
            if world > 1 and full.numel() > 0:
                assert counter.counts == {"all_gather": 1}
                assert counter.bytes == {"all_gather": full.numel() // length * sent * full.element_size()}
            else:
                assert counter.counts == {}
            checked += 1
        full = seeded(shape, 400, device=device)
        local = autoshard.shard(full, rank, world, dim).requires_grad_()
        upstream = seeded(shape, 500 + rank, device=device)
        comm.gather_from_parallel(local, dim, length).backward(upstream)
        torch.testing.assert_close(local.grad, autoshard.shard(upstream, rank, world, dim), rtol=0, atol=0)
        checked += 1
    transposed = seeded((5, 2), 600, device=device).t()  # [2, 5] with strides (1, 2)
    local = autoshard.shard(transposed, rank, world, 1).t().contiguous().t()
    torch.testing.assert_close(comm.gather_from_parallel(local, 1, 5), transposed, rtol=0, atol=0)
    checked += 1

    # scatter: this rank's piece forward; backward gathers every rank's gradient piece.
    for shape, dim in GATHER_CASES:
        length = shape[dim]
        full = seeded(shape, 700, device=device).requires_grad_()
        piece = comm.scatter_to_parallel(full, dim)
        torch.testing.assert_close(piece, autoshard.shard(full.detach(), rank, world, dim), rtol=0, atol=0)
        sizes = autoshard.split_sizes(length, world)
        pieces = [seeded(piece_shape(shape, dim, sizes[r]), 800 + r, device=device) for r in range(world)]
        piece.backward(pieces[rank])
        torch.testing.assert_close(full.grad, torch.cat(pieces, dim), rtol=0, atol=0)
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mappings_match_their_definitions(world_size):
    assert run_on_ranks(_mappings_match_definitions, world_size, "cpu") == [37] * world_size


def _replicated_compositions(group):
    """Functions of a replicated input to a replicated output whose every rank computes the
    same global function, so each rank's numerical and analytical Jacobians agree."""
    rank = group.rank()
    scale = 1.5 + rank  # rank-dependent work between the mappings

    def copy_then_reduce(x):
        return comm.reduce_from_parallel(comm.copy_to_parallel(x, group) * scale, group)

    def scatter_then_gather(dim):
        def f(x):
            piece = comm.scatter_to_parallel(x, dim, group)
            return comm.gather_from_parallel(piece * scale, dim, x.shape[dim], group)
        return f

    return [copy_then_reduce, scatter_then_gather(0), scatter_then_gather(1), scatter_then_gather(-1)]


def _gradcheck_mappings():
    group = dist.group.WORLD
    x = seeded((5, 3), 900, torch.float64).requires_grad_()
    results = []
    for f in _replicated_compositions(group):
        results.append(torch.autograd.gradcheck(f, (x,)))
        results.append(torch.autograd.gradgradcheck(f, (x,)))
    # The gradient equals the global function's: sum over ranks of each rank's scale.
    x.grad = None
    _replicated_compositions(group)[0](x).sum().backward()
    world = group.size()
    torch.testing.assert_close(x.grad, torch.full_like(x, sum(1.5 + r for r in range(world))))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradcheck_on_ranks(world_size):
    # 5 rows on 2 ranks is [3, 2]; 3 columns on 3 ranks is [1, 1, 1]; 5 on 3 is [2, 2, 1].
    results = run_on_ranks(_gradcheck_mappings, world_size)
    assert results == [[True] * 8] * world_size


def _opcheck_cases(device):
    group = default_group()
    name = group.group_name
    rank, world = group.rank(), group.size()
    x = seeded((4, 6), 1000, device=device).requires_grad_()
    local = autoshard.shard(seeded((4, 7), 1001, device=device), rank, world, 1).requires_grad_()
    ops_ = torch.ops.autoshard
    return [
        (ops_.copy_to_parallel.default, (x, name)),
        (ops_.copy_to_parallel.default, (x.t(), name)),
        (ops_.reduce_from_parallel.default, (x, name)),
        (ops_.reduce_from_parallel.default, (x[:, ::2], name)),
        (ops_.gather_from_parallel.default, (local, 1, 7, name)),
        (ops_.gather_from_parallel.default, (local, -1, 7, name)),
        (ops_.scatter_to_parallel.default, (x, 0, name)),
        (ops_.scatter_to_parallel.default, (x.t(), -1, name)),
    ]


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, "cpu") == [8] * world_size


def test_opcheck_counter_ops():
    opcheck(torch.ops.autoshard.comm_counters.default, ())
    # aot_dispatch's comparison of outputs has no rule for strings; the rest applies.
    opcheck(torch.ops.autoshard.comm_counter_kinds.default, (),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    opcheck(torch.ops.autoshard.comm_group_counters.default, (),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert ops.comm_counter_kinds() == ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    assert len(ops.comm_counters()) == 8


def _counter_semantics():
    rank = dist.get_rank()
    x = seeded((4, 8), 1100).requires_grad_()
    nbytes = x.numel() * x.element_size()
    outer = autoshard.CommCounter()
    with outer:
        with autoshard.CommCounter() as inner:
            y = comm.reduce_from_parallel(comm.copy_to_parallel(x))
            assert inner.counts == {"all_reduce": 1}  # readable inside the block
            y.sum().backward()  # backward's all-reduce is issued by C++ autograd
        piece = comm.scatter_to_parallel(x.detach(), 1)  # a scatter issues nothing
        comm.gather_from_parallel(piece, 1, 8)
    assert inner.counts == {"all_reduce": 2} and inner.bytes == {"all_reduce": 2 * nbytes}
    assert outer.counts == {"all_reduce": 2, "all_gather": 1}
    assert outer.bytes == {"all_reduce": 2 * nbytes, "all_gather": nbytes // 2}
    comm.reduce_from_parallel(x.detach())  # outside every counter
    assert outer.counts == {"all_reduce": 2, "all_gather": 1}
    with outer:  # re-entering adds to what was counted
        with outer:  # nested in itself: counted once
            comm.reduce_from_parallel(x.detach())
    assert outer.counts == {"all_reduce": 3, "all_gather": 1}
    assert "all_reduce" in repr(outer)
    return rank


def test_comm_counter_nests_and_reenters():
    assert run_on_ranks(_counter_semantics, 2) == [0, 1]


def _group_helpers():
    world_group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    # A subgroup holding every rank but the first, as a 2-D mesh's dimension would.
    sub = dist.new_group(list(range(1, world)))
    answers = [comm.world_size(), comm.rank(), comm.group_name() == world_group.group_name,
               autoshard.init_distributed() == (rank, world)]
    if rank > 0:
        answers.append(comm.world_size(sub) == world - 1 and comm.rank(sub) == rank - 1)
        x = seeded((2,), 1200 + rank)
        want = sum(seeded((2,), 1200 + r) for r in range(1, world))
        torch.testing.assert_close(comm.reduce_from_parallel(x, sub), want)
        autoshard.core.distributed.set_default_group(sub)
        try:
            torch.testing.assert_close(comm.reduce_from_parallel(x), want)
            answers.append(comm.group_name() == sub.group_name)
        finally:
            autoshard.core.distributed.set_default_group(None)
        dist.destroy_process_group(sub)
    assert comm.group_name() == world_group.group_name
    return answers


def test_group_helpers_and_default_group():
    results = run_on_ranks(_group_helpers, 3)
    assert results[0] == [3, 0, True, True]
    assert results[1] == [3, 1, True, True, True, True]
    assert results[2] == [3, 2, True, True, True, True]


def _meta_shapes():
    rank = dist.get_rank()
    local = torch.empty(2, 4 - rank, 5, device="meta")  # split_sizes(7, 2) == [4, 3]
    full = torch.empty(2, 7, 5, device="meta")
    return [
        tuple(comm.gather_from_parallel(local, 1, 7).shape),
        tuple(comm.scatter_to_parallel(full, 1).shape),
        tuple(comm.reduce_from_parallel(full).shape),
        comm.copy_to_parallel(full).device.type,
    ]


def test_meta_kernels_give_shapes():
    assert run_on_ranks(_meta_shapes, 2) == [
        [(2, 7, 5), (2, 4, 5), (2, 7, 5), "meta"],
        [(2, 7, 5), (2, 3, 5), (2, 7, 5), "meta"],
    ]


# ---- bad input


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.copy_to_parallel(torch.ones(2), "no-such-group"),
        lambda: ops.reduce_from_parallel(torch.ones(2), "no-such-group"),
        lambda: ops.gather_from_parallel(torch.ones(2), 0, 2, "no-such-group"),
        lambda: ops.scatter_to_parallel(torch.ones(2), 0, "no-such-group"),
        lambda: ops.copy_to_parallel(torch.ones(2, device="meta"), "no-such-group"),
    ],
)
def test_unknown_group_name_is_named(call):
    with pytest.raises(ValueError, match="group_name 'no-such-group' names no registered process group"):
        call()


def test_wrappers_need_initialised_distributed():
    assert not dist.is_initialized()  # the test process itself never joins a group
    for call in (lambda: comm.copy_to_parallel(torch.ones(2)), lambda: comm.world_size(), lambda: comm.group_name()):
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
            call()


def _errors_on_ranks():
    cases = [
        # split_sizes(9, 2) == [5, 4]: a piece of 3 is wrong on both ranks.
        (lambda: comm.gather_from_parallel(torch.ones(2, 3), 1, 9), ValueError,
         ["gather_from_parallel", "length 9", "dim 1", "split_sizes(9, 2)", "got 3"]),
        (lambda: comm.gather_from_parallel(torch.ones(2, 3, device="meta"), 1, 9), ValueError,
         ["gather_from_parallel", "split_sizes(9, 2)", "got 3"]),
        (lambda: comm.gather_from_parallel(torch.ones(2, 3), 1, -1), ValueError, ["length", ">= 0", "-1"]),
        (lambda: comm.gather_from_parallel(torch.ones(2, 3), 2, 6), IndexError, ["gather_from_parallel", "dim", "2"]),
        (lambda: comm.gather_from_parallel(torch.tensor(1.0), 0, 2), IndexError, ["x", "0-d"]),
        (lambda: comm.scatter_to_parallel(torch.ones(2, 3), -3), IndexError, ["scatter_to_parallel", "dim", "-3"]),
        (lambda: comm.scatter_to_parallel(torch.tensor(1.0), 0), IndexError, ["scatter_to_parallel", "x", "0-d"]),
        (lambda: comm.scatter_to_parallel([1.0], 0), TypeError, ["x", "torch.Tensor", "list"]),
        (lambda: comm.gather_from_parallel(torch.ones(2), 0.5, 2), TypeError, ["dim", "float"]),
        (lambda: comm.copy_to_parallel(torch.ones(2), group="0"), TypeError, ["group", "ProcessGroup", "str"]),
    ]
    return expect_errors(cases)


def test_bad_input_names_the_argument():
    results = run_on_ranks(_errors_on_ranks, 2)
    assert results[0] == results[1] and len(results[0]) == 10


# ---- CUDA (skipped without a GPU): gloo drives CUDA tensors across ranks on one GPU


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_mappings_on_cuda_match_their_definitions(world_size):
    assert run_on_ranks(_mappings_match_definitions, world_size, "cuda") == [37] * world_size


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck_cuda(world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, "cuda") == [8] * world_size


def _nccl_group_of_one():
    group = dist.new_group([0], backend="nccl")
    x = seeded((3, 4), 1300, device="cuda").requires_grad_()
    y = comm.gather_from_parallel(comm.reduce_from_parallel(comm.copy_to_parallel(x, group), group), 1, 4, group)
    y.backward(torch.ones_like(y))
    ok = bool(torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x)))
    dist.destroy_process_group(group)
    return ok


@pytest.mark.gpu
def test_nccl_group_resolves_by_name():
    assert run_on_ranks(_nccl_group_of_one, 1) == [True]


_INIT_SCRIPT = r"""
import os, socket
import torch.distributed as dist
import autoshard

assert autoshard.init_distributed() == (0, 1)  # no torchrun: a group of one
assert autoshard.init_distributed() == (0, 1)  # idempotent
assert dist.get_backend() == "gloo"
dist.destroy_process_group()

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
try:
    autoshard.init_distributed()
except ValueError as e:
    assert "MASTER_ADDR" in str(e), e
else:
    raise AssertionError("missing MASTER_ADDR was accepted")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
assert autoshard.init_distributed() == (0, 1)
assert autoshard.comm.group_name() == dist.group.WORLD.group_name
x = autoshard.comm.reduce_from_parallel(autoshard.comm.copy_to_parallel(__import__("torch").ones(3)))
assert x.tolist() == [1.0, 1.0, 1.0]
dist.destroy_process_group()
print("ok")
"""


def test_init_distributed_from_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo either way, so the check is the same on any machine
    done = subprocess.run([sys.executable, "-c", _INIT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
