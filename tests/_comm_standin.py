"""Pure-Python collectives with ``autoshard.comm``'s API, for multi-rank tests of the sharded
layers where ``autoshard.comm`` is not importable. ``install()`` puts them in place only then."""

import importlib
import sys

import torch
import torch.distributed as dist

import autoshard


def _group(group):
    return dist.group.WORLD if group is None else group


def world_size(group=None) -> int:
    return dist.get_world_size(_group(group)) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(_group(group)) if dist.is_initialized() else 0


def group_name(group=None) -> str:
    return _group(group).group_name


def _all_reduce(x, group):
    x = x.contiguous().clone()
    if world_size(group) > 1:
        dist.all_reduce(x, group=_group(group))
    return x


def _all_gather(x, dim, length, group):
    world = world_size(group)
    if world == 1:
        return x.contiguous()
    sizes = autoshard.split_sizes(length, world)
    padded_shape = list(x.shape)
    padded_shape[dim] = max(sizes)
    padded = x.new_zeros(padded_shape)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=_group(group))
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes)], dim=dim)


def _own_piece(x, dim, group):
    return autoshard.shard(x.detach(), rank(group), world_size(group), dim)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, length, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, length, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_piece(grad, ctx.dim, ctx.group), None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return _own_piece(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.length, ctx.group), None, None


def copy_to_parallel(x, group=None):
    return _Copy.apply(x, group)


def reduce_from_parallel(x, group=None):
    return _Reduce.apply(x, group)


def gather_from_parallel(x, dim, length, group=None):
    return _Gather.apply(x, dim, length, group)


def scatter_to_parallel(x, dim, group=None):
    return _Scatter.apply(x, dim, group)


def install() -> None:
    """Makes ``from autoshard import comm`` work, with the real module if there is one."""
    try:
        importlib.import_module("autoshard.comm")
    except ModuleNotFoundError:
        module = sys.modules[__name__]
        sys.modules["autoshard.comm"] = module
        autoshard.comm = module
