"""What autoshard knows of torch's data-parallel wrappers (DDP, FSDP's
``FullyShardedDataParallel`` and ``fully_shard``): which ranks one communicates over, and
why one laid over the tensor-parallel ranks of a parallelized model is refused.

A parallelized model's sharded parameter is a plain tensor that keeps the unsharded model's
name, and each rank of a tensor-parallel group holds a different shard of it. The wrappers,
and the Trainer and accelerate, which wrap the model in one of them under torchrun, take the
ranks' tensors of one name for copies of one tensor: DDP's construction broadcasts rank 0's
shards over the others' and averages different shards' gradients, FSDP splits each rank's
shard as if it were whole. Training goes on and is silently wrong. A wrapper is legitimate
only over ranks that each hold the same tensor-parallel rank of a different replica: the "dp"
dimension of a ("dp", "tp") DeviceMesh. There DDP and FSDP2 (fully_shard, see fully_sharded)
are exact; FSDP1's flat parameters are refused.
"""

from typing import Iterable, List, Optional, Set, Tuple

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

DDP = "DistributedDataParallel"
FULLY_SHARD = "fully_shard"

_ALTERNATIVE = ("Wrap the model over its data-parallel group only, whose ranks each hold the same tensor-parallel "
                "rank of a different replica: the 'dp' dimension of a ('dp', 'tp') DeviceMesh, as in {how}. Or leave "
                "data parallelism to autoshard: parallelize(model, mesh=mesh) with a ('dp', 'tp') DeviceMesh, and no "
                "wrapper. transformers.Trainer and accelerate wrap the model in DistributedDataParallel or FSDP over "
                "every process when started by torchrun: with the Trainer, use autoshard.integrations.Trainer in its "
                "place (from autoshard.integrations import Trainer), which trains a parallelized model without a "
                "wrapper")
_FULLY_SHARD_HOW = "parallelize(model, mesh=mesh['tp']), then fully_shard(module, mesh=mesh['dp'])"
_HOW = {DDP: "DistributedDataParallel(model, process_group=mesh.get_group('dp'))",
        # FSDP1 is refused over the data-parallel ranks too (fsdp_refusal): FSDP2 is the one to name.
        "FullyShardedDataParallel": _FULLY_SHARD_HOW,
        FULLY_SHARD: _FULLY_SHARD_HOW}
_FSDP_WHY = ("FSDP takes each rank's shard of a parameter for the whole parameter and splits it again, so that its "
             "all-gather mixes different shards")
_WHY = {DDP: "DDP takes the ranks' different shards of a parameter for copies of one tensor: it broadcasts rank 0's "
             "shards over the others' and averages different shards' gradients",
        "FullyShardedDataParallel": _FSDP_WHY,
        FULLY_SHARD: _FSDP_WHY}

def wrapper_types() -> Tuple[type, type, type]:
    """(DistributedDataParallel, FullyShardedDataParallel, FSDPModule)."""
    return DistributedDataParallel, FullyShardedDataParallel, FSDPModule


def ranks_of(groups: Iterable) -> Set[int]:
    """The global ranks of the process groups (None entries left out), together."""
    ranks: Set[int] = set()
    for group in groups:
        if group is not None:
            ranks.update(dist.get_process_group_ranks(group))
    return ranks


def fully_shard_groups(module) -> List:
    """The process groups over which fully_shard communicates for `module` (None entries left out)."""
    groups = []
    try:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
    except (AttributeError, AssertionError):
        param_groups = []
    for param_group in param_groups:
        info = param_group.mesh_info
        groups += [getattr(info, "shard_process_group", None), getattr(info, "replicate_process_group", None)]
    return [group for group in groups if group is not None]


def describe(module) -> Optional[Tuple[str, Set[int]]]:
    """(the tool's name, the ranks it communicates over) for a data-parallel wrapper, else None."""
    ddp, fsdp1, fsdp2 = wrapper_types()
    if isinstance(module, ddp):
        return DDP, ranks_of([module.process_group])
    if isinstance(module, fsdp1):
        return "FullyShardedDataParallel", ranks_of([module.process_group, getattr(module, "_inter_node_pg", None)])
    if isinstance(module, fsdp2):
        return FULLY_SHARD, ranks_of(fully_shard_groups(module))
    return None


def spans_tensor_parallel(wrapper_ranks: Set[int], tp_ranks: Iterable[int]) -> bool:
    return len(wrapper_ranks & set(tp_ranks)) > 1


def refusal(tool: str, wrapper_ranks: Set[int], tp_ranks: Iterable[int], when: str) -> ValueError:
    """The error for `tool` over `wrapper_ranks`, two or more of which are in `tp_ranks`."""
    tp_ranks = list(tp_ranks)
    shared = sorted(wrapper_ranks & set(tp_ranks))
    return ValueError(f"autoshard: {tool} spans ranks {sorted(wrapper_ranks)}, which hold {len(shared)} ranks "
                      f"{shared} of the tensor-parallel group {tp_ranks} of a parallelized model. {_WHY[tool]}; "
                      f"{when}. {_ALTERNATIVE.format(how=_HOW[tool])}")


def fsdp_refusal(tool: str, wrapper_ranks: Set[int]) -> ValueError:
    """The error for FSDP1 (FullyShardedDataParallel) over data-parallel ranks only: its flat
    parameters hide the shards from the sums over the tensor-parallel group of replicated
    parameters' partial gradients (norm weights with sequence parallelism), from clipping,
    autoshard's optimizers and full_state_dict. FSDP2 (fully_shard) is exact (fully_sharded)."""
    return ValueError(f"autoshard: {tool} over ranks {sorted(wrapper_ranks)} of a parallelized model is not supported: "
                      "its flat parameters hide the shards from the sums of partial gradients over the "
                      "tensor-parallel group, gradient clipping, autoshard.optim and full_state_dict, and training "
                      f"would be silently wrong. Use FSDP2 instead: {_FULLY_SHARD_HOW}; or parallelize(model, "
                      "mesh=mesh) with a ('dp', 'tp') DeviceMesh (gradients averaged over dp, optimizer state "
                      "partitioned over dp), or DistributedDataParallel(model, process_group=mesh.get_group('dp')).")


def already_averaged(wrapper: str, ranks, instead: str) -> ValueError:
    """The error for a data-parallel wrapper over a model whose mesh path averages over "dp" itself."""
    return ValueError(f"autoshard: {wrapper} over ranks {sorted(ranks)} wraps a model that parallelize already "
                      "averages over the 'dp' dimension of its mesh (parallelize(model, mesh=mesh)): its gradients "
                      f"would be averaged twice and the pieces of its partitioned optimizer state mixed. {instead}")
