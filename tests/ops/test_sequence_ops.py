"""Sequence parallelism's collectives (reduce_scatter_to_sequence, all_gather_from_sequence)
against their definitions on 1 to 4 gloo ranks, with uneven token splits; gradcheck of their
composition (float64), opcheck, CommCounter's tallies and bad input."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core.distributed import default_group
from autoshard.core import comm
from checks import opcheck_all
from multirank import run_on_ranks
from seeded import seeded

# (shape, token dim): 7 tokens split 4/3, 3/2/2, 2/2/2/1; 2 tokens leave empty pieces on 3 and
# 4 ranks; an even split; a token axis that is not the first.
CASES = [((2, 7, 3), 1), ((7, 5), 0), ((3, 2, 4), 1), ((12, 2), 0), ((2, 3, 7), -1), ((2, 0, 3), 1)]


def _definitions(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for shape, dim in CASES:
        length = shape[dim]
        sizes = autoshard.split_sizes(length, world)
        # reduce-scatter: this rank's tokens of the sum over ranks.
        x = seeded(shape, 10 + rank, device=device).requires_grad_()
        with autoshard.CommCounter() as counter:
            got = comm.reduce_scatter_to_sequence(x, dim)
        total = sum(seeded(shape, 10 + r, device=device) for r in range(world))
        torch.testing.assert_close(got, autoshard.shard(total, rank, world, dim))
        assert got.is_contiguous()
        if world > 1 and x.numel() > 0:
            # The whole tensor goes in: on gloo round a ring as it is, on NCCL padded to the
            # widest piece (the bytes of an all-reduce of it).
            per_token = x.numel() // length
            padded_length = length if x.device.type == "cpu" else world * max(sizes)
            assert counter.counts == {"reduce_scatter": 1}
            assert counter.bytes == {"reduce_scatter": padded_length * per_token * x.element_size()}
        else:
            assert counter.counts == {}
        # ... its backward gathers every rank's gradient of its tokens.
        pieces = [seeded(_resized(shape, dim, sizes[r]), 20 + r, device=device) for r in range(world)]
        got.backward(pieces[rank])
        torch.testing.assert_close(x.grad, torch.cat(pieces, dim), rtol=0, atol=0)
        checked += 1
        # all-gather: every rank's tokens; backward sums the gradient, keeping this rank's tokens.
        full = seeded(shape, 30, device=device)
        local = autoshard.shard(full, rank, world, dim).requires_grad_()
        gathered = comm.all_gather_from_sequence(local, dim, length)
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)
        gathered.backward(seeded(shape, 40 + rank, device=device))
        upstream = sum(seeded(shape, 40 + r, device=device) for r in range(world))
        torch.testing.assert_close(local.grad, autoshard.shard(upstream, rank, world, dim))
        checked += 1
    return checked


def _resized(shape, dim, size):
    shape = list(shape)
    shape[dim] = size
    return tuple(shape)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sequence_collectives_match_their_definitions(world_size):
    assert run_on_ranks(_definitions, world_size, "cpu") == [2 * len(CASES)] * world_size


def _gradcheck():
    """A replicated input to a replicated output as a block of sequence parallelism computes
    it: rank-dependent partial sums reduce-scattered over the tokens, a per-token function of
    this rank's tokens, the tokens gathered for rank-dependent work again, summed. Every rank
    computes the same global function, so each rank's numerical and analytical Jacobians agree."""
    group = dist.group.WORLD
    first, second = 1.5 + group.rank(), 0.5 - group.rank()

    def f(x):
        tokens = comm.reduce_scatter_to_sequence(comm.copy_to_parallel(x, group) * first, 1, group)
        gathered = comm.all_gather_from_sequence(tokens * tokens, 1, x.shape[1], group)
        return comm.reduce_from_parallel(gathered * second, group)

    x = seeded((2, 5, 3), 50, torch.float64).requires_grad_()
    return [torch.autograd.gradcheck(f, (x,)), torch.autograd.gradgradcheck(f, (x,))]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradcheck_on_ranks(world_size):
    assert run_on_ranks(_gradcheck, world_size) == [[True, True]] * world_size


def _opcheck_cases(device):
    group = default_group()
    name, rank, world = group.group_name, group.rank(), group.size()
    x = seeded((2, 7, 4), 60, device=device).requires_grad_()
    local = autoshard.shard(seeded((2, 7, 4), 61, device=device), rank, world, 1).requires_grad_()
    ops_ = torch.ops.autoshard
    return [
        (ops_.reduce_scatter_to_sequence.default, (x, 1, name)),
        (ops_.reduce_scatter_to_sequence.default, (x.transpose(0, 1), 0, name)),  # non-contiguous
        (ops_.all_gather_from_sequence.default, (local, 1, 7, name)),
        (ops_.all_gather_from_sequence.default, (local, -2, 7, name)),
    ]


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, "cpu") == [4] * world_size


def _bad_input():
    rank = dist.get_rank()
    local = torch.zeros(2, 3 if rank == 0 else 2, 4)
    errors = []
    for error, call in ((ValueError, lambda: comm.all_gather_from_sequence(torch.zeros(2, 5, 4), 1, 7)),  # not my piece
                        (IndexError, lambda: comm.reduce_scatter_to_sequence(torch.zeros(2, 3), 2)),  # no dim 2
                        (ValueError, lambda: comm.all_gather_from_sequence(local, 1, -1))):
        with pytest.raises(error) as info:
            call()
        errors.append(str(info.value))
    return errors


def test_bad_input_names_the_op_and_argument():
    errors = run_on_ranks(_bad_input, 2)[0]
    assert "all_gather_from_sequence" in errors[0] and "split_sizes(7, 2)" in errors[0]
    assert "reduce_scatter_to_sequence: dim must be in [-2, 2)" in errors[1]
    assert "all_gather_from_sequence" in errors[2] and "length must be >= 0" in errors[2]


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_sequence_collectives_on_cuda(world_size):
    assert run_on_ranks(_definitions, world_size, "cuda") == [2 * len(CASES)] * world_size


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck_cuda(world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, "cuda") == [4] * world_size
