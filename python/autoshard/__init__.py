"""autoshard: tensor parallelism for PyTorch, as C++/CUDA custom ops."""

from . import checkpoint, nn, optim
from .core import comm, ops
from .runtime.clip import clip_grad_norm_
from .core.comm import CommCounter
from .core.distributed import init_distributed
from .runtime.loss_parallel import gather_logits
from .runtime.saved_tensors import SavedTensorCounter
from .parallelize import parallelize
from .runtime import torch_patches  # noqa: F401  (reroutes torch while a parallelized model lives)
from .planner.sharding_plan import ShardingPlan
from .planner.api import plan
from .pretrained import load_pretrained
from .runtime.shard_guard import ShardReadError, local
from .core.split import array_split, shard, split_sizes
from .state.unsharded import full_state_dict

__all__ = [
    "CommCounter",
    "SavedTensorCounter",
    "ShardReadError",
    "ShardingPlan",
    "array_split",
    "checkpoint",
    "clip_grad_norm_",
    "comm",
    "full_state_dict",
    "gather_logits",
    "init_distributed",
    "load_pretrained",
    "local",
    "nn",
    "ops",
    "optim",
    "parallelize",
    "plan",
    "shard",
    "split_sizes",
]
__version__ = "0.1.0"
