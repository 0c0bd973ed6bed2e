"""Sharded layers: each computes what its unsharded counterpart computes."""

from .einsum import EinsumDense, ShardedEinsumDense
from .embedding import VocabParallelEmbedding
from .spec import ShardSpec

__all__ = ["EinsumDense", "ShardSpec", "ShardedEinsumDense", "VocabParallelEmbedding"]
