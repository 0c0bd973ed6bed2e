"""How the ranks of a parallelized model are laid out, and the accelerate ``Accelerator`` of a
Trainer adapted to it.

Under torchrun, accelerate takes every process for a data-parallel replica: it wraps the model
in DistributedDataParallel over all of them, gives each its own batches, clips each rank's
gradients by each rank's own norm and gathers each rank's evaluation results. For a
parallelized model the replicas are the tensor-parallel groups, not the ranks. ``adapt``
changes one Accelerator (its instance, nothing process-wide) so that:

- the model is prepared as accelerate prepares it (device, autocast, torch.compile) but never
  wrapped: tensor parallelism is autoshard's, and on a ("dp", "tp") mesh autoshard averages
  the gradients over "dp" itself;
- its data loaders shard the data by data-parallel replica, as accelerate's own tensor
  parallelism does (a device mesh with a "tp" dimension: every rank of one tensor-parallel
  group gets the same batches);
- ``clip_grad_norm_`` clips by the global norm (``autoshard.clip_grad_norm_``);
- ``gather_for_metrics`` gathers one copy per replica, so that evaluation counts each sample once.
"""

import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.clip import clip_grad_norm_
from ..core.parallel_state import state_of
from torch.distributed.device_mesh import DeviceMesh

_NAME = "autoshard.integrations.Trainer"


@dataclass(frozen=True)
class Layout:
    """The world as (dp, tp): rank = dp_rank * tp_size + tp_rank, as accelerate orders a mesh."""

    tp_group: object
    dp_group: Optional[object]  # autoshard's "dp" group (the mesh path), None for tp alone
    tp_size: int
    dp_size: int
    rank: int


def layout_of(model: torch.nn.Module) -> Optional[Layout]:
    """The layout of a parallelized `model` over the world; None for a model parallelize did not
    split over two or more ranks (the Trainer then runs as transformers'). Raises where the
    Trainer could not give every tensor-parallel group its own data-parallel share."""
    state = state_of(model)
    if state is None or state.group is None or not dist.is_initialized() or state.group.size() < 2:
        return None
    tp_ranks = dist.get_process_group_ranks(state.group)
    dp_group = state.data_parallel_group
    tp, dp = len(tp_ranks), (dp_group.size() if dp_group is not None else 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp * dp != world:
        raise ValueError(
            f"{_NAME}: the model is tensor-parallel over {tp} ranks {tp_ranks}"
            + (f" with {dp} data-parallel replicas" if dp > 1 else " and has no data-parallel group")
            + f", but torchrun started {world} processes. parallelize(model) over every rank, or give parallelize "
            "a ('dp', 'tp') DeviceMesh of the whole world (parallelize(model, mesh=mesh)): autoshard then averages "
            "the gradients over 'dp' and the Trainer gives each 'dp' replica its own batches")
    first = rank - rank % tp
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else [rank]
    if tp_ranks != list(range(first, first + tp)) or dp_ranks != list(range(rank % tp, world, tp)):
        raise ValueError(
            f"{_NAME}: rank {rank}'s tensor-parallel group is {tp_ranks} and its data-parallel group {dp_ranks}; "
            "the Trainer's data loaders give each run of consecutive ranks one replica's batches, so the "
            "tensor-parallel ranks must be consecutive: build the mesh as init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))")
    return Layout(state.group, dp_group, tp, dp, rank)


def data_mesh(layout: Layout):
    """A device mesh over the existing groups whose dimensions accelerate's data loaders read:
    "tp" (ranks that get the same batches) and "dp_replicate" (ranks that get different ones)."""
    world = layout.tp_size * layout.dp_size
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
    if layout.dp_group is None:
        return DeviceMesh.from_group(layout.tp_group, device, mesh=torch.arange(world), mesh_dim_names=("tp",))
    return DeviceMesh.from_group([layout.dp_group, layout.tp_group], device,
                                 mesh=torch.arange(world).view(layout.dp_size, layout.tp_size),
                                 mesh_dim_names=("dp_replicate", "tp"))


def _gather_for_metrics(accelerator, layout: Layout):
    """accelerate's gather_for_metrics, with one copy per replica: the world's data gathered,
    keeping the ranks of tensor-parallel rank 0 (every rank of a tensor-parallel group holds the
    same results)."""
    from accelerate.utils import recursively_apply  # noqa: PLC0415  (accelerate is optional)

    def gather_for_metrics(input_data, use_gather_object=False):
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        data, world = input_data, dist.get_world_size()
        if layout.dp_size > 1 and use_gather_object:
            every = [None] * world
            dist.all_gather_object(every, input_data)
            kept = every[::layout.tp_size]
            data = [item for part in kept for item in part] if all(isinstance(p, list) for p in kept) else kept
        elif layout.dp_size > 1:
            # accelerate's gather concatenates the ranks' equal-sized pieces in rank order
            data = recursively_apply(lambda t: torch.cat(t.chunk(world)[::layout.tp_size]), accelerator.gather(data))
        state = accelerator.gradient_state
        # As accelerate does: the last batches were padded to make the replicas even; drop the padding.
        if state.end_of_dataloader and state.remainder > 0:
            if use_gather_object:
                return data[:state.remainder]
            return recursively_apply(lambda t: t[:state.remainder], data)
        return data

    return gather_for_metrics


def adapt(accelerator, model: torch.nn.Module, layout: Layout) -> None:
    """Adapts `accelerator` (this instance only) to the parallelized `model` (see the module's docstring)."""
    prepare_model, mesh = accelerator.prepare_model, data_mesh(layout)

    def prepare_model_unwrapped(self, module, device_placement=None, evaluation_mode=False):
        # evaluation_mode leaves out only the data-parallel wrapper (DDP, FSDP).
        return prepare_model(module, device_placement=device_placement,
                             evaluation_mode=evaluation_mode or module is model)

    def clip(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    accelerator.prepare_model = types.MethodType(prepare_model_unwrapped, accelerator)
    accelerator._prepare_device_mesh = lambda: mesh
    accelerator.clip_grad_norm_ = types.MethodType(clip, accelerator)
    accelerator.gather_for_metrics = _gather_for_metrics(accelerator, layout)
