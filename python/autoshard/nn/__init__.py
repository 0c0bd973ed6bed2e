"""Sharded layers: each computes what its unsharded counterpart computes."""

from . import functional
from .einsum import EinsumDense, ShardedEinsumDense
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from ..core.spec import ShardSpec

__all__ = [
    "ColumnParallelLinear",
    "EinsumDense",
    "RowParallelLinear",
    "ShardSpec",
    "ShardedEinsumDense",
    "VocabParallelEmbedding",
    "functional",
]
