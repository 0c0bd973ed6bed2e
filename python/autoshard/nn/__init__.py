"""Sharded layers: each computes what its unsharded counterpart computes."""

from .spec import ShardSpec

__all__ = ["ShardSpec"]
