"""Thin typed wrappers over ``torch.ops.autoshard``: one function per op, no logic."""

from typing import List, Sequence

import torch

from . import _library

_library.load()
_ops = torch.ops.autoshard


def split_sizes(length: int, sections: int) -> List[int]:
    return _ops.split_sizes.default(length, sections)


def array_split_sections(x: torch.Tensor, sections: int, dim: int = 0) -> List[torch.Tensor]:
    return _ops.array_split.default(x, sections, dim)


def array_split_indices(x: torch.Tensor, indices: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    return _ops.array_split.indices(x, list(indices), dim)


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    return _ops.shard.default(x, rank, world_size, dim)


def unsplit(pieces: Sequence[torch.Tensor], starts: Sequence[int], length: int, dim: int) -> torch.Tensor:
    return _ops.unsplit.default(list(pieces), list(starts), length, dim)


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    step: int,
    maximize: bool,
) -> None:
    _ops.fused_adamw_.default(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2, weight_decay, eps, step,
        maximize,
    )


def fused_sgd_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    _ops.fused_sgd_.default(
        list(params), list(grads), list(momentum_buffers), lr, momentum, dampening, weight_decay, nesterov, maximize,
        first_step,
    )
