"""autoshard: tensor parallelism for PyTorch, as C++/CUDA custom ops."""

from . import ops, optim
from .split import array_split, shard, split_sizes

__all__ = ["array_split", "ops", "optim", "shard", "split_sizes"]
__version__ = "0.1.0"
