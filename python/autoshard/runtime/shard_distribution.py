"""A shard handed to torch.distributed's own sharding over its own tensor-parallel ranks.

``DTensor.from_local``, ``distribute_tensor`` and FSDP2's ``fully_shard`` take the tensor each
rank gives them for what that rank holds of one tensor laid over a device mesh: the same tensor
on every rank of a dimension placed ``Replicate()`` (``from_local``), the whole tensor to split
(``distribute_tensor``), a whole parameter to split over FSDP's ranks (``fully_shard``). Given a
sharded parameter over a mesh dimension, or FSDP group, that holds two or more ranks of the
shard's own tensor-parallel group, each rank's piece is taken for the whole: labelled a copy of
the others' different pieces, or split again and all-gathered with them (gloo aborts the process
where the pieces differ in size). accelerate does both: its
FSDP2 plugin applies ``fully_shard`` over every process, or over ``ParallelismConfig``'s
dp_shard ranks, and with ``ParallelismConfig(tp_size=...)`` it labels each parameter that is no
DTensor ``DTensor.from_local(p, mesh["tp"], [Replicate()])``. A DTensor cannot describe
autoshard's layouts in general (numpy's uneven split, fused q/k/v parts, whole heads), so any
placement over those ranks is refused, not only ``Replicate()``.

The shard guard hands ``check`` every op torch.distributed runs on a ``ShardParameter``. In the
three functions the first such op (reading the tensor's device, or ``is_leaf``) comes before any
collective and before the tool has replaced any parameter (``fully_shard`` has only registered
itself on the module), and ``check`` raises there. Over ranks that each hold the same
tensor-parallel rank of a different replica (the "dp" dimension of a ("dp", "tp") mesh) the three
are legitimate: FSDP2 over "dp" is exact (fully_sharded), and they run.
"""

from typing import Callable, Optional, Tuple

import torch

from ..conventions.data_parallel_wrappers import FULLY_SHARD, ranks_of, refusal, spans_tensor_parallel
from ..core.parallel_state import parameter_state

# (module, function) whose first op on a shard is checked.
_FROM_LOCAL = ("torch.distributed.tensor._api", "from_local")
_DISTRIBUTE = ("torch.distributed.tensor._api", "distribute_tensor")
_FSDP_MOVE = ("torch.distributed.fsdp._fully_shard._fsdp_init", "_move_states_to_device")
_WATCHED = frozenset({_FROM_LOCAL, _DISTRIBUTE, _FSDP_MOVE})
_NAMES = frozenset(function for _, function in _WATCHED)
_FRAMES_TO_FULLY_SHARD = 4  # _move_states_to_device <- _get_modules_and_states <- fully_shard

# What to use instead where accelerate asked (its FSDP2 plugin, its ParallelismConfig).
_ACCELERATE = (
    " With accelerate's FSDP2 plugin, give the Accelerator a ParallelismConfig(dp_shard_size=..., tp_size=...) and "
    "parallelize the model over its 'tp' dimension before accelerator.prepare, "
    "autoshard.parallelize(model, mesh=accelerator.torch_device_mesh['tp']): FSDP2 then shards over dp_shard, whose "
    "ranks each hold the same tensor-parallel rank. Or use autoshard.integrations.Trainer in place of "
    "transformers.Trainer, or, without accelerate's FSDP plugin, autoshard's own FSDP2 over 'dp': "
    "parallelize(model, mesh=mesh, fully_shard=True) with a ('dp', 'tp') DeviceMesh")
_ACCELERATE_FULLY_SHARD = ". accelerate applied fully_shard here, over every process or over its dp_shard ranks."
_ACCELERATE_REPLICATE = (" accelerate's ParallelismConfig(tp_size=...) labels so every parameter that is not a DTensor "
                         "once some parameter of the model is one (fully_shard applied before accelerator.prepare).")


def _asking_package(frame) -> str:
    """The package of the first caller above torch and autoshard: the tool that asked."""
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package not in ("torch", "autoshard"):
            return package
        frame = frame.f_back
    return ""


def _fully_shard_frame(frame):
    for _ in range(_FRAMES_TO_FULLY_SHARD):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "fully_shard" and "mesh_info" in frame.f_locals:
            return frame
    return None


def check(frame, find_shard: Callable[[], Optional[Tuple[torch.Tensor, str, str]]], read_error: type) -> None:
    """Raises where `frame`, torch.distributed's code running an op, lays a sharded parameter
    among its arguments (`find_shard()`: the parameter, its name and its split, or None) over two
    or more ranks of its own tensor-parallel group; `read_error` is the shard guard's error."""
    if frame is None or frame.f_code.co_name not in _NAMES:
        return
    where = (frame.f_globals.get("__name__", ""), frame.f_code.co_name)
    if where not in _WATCHED:
        return
    found = find_shard()
    state = None if found is None else parameter_state(found[0])
    if state is None or state.group is None:
        return
    _, name, split = found
    tp_ranks = ranks_of([state.group])
    accelerate = _asking_package(frame) == "accelerate"
    if where == _FSDP_MOVE:
        caller = _fully_shard_frame(frame)
        if caller is None:
            return
        info = caller.f_locals["mesh_info"]
        fsdp_ranks = ranks_of([getattr(info, "shard_process_group", None),
                               getattr(info, "replicate_process_group", None)])
        if spans_tensor_parallel(fsdp_ranks, tp_ranks):
            error = refusal(FULLY_SHARD, fsdp_ranks, sorted(tp_ranks),
                            f"it was refused in fully_shard, at {name}, before FSDP replaced any parameter")
            raise ValueError(str(error) + (_ACCELERATE_FULLY_SHARD + _ACCELERATE if accelerate else ""))
        return
    mesh, placements = frame.f_locals.get("device_mesh"), frame.f_locals.get("placements")
    if mesh is None:
        return
    for dim in range(mesh.ndim):
        group_ranks = ranks_of([mesh.get_group(dim)])
        if not spans_tensor_parallel(group_ranks, tp_ranks):
            continue
        placement = "Replicate()" if placements is None else repr(list(placements)[dim])
        function = "DTensor.from_local" if where == _FROM_LOCAL else "distribute_tensor"
        dim_name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else dim
        raise read_error(
            f"autoshard: {function} of {name}, which holds this rank's shard ({split}), with placement {placement} "
            f"over mesh dimension {dim_name!r} (ranks {sorted(group_ranks)}), which holds "
            f"{len(group_ranks & tp_ranks)} ranks of its tensor-parallel group {sorted(tp_ranks)}: each rank's piece "
            "would be taken for the whole tensor (the same tensor on every rank, or a whole one to split). autoshard's "
            "shards are not DTensors; a DTensor over the data-parallel ranks only (the 'dp' dimension of a ('dp', "
            "'tp') mesh) is legitimate. To describe this rank's piece knowingly, autoshard.local(tensor)."
            + (_ACCELERATE_REPLICATE + _ACCELERATE if accelerate else ""))
