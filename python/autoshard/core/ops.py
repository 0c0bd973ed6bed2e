"""Thin typed wrappers over ``torch.ops.autoshard``: one function per op, no logic."""

from typing import List, Optional, Sequence, Tuple

import torch

from . import _library

_library.load()
_ops = torch.ops.autoshard
Tensors = Sequence[torch.Tensor]


def split_sizes(length: int, sections: int) -> List[int]:
    return _ops.split_sizes.default(length, sections)


def array_split_sections(x: torch.Tensor, sections: int, dim: int = 0) -> List[torch.Tensor]:
    return _ops.array_split.default(x, sections, dim)


def array_split_indices(x: torch.Tensor, indices: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    return _ops.array_split.indices(x, list(indices), dim)


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    return _ops.shard.default(x, rank, world_size, dim)


def unsplit(pieces: Tensors, starts: Sequence[int], length: int, dim: int) -> torch.Tensor:
    return _ops.unsplit.default(list(pieces), list(starts), length, dim)


def copy_to_parallel(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _ops.copy_to_parallel.default(x, group_name)


def reduce_from_parallel(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _ops.reduce_from_parallel.default(x, group_name)


def gather_from_parallel(x: torch.Tensor, dim: int, length: int, group_name: str) -> torch.Tensor:
    return _ops.gather_from_parallel.default(x, dim, length, group_name)


def scatter_to_parallel(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return _ops.scatter_to_parallel.default(x, dim, group_name)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return _ops.reduce_scatter_to_sequence.default(x, dim, group_name)


def all_gather_from_sequence(x: torch.Tensor, dim: int, length: int, group_name: str) -> torch.Tensor:
    return _ops.all_gather_from_sequence.default(x, dim, length, group_name)


def all_reduce_(x: torch.Tensor, reduce_op: str, group_name: str) -> None:
    _ops.all_reduce_.default(x, reduce_op, group_name)


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: Sequence[int], group_name: str) -> torch.Tensor:
    return _ops.all_gather_uneven.default(x, dim, list(sizes), group_name)


def reduce_scatter_uneven(x: torch.Tensor, sizes: Sequence[int], group_name: str, async_op: bool = False) -> torch.Tensor:
    return _ops.reduce_scatter_uneven.default(x, list(sizes), group_name, async_op)


def all_reduce_bucket(tensors: Tensors, group_name: str, async_op: bool = False) -> torch.Tensor:
    return _ops.all_reduce_bucket.default(list(tensors), group_name, async_op)


def broadcast_(x: torch.Tensor, src: int, group_name: str) -> None:
    _ops.broadcast_.default(x, src, group_name)


def shard_ranges(
    full_size: int, world_size: int, rank: int, units: Optional[int] = None, parts: Optional[Sequence[int]] = None,
    repeat: Optional[int] = None,
) -> List[Tuple[int, int]]:
    flat = _ops.shard_ranges.default(full_size, world_size, rank, units, None if parts is None else list(parts), repeat)
    return list(zip(flat[0::2], flat[1::2]))


def copy_runs(shape: Sequence[int], itemsize: int, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    return _ops.copy_runs.default(list(shape), itemsize, list(src), list(dst))


def copy_byte_runs_(dst: torch.Tensor, src: torch.Tensor, runs: torch.Tensor, src_offset: int) -> None:
    _ops.copy_byte_runs_.default(dst, src, runs, src_offset)


def comm_counter_kinds() -> List[str]:
    return _ops.comm_counter_kinds.default()


def comm_counters() -> List[int]:
    return _ops.comm_counters.default()


def comm_group_counters() -> Tuple[List[str], List[int]]:
    return _ops.comm_group_counters.default()


def vocab_parallel_lookup(
    ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, padding_idx: int, vocab_size: int
) -> torch.Tensor:
    return _ops.vocab_parallel_lookup.default(ids, weight, vocab_start, padding_idx, vocab_size)


def vocab_parallel_lookup_backward(
    grad: torch.Tensor, ids: torch.Tensor, num_rows: int, vocab_start: int, padding_idx: int
) -> torch.Tensor:
    return _ops.vocab_parallel_lookup_backward.default(grad, ids, num_rows, vocab_start, padding_idx)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group_name: str, ignore_index: int, label_smoothing: float,
    reduction: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ops.vocab_parallel_cross_entropy.default(logits, labels, group_name, ignore_index, label_smoothing,
                                                     reduction)


def vocab_parallel_cross_entropy_backward(
    grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, vocab_range: torch.Tensor,
    ignore_index: int, label_smoothing: float, reduction: str,
) -> torch.Tensor:
    return _ops.vocab_parallel_cross_entropy_backward.default(grad_loss, logits, labels, lse, vocab_range,
                                                              ignore_index, label_smoothing, reduction)


def einsum_weight_axes(equation: str) -> Tuple[List[str], List[str], List[Optional[int]], List[Optional[int]]]:
    return _ops.einsum_weight_axes.default(equation)


def einsum_dense_shapes(equation: str, input_shape: Sequence[Optional[int]], output_shape: Sequence[Optional[int]],
                        bias_axes: Optional[str]) -> Tuple[List[int], List[int], List[Optional[int]]]:
    return _ops.einsum_dense_shapes.default(equation, list(input_shape), list(output_shape), bias_axes)


def fused_adamw_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, lr: float, beta1: float,
                 beta2: float, weight_decay: float, eps: float, step: int, maximize: bool) -> None:
    _ops.fused_adamw_.default(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2,
                              weight_decay, eps, step, maximize)


def fused_adamw_master_(params: Tensors, grads: Tensors, master_params: Tensors, exp_avgs: Tensors,
                        exp_avg_sqs: Tensors, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
                        step: int, maximize: bool) -> None:
    _ops.fused_adamw_master_.default(list(params), list(grads), list(master_params), list(exp_avgs),
                                     list(exp_avg_sqs), lr, beta1, beta2, weight_decay, eps, step, maximize)


def fused_sgd_master_(params: Tensors, grads: Tensors, master_params: Tensors, momentum_buffers: Tensors, lr: float,
                      momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
                      first_step: bool) -> None:
    _ops.fused_sgd_master_.default(list(params), list(grads), list(master_params), list(momentum_buffers), lr,
                                   momentum, dampening, weight_decay, nesterov, maximize, first_step)


def fused_sgd_(params: Tensors, grads: Tensors, momentum_buffers: Tensors, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool, maximize: bool, first_step: bool) -> None:
    _ops.fused_sgd_.default(list(params), list(grads), list(momentum_buffers), lr, momentum, dampening, weight_decay,
                            nesterov, maximize, first_step)
