"""Sequence parallelism's steps, attached to the layers at the edges of a sequence region.

Between a layer that ends a tensor-parallel region (a row layer, a vocabulary-parallel
embedding) and the column layers that start the next, the plan may split the tokens over the
ranks instead of holding them whole (``LayerPlan.sequence``). The ending layer's all-reduce
becomes a reduce-scatter over the token axis (``ReduceScatterTokens``), a replicated
embedding's output is cut to this rank's tokens (``SliceTokens``), and each column layer
gathers the tokens back before its matmul (``GatherTokens``, shared like an input copy by the
column layers reading one tensor). Tokens are split with ``split_sizes`` (numpy's
array_split rule), so any sequence length works.

The layers that split a region record its full length in one ``SequenceShards`` per region,
which the gathering layers read: a rank's piece alone does not say how long the sequence was.
"""

from typing import Optional

import torch

from .. import ops


class SequenceShards:
    """One sequence region's state during a forward: how many tokens it holds in all."""

    def __init__(self, group_name: str, region: int):
        self.group_name = group_name
        self.region = region
        self.length: Optional[int] = None

    def __repr__(self) -> str:
        return f"SequenceShards(region={self.region}, length={self.length})"


class _Step:
    def __init__(self, shards: SequenceShards, dim: int):
        self.shards = shards
        self.dim = dim

    def _record(self, x: torch.Tensor) -> None:
        if x.dim() <= self.dim:
            raise ValueError(f"{type(self).__name__}: the plan splits tokens on dim {self.dim}, but the tensor has "
                             f"shape {tuple(x.shape)}")
        self.shards.length = int(x.shape[self.dim])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, region={self.shards.region})"


class ReduceScatterTokens(_Step):
    """In place of a row layer's all-reduce: the sum over the group of this rank's tokens."""

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        self._record(y)
        return ops.reduce_scatter_to_sequence(y, self.dim, self.shards.group_name)


class SliceTokens(_Step):
    """A replicated embedding's output cut to this rank's tokens (its gradient gathered back)."""

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        self._record(y)
        return ops.scatter_to_parallel(y, self.dim, self.shards.group_name)


class GatherTokens(_Step):
    """In place of a column layer's input copy: every rank's tokens, in order (its gradient
    summed over the group, this rank keeping its tokens' piece)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards.length is None:
            raise RuntimeError("GatherTokens: no layer has split this region's tokens yet in this forward; the plan's "
                               "sequence region does not match the model's call order")
        return ops.all_gather_from_sequence(x, self.dim, self.shards.length, self.shards.group_name)


class PlanSteps:
    """The steps of a plan's sequence regions, one SequenceShards per region; `gathers` maps
    each column layers' copy group that gathers tokens to its GatherTokens."""

    def __init__(self, plan, group_name: str):
        self.shards = {}
        self.gathers = {}
        for layer in plan.layers:
            if layer.sequence == "gather" and layer.copy_group not in self.gathers:
                self.gathers[layer.copy_group] = GatherTokens(self._region(layer, group_name), layer.sequence_dim)
        self._group_name = group_name

    def _region(self, layer, group_name: str) -> SequenceShards:
        if layer.sequence_region not in self.shards:
            self.shards[layer.sequence_region] = SequenceShards(group_name, layer.sequence_region)
        return self.shards[layer.sequence_region]

    def reduce_scatter(self, layer) -> ReduceScatterTokens:
        return ReduceScatterTokens(self._region(layer, self._group_name), layer.sequence_dim)

    def slice_hook(self, layer):
        step = SliceTokens(self._region(layer, self._group_name), layer.sequence_dim)
        return lambda module, inputs, output: step(output)


def steps(plan, group_name: str) -> PlanSteps:
    return PlanSteps(plan, group_name)
