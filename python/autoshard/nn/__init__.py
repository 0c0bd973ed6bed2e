"""Sharded layers: each computes what its unsharded counterpart computes."""

from .linear import ColumnParallelLinear, RowParallelLinear
from .spec import ShardSpec

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardSpec"]
