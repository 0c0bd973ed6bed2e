"""A BatchNorm over channels split across the ranks (a column-parallel convolution's output
channels, before the row-parallel convolution that reads them: ResNet's, MobileNet's blocks).

A BatchNorm's statistics are per channel: the mean and variance of each channel over the batch
and the spatial positions. Each rank holds whole channels, every position of them, so it
computes exactly the unsharded norm's statistics for its channels with no communication, in
forward and in backward, and holds the matching parts of the weight and bias.

The running statistics are the one exception. They stay whole on every rank, the same
everywhere, so that evaluation, a checkpoint and a reload on another world size all see the
whole tensors a BatchNorm holds. A training forward updates a copy of this rank's channels
(torch's own update), then one all-gather of those channels' new values (2 x channels
numbers) writes every rank's into each rank's buffers. An evaluating forward
reads them and communicates nothing.
"""

from dataclasses import replace
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import comm
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec
from .layer_norm import take_parameters


def is_batch_norm(module: nn.Module) -> bool:
    """Whether `module` is a torch BatchNorm (1d, 2d or 3d) computing with torch's own forward
    (a subclass with a forward of its own, SyncBatchNorm or a lazy one not yet sized is not)."""
    base = nn.modules.batchnorm._BatchNorm
    return (isinstance(module, base) and type(module).forward is base.forward
            and not isinstance(module, (nn.SyncBatchNorm, nn.modules.lazy.LazyModuleMixin)))


class ShardedBatchNorm(nn.Module):
    """This rank's channels of a BatchNorm over ``spec.full_size`` channels (axis 1 of its
    input), computing what ``norm`` computes for them in training and in evaluation, with
    ``norm``'s momentum, eps and running statistics (whole on every rank). Build one with
    ``from_norm``."""

    autoshard_layer = True

    def __init__(self, norm: nn.Module, spec: ShardSpec, group=None):
        super().__init__()
        if not is_batch_norm(norm):
            raise ValueError(f"ShardedBatchNorm: norm must be a torch BatchNorm1d/2d/3d, got {type(norm).__name__}")
        if not isinstance(spec, ShardSpec) or spec.dim != 0 or spec.repeat is not None or spec.whole_parts is not None:
            raise ValueError(f"ShardedBatchNorm: spec must be a ShardSpec over dim 0 without repeat or whole parts, "
                             f"got {spec!r}")
        if spec.full_size != norm.num_features:
            raise ValueError(f"ShardedBatchNorm: spec splits {spec.full_size} channels, norm has {norm.num_features}")
        self.group = resolve(group, "ShardedBatchNorm")
        self.autoshard_class = type(norm)
        self.features = norm.num_features
        self.eps, self.momentum = norm.eps, norm.momentum
        self.track_running_stats = norm.track_running_stats
        self.ranges = spec.local_ranges()
        # Every rank's (start, length) runs, in rank order: where each rank's gathered values go.
        self.rank_ranges: List[List[Tuple[int, int]]] = [replace(spec, rank=r).local_ranges()
                                                         for r in range(spec.world_size)]
        self.local_features = spec.local_size()
        take_parameters(self, spec, weight=getattr(norm, "weight", None), bias=getattr(norm, "bias", None))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(norm, name, None), persistent=name not in norm._non_persistent_buffers_set)
        self.train(norm.training)  # a model parallelized in eval mode stays so
        attach_layer_state(self)

    @classmethod
    def from_norm(cls, norm: nn.Module, spec: ShardSpec, group=None) -> "ShardedBatchNorm":
        """This rank's channels of ``norm`` (its weight and bias split by ``spec``)."""
        return cls(norm, spec, group)

    def _local(self, buffer: torch.Tensor, copy: bool) -> torch.Tensor:
        """This rank's channels of a whole buffer: a view, or with `copy` a tensor of their own."""
        if len(self.ranges) == 1:
            start, length = self.ranges[0]
            view = buffer.narrow(0, start, length)
            return view.clone() if copy else view
        return torch.cat([buffer.narrow(0, start, length) for start, length in self.ranges])

    def _share_running_stats(self, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Writes every rank's updated channels into this rank's whole running statistics."""
        with torch.no_grad():
            sizes = [2 * sum(length for _, length in ranges) for ranges in self.rank_ranges]
            gathered = comm.all_gather_uneven(torch.cat([mean, var]), 0, sizes, self.group)
            offset = 0
            for ranges, size in zip(self.rank_ranges, sizes):
                means, variances = gathered.narrow(0, offset, size).split(size // 2)
                at = 0
                for start, length in ranges:
                    self.running_mean.narrow(0, start, length).copy_(means.narrow(0, at, length))
                    self.running_var.narrow(0, start, length).copy_(variances.narrow(0, at, length))
                    at += length
                offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != self.local_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"ShardedBatchNorm: x must hold this rank's {self.local_features} channels on axis 1, "
                             f"got {got}")
        # As torch's _BatchNorm.forward: the factor of the running update, and whether the batch's
        # statistics are used.
        factor = 0.0 if self.momentum is None else self.momentum
        updating = self.training and self.track_running_stats and self.running_mean is not None
        if updating and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        reads_running = self.running_mean is not None and (not self.training or self.track_running_stats)
        # A training forward updates copies: batch_norm keeps its running statistics for backward,
        # and the buffers are written again below, after the gather.
        mean = self._local(self.running_mean, copy=updating) if reads_running else None
        var = self._local(self.running_var, copy=updating) if reads_running else None
        out = F.batch_norm(x, mean, var, self.weight, self.bias, batch_stats, factor, self.eps)
        if updating:
            self._share_running_stats(mean, var)
        return out

    def extra_repr(self) -> str:
        return f"{self.local_features} of {self.features} channels, eps={self.eps}, momentum={self.momentum}"
