"""autoshard: tensor parallelism for PyTorch, as C++/CUDA custom ops."""

from . import checkpoint, comm, nn, ops, optim
from .clip import clip_grad_norm_
from .grad_scaler_agreement import install as _agree_on_grad_scaler_infs
from .torch_clip import install as _route_torch_clipping
from .comm import CommCounter
from .distributed import init_distributed
from .loss_parallel import gather_logits
from .memory import SavedTensorCounter
from .parallelize import parallelize
from .plan import ShardingPlan, plan
from .pretrained import load_pretrained
from .shard_guard import ShardReadError, local
from .split import array_split, shard, split_sizes
from .unsharded import full_state_dict

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

# torch.nn.utils.clip_grad_norm_ over a parallelized model's gradients: the global norm.
_route_torch_clipping()
# torch.amp.GradScaler over a parallelized model's optimizer: the ranks agree on found_inf.
_agree_on_grad_scaler_infs()
