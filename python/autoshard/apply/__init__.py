"""Applying a plan to a model: modules swapped for their sharded constructs, the hooks that would be lost checked."""
