"""Sequence parallelism's steps, attached to the layers at the edges of a sequence region.

Between a layer that ends a tensor-parallel region (a row layer, a vocabulary-parallel
embedding) and the column layers that start the next, the plan may split the tokens over the
ranks instead of holding them whole (``LayerPlan.sequence``). The row layer's all-reduce
becomes a reduce-scatter over the token axis (``ReduceScatterTokens``), a tensor held whole
that joins the region (the embedding output entering the first block) is cut to this rank's
tokens where a module receives it (``SliceTokens``, ``ShardingPlan.sequence_entries``), and
each column layer gathers the tokens back before its matmul (``GatherTokens``, shared like an
input copy by the column layers reading one tensor). Tokens are split with ``split_sizes`` (numpy's
array_split rule), so any sequence length works.

A column layer reading the tokens through ops that index the token axis (a causal LM's head
reading the last tokens) gets them gathered where a module returns them instead
(``PlanSteps.exit_hook``, ``ShardingPlan.sequence_exits``; see csrc/plan/token_indexing.cpp).
Such a gather's gradient is reduce-scattered, which sums the column layers' partial gradients;
but what a module returns also leaves the plan's reach (a backbone's ``last_hidden_state`` used
by a classifier, a fused LM head, a user's loss), and the replicated gradient of such a reader
would be summed N times. So the gathered tokens are returned with their gradient divided by N,
and the column layers reading them multiply theirs by N (``ExitGradientScale``): the plan's
readers are summed as before, any other reader counted once, with no collective more.

The layers that split a region record its full length in one ``SequenceShards`` per region,
which the gathering layers read: a rank's piece alone does not say how long the sequence was.
"""

import functools
from typing import Optional

import torch

from torch.utils._pytree import tree_flatten, tree_unflatten

from . import backward_overlap
from ..core import ops, region_generators
from ..core.styles import TokenRole


def replace_input(args, kwargs, leaf: int, replace, missing: str):
    """(args, kwargs) of a call with their flattened input `leaf` replaced by replace(it);
    RuntimeError(missing) when the call has no tensor there."""
    return _replace_leaf((tuple(args), dict(kwargs)), leaf, replace, missing)


def _replace_leaf(tree, leaf: int, replace, missing: str):
    leaves, spec = tree_flatten(tree)
    if leaf >= len(leaves) or not isinstance(leaves[leaf], torch.Tensor):
        raise RuntimeError(missing)
    leaves[leaf] = replace(leaves[leaf])
    return tree_unflatten(leaves, spec)


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
    """In place of a row layer's all-reduce: the sum over the group of this rank's tokens. It
    ends the tensor-parallel region and starts one of this rank's tokens, where a layer in
    `training` draws its own dropout masks (see region_generators)."""

    def __call__(self, y: torch.Tensor, training: bool) -> torch.Tensor:
        self._record(y)
        tokens = ops.reduce_scatter_to_sequence(y, self.dim, self.shards.group_name)
        return region_generators.leave_and_enter(tokens, self.shards.group_name, training)


class SliceTokens(_Step):
    """A tensor held whole cut to this rank's tokens (its gradient gathered back whole), which
    starts a region of this rank's tokens."""

    def __call__(self, y: torch.Tensor, training: bool) -> torch.Tensor:
        self._record(y)
        tokens = ops.scatter_to_parallel(y, self.dim, self.shards.group_name)
        return region_generators.enter(tokens, self.shards.group_name, training)


class GatherTokens(_Step):
    """In place of a column layer's input copy: every rank's tokens, in order (its gradient
    summed over the group, this rank keeping its tokens' piece)."""

    def __init__(self, shards: SequenceShards, dim: int):
        super().__init__(shards, dim)
        # Column layers reading these tokens whose weight gradients backward computes while the
        # gradient is reduce-scattered (see backward_overlap); empty: no overlap.
        self.overlap_readers: list = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards.length is None:
            raise RuntimeError("GatherTokens: no layer has split this region's tokens yet in this forward; the plan's "
                               "sequence region does not match the model's call order")
        tokens = (self.dim, self.shards.length)
        return region_generators.leave(backward_overlap.copy(x, self.shards.group_name, self.overlap_readers, tokens))


def scale_exit_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`x`, its gradient multiplied by `factor`; on meta tensors (the dry run, which compares the
    forward's ops with the plan's, and runs no backward) `x` itself."""
    return x if x.is_meta else ExitGradientScale.apply(x, factor)


class ExitGradientScale(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class PlanSteps:
    """The steps of a plan's sequence regions, one SequenceShards per region; `gathers` maps
    each column layers' copy group that gathers tokens to its GatherTokens."""

    def __init__(self, plan, group_name: str):
        self.shards = {}
        self.gathers = {}
        # (module, its GatherTokens, whether it gathers what the module returns) of the gathers
        # made where a module receives or returns a tensor (sequence_gathers, sequence_exits).
        self.module_gathers = []
        self._group_name = group_name
        self._world_size = plan.world_size
        entry_gathers = [entry.module for entry in plan.sequence_gathers]
        for layer in plan.layers:
            if layer.sequence is TokenRole.GATHER and layer.copy_group not in self.gathers:
                self.gathers[layer.copy_group] = GatherTokens(self._region(layer.sequence_region), layer.sequence_dim)
            elif layer.sequence is TokenRole.GATHERED:
                # Gathered where a module receiving them is called, or else where one returns them;
                # in the latter case the gradient is multiplied by the group's size, against the
                # exit's division (see the module docstring).
                inside = any(layer.module.startswith(module + ".") or not module for module in entry_gathers)
                self.gathers[layer.copy_group] = already_gathered if inside or not plan.sequence_exits \
                    else functools.partial(scale_exit_gradient, factor=float(plan.world_size))

    def _region(self, region: int) -> SequenceShards:
        return self.shards.setdefault(region, SequenceShards(self._group_name, region))

    def reduce_scatter(self, layer) -> ReduceScatterTokens:
        return ReduceScatterTokens(self._region(layer.sequence_region), layer.sequence_dim)

    def entry_hook(self, entry: dict, gather: bool = False):
        """A forward pre-hook cutting the module's input leaf `entry.leaf` to this rank's
        tokens, or with `gather` gathering every rank's tokens of it."""
        step = (GatherTokens if gather else SliceTokens)(self._region(entry.region), entry.dim)
        if gather:
            self.module_gathers.append((entry.module, step, False))
        leaf = entry.leaf

        def hook(module, args, kwargs):
            cut = step if gather else (lambda tokens: step(tokens, module.training))
            return replace_input(args, kwargs, leaf, cut,
                                 f"sequence parallelism: {entry.module!r} was called without the tensor the plan "
                                 f"cuts to this rank's tokens (input {leaf})")

        return hook

    def exit_hook(self, entry: dict):
        """A forward hook gathering every rank's tokens of the module's output leaf
        `entry.leaf`, for column layers reading them through ops that index the tokens."""
        step = GatherTokens(self._region(entry.region), entry.dim)
        self.module_gathers.append((entry.module, step, True))
        leaf = entry.leaf

        def hook(module, args, output):
            return _replace_leaf(output, leaf, lambda tokens: scale_exit_gradient(step(tokens), 1.0 / self._world_size),
                                 f"sequence parallelism: {entry.module!r} returned no tensor where the plan gathers "
                                 f"its tokens (output {leaf})")

        return hook


def already_gathered(x: torch.Tensor) -> torch.Tensor:
    """A column layer's input copy where the module holding the layer gathered the tokens."""
    return x


steps = PlanSteps
