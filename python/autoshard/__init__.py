"""autoshard: tensor parallelism for PyTorch, as C++/CUDA custom ops."""

from . import ops
from .split import array_split, shard, split_sizes

__all__ = ["array_split", "ops", "shard", "split_sizes"]
__version__ = "0.1.0"
