"""``parallelize(model, mesh=mesh, fully_shard=True)``: the mesh path with parameters, gradients
and optimizer state sharded over "dp" by torch's FSDP2, as a user would write it by hand
(``parallelize(model, mesh=mesh["tp"])``, then ``fully_shard`` over ``mesh["dp"]`` for each
block and the root; fully_sharded says why that is exact).

Each rank then holds 1/(dp*tp) of every tensor-parallel shard and 1/dp of every replicated
parameter, with their AdamW state: what FSDP2 with torch's DTensor tensor parallelism holds. The
default mesh path keeps every tensor-parallel shard whole on each replica (1/tp of the model),
partitioning only the replicated parameters' optimizer state over "dp".
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .fully_sharded import adopt
from ..core.parallel_state import state_of
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _blocks(model: nn.Module) -> List[nn.Module]:
    """The entries of the model's outermost ModuleLists (a transformer's repeated blocks): each
    becomes one FSDP unit, all-gathered just before it runs and freed after."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    inner = {id(sub) for m in lists for sub in m.modules() if sub is not m}
    return [block for m in lists if id(m) not in inner for block in m]


def check_keyword(value, mesh, names) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"parallelize: fully_shard must be a bool, got {type(value).__name__}")
    if value and (mesh is None or "dp" not in names):
        raise ValueError("parallelize: fully_shard=True shards over the 'dp' dimension of a ('dp', 'tp') DeviceMesh; "
                         "give mesh= with both dimensions")


def apply(model: nn.Module, dp_mesh, reduce_dtype: Optional[torch.dtype]) -> None:
    """fully_shard over `dp_mesh` for every block, then the root; the model adopted at once."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in _blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    group = dp_mesh.get_group()
    adopt(model, state_of(model), set(dist.get_process_group_ranks(group)), [group])
