"""autoshard: tensor parallelism for PyTorch, as C++/CUDA custom ops."""

from . import comm, nn, ops
from .comm import CommCounter
from .distributed import init_distributed
from .split import array_split, shard, split_sizes

__all__ = ["CommCounter", "array_split", "comm", "init_distributed", "nn", "ops", "shard", "split_sizes"]
__version__ = "0.1.0"
