"""The input copies of column layers: the copy_to_parallel (or, with sequence parallelism, the
gather of the tokens) before a column layer's matmul, whose backward sums the input's gradient
over the ranks. The plan gives each tensor read by column layers one copy group, and counts one
backward all-reduce per group; these classes make the layers share the copy as the plan says.
"""

import weakref
from typing import Callable, List, Optional

import torch

from . import backward_overlap
from ..core import ops


class SharedInputCopy:
    """One copy_to_parallel (or, with sequence parallelism, one gather of the tokens) for
    several column layers that read the same tensor in a row."""

    def __init__(self, group_name: str, users: int, enter=None):
        self.group_name = group_name
        self.users = users
        self.enter = enter
        self._source = None
        self._copy = None
        self._served = 0
        # Column layers reading this copy whose weight gradients backward computes while the
        # input gradient is all-reduced (see backward_overlap); empty: no overlap.
        self.overlap_readers: list = []

    def serves(self, x: torch.Tensor) -> bool:
        """Whether this copy is of `x` and has readers of it still to serve."""
        return self._source is not None and self._source() is x and self._served < self.users

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.serves(x):
            self._served += 1
            copy = self._copy
        else:
            copy = self.enter(x) if self.enter is not None else \
                backward_overlap.copy(x, self.group_name, self.overlap_readers)
            self._source, self._copy, self._served = weakref.ref(x), copy, 1
        if self._served == self.users:
            self._source = self._copy = None  # hold no activation beyond its last reader
        return copy


class InputCopyPerCall:
    """The input copy of a layer called more than once, its calls in different copy groups (a
    projection used for self-attention on the decoder's tokens and for cross-attention on the
    encoder's output). Each call takes its own group's copy, so that a tensor that the calls of
    several layers read (the encoder's output, read by every decoder layer) is copied, and its
    gradient summed, once, as the plan counts. A copy already serving the tensor is taken first;
    otherwise the calls take their groups in the order the plan recorded them."""

    def __init__(self, group_name: str, per_call: List[Optional[Callable]]):
        self.group_name = group_name
        self.per_call = per_call  # one per recorded call; None: a copy of its own
        self._calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        serving = [c for c in self.per_call if isinstance(c, SharedInputCopy) and c.serves(x)]
        chosen = serving[0] if serving else self.per_call[self._calls % len(self.per_call)]
        self._calls += 1
        return chosen(x) if chosen is not None else ops.copy_to_parallel(x, self.group_name)
