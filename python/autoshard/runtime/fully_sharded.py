"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the data-parallel ranks of a parallelized
model: the 2-D layout torch recommends, tensor parallelism inside a replica and FSDP across.

Each rank's tensor-parallel shard is, for FSDP, a whole parameter: the ranks of its group (the
"dp" dimension of a ("dp", "tp") DeviceMesh) hold the same tensor-parallel rank, so FSDP splits,
all-gathers and reduce-scatters copies of one tensor, as it does for any model. What autoshard
must carry over, once, at the first forward that finds the wrapping:

- the sums over the tensor-parallel group of replicated parameters' partial gradients (norm
  weights read between a sequence-split reduce-scatter and the next all-gather). fully_shard
  replaced the parameters on which parallelize hooked them. The sum is taken here on the
  gradient FSDP's own unsharded parameter receives, before autograd accumulates it, so before
  FSDP reduce-scatters it: sum over "tp" and FSDP's average over "dp" are both linear and
  commute, each contribution is summed once, and accumulation over several backward passes
  (FSDP's ``set_requires_gradient_sync(False)`` included) stays exact.
- the parameters' link to the model's state, so that clip_grad_norm_, autoshard.optim and
  full_state_dict know FSDP's DTensors for the shards they split (see ``local_tensor`` and
  ``whole_over_data_parallel``).

Refused here: fully_shard around a model that parallelize already averages over "dp"
(``parallelize(model, mesh=mesh)``): its gradients would be averaged twice. And an FSDP group
whose ranks hold different tensor-parallel ranks: it would take different shards for copies.
"""

from typing import List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn

from ..core import ops
from ..conventions.data_parallel_wrappers import already_averaged
from ..core.parallel_state import ParallelState

__all__ = ["adopt", "fsdp_group_of", "is_dtensor", "local_tensor", "whole_over_data_parallel"]

_SUMMED = "_autoshard_tensor_parallel_sum"  # on a tensor whose gradients are hooked here


def is_dtensor(t) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: FSDP's piece of a DTensor (its data, in place), else `t`."""
    return t._local_tensor if is_dtensor(t) else t


def whole_over_data_parallel(t: torch.Tensor) -> torch.Tensor:
    """`t` all-gathered over FSDP's ranks (this rank's tensor-parallel shard, or the replicated
    tensor, whole); `t` itself when it is no DTensor. A collective over FSDP's group."""
    return t.detach().full_tensor() if is_dtensor(t) else t.detach()


def fsdp_group_of(t: torch.Tensor):
    """The process group over which the DTensor `t` is split (FSDP's shard dimension; None when
    replicated over its mesh)."""
    mesh = t.device_mesh
    dims = [dim for dim, placement in enumerate(t.placements) if placement.is_shard()]
    if len(dims) > 1:
        raise ValueError(f"autoshard: a DTensor split over {len(dims)} mesh dimensions {mesh.mesh_dim_names}; "
                         "fully_shard over the 'dp' dimension alone splits each parameter over one")
    return mesh.get_group(dims[0]) if dims else None


def _already_averaged(ranks: Set[int]) -> ValueError:
    return already_averaged("fully_shard", ranks, "Parallelize over the tensor-parallel dimension alone, "
                            "parallelize(model, mesh=mesh['tp']), then fully_shard(..., mesh=mesh['dp']); or keep "
                            "parallelize(model, mesh=mesh) without fully_shard")


def _check_same_tensor_parallel_rank(ranks: Set[int], state: ParallelState, fsdp_group) -> None:
    """Every rank of FSDP's group must hold the same tensor-parallel rank (a collective over it)."""
    mine = torch.tensor([state.group.rank()], dtype=torch.int64)
    theirs = [torch.zeros_like(mine) for _ in range(fsdp_group.size())]
    dist.all_gather(theirs, mine, group=fsdp_group)
    held = sorted({int(t) for t in theirs})
    if len(held) > 1:
        raise ValueError(f"autoshard: fully_shard over ranks {sorted(ranks)}, which hold tensor-parallel ranks {held} "
                         "of a parallelized model: FSDP would take their different shards for copies of one tensor. "
                         "Shard over the 'dp' dimension of a ('dp', 'tp') DeviceMesh, fully_shard(..., "
                         "mesh=mesh['dp']), whose ranks each hold the same tensor-parallel rank")


class TensorParallelGradientSums:
    """Sums over the tensor-parallel group the gradient each listed parameter receives, where
    the parameter is the one its module computes with: FSDP's unsharded parameter, which FSDP
    creates at its first all-gather and keeps. A forward pre-hook on the owning module (run
    after FSDP has unsharded it) hooks that tensor once."""

    def __init__(self, model: nn.Module, names: List[str], group_name: str,
                 reduce_dtype: Optional[torch.dtype]) -> None:
        self.group_name = group_name
        self.reduce_dtype = reduce_dtype
        self.handles = []
        for name in names:
            owner, _, attr = name.rpartition(".")
            self.handles.append(model.get_submodule(owner).register_forward_pre_hook(self._hook_parameter(attr)))

    def _hook_parameter(self, attr: str):
        def pre_hook(module: nn.Module, args) -> None:
            param = module._parameters.get(attr)
            if param is None or not param.requires_grad or is_dtensor(param) or param.__dict__.get(_SUMMED) is self:
                return
            param.__dict__[_SUMMED] = self
            self.handles.append(param.register_hook(self._summed))

        return pre_hook

    def _summed(self, grad: torch.Tensor) -> torch.Tensor:
        # The contribution of this pass, before it is accumulated: every rank adds the same sum.
        summed = grad if self.reduce_dtype is None else grad.to(self.reduce_dtype)
        return ops.reduce_from_parallel(summed.contiguous(), self.group_name).to(grad.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def adopt(model: nn.Module, state: ParallelState, ranks: Set[int], fsdp_groups: List) -> None:
    """At the first forward under fully_shard over data-parallel ranks `ranks` (FSDP's process
    groups `fsdp_groups`): refuses what cannot be exact, else moves the partial-gradient sums onto
    FSDP's parameters and points the new parameters at the model's state."""
    if getattr(state, "fully_sharded_over", None) is not None:
        return
    if state.data_parallel_group is not None:
        raise _already_averaged(ranks)
    for group in fsdp_groups:
        _check_same_tensor_parallel_rank(ranks, state, group)
    reducer = state.partial_gradients
    if reducer is not None:
        # parallelize hooked the parameters fully_shard replaced: their names, before the swap,
        # are the names of FSDP's parameters now.
        names = reducer.names
        reducer.remove()
        state.partial_gradients = None
        if names:
            state.fsdp_gradient_sums = TensorParallelGradientSums(model, names, state.group.group_name,
                                                                  reducer.reduce_dtype)
    state.attach()  # FSDP's DTensor parameters point back at the state, as parallelize's did
    state.fully_sharded_over = sorted(ranks)
