"""Indexing with a list of consecutive integers, read as the slice it equals.

``x[..., [-2], :]`` (Falcon picks its one key head from its fused projection so) gives the
values ``x[..., -2:-1, :]`` gives. On meta tensors the list reaches ATen as an index tensor
whose values are unknown, so the capture could not follow it; while capturing and tracing,
such an index is given to torch as the slice instead. Only one list of consecutive integers
of one sign, within the dimension, with no other advanced index, is rewritten: the result
then has the same shape and values, and is a copy, as the list would give.
"""

from typing import Optional

import torch
from torch.overrides import TorchFunctionMode


def _as_slice(values) -> Optional[slice]:
    if not isinstance(values, list) or not values or not all(type(v) is int for v in values):
        return None
    if any(b != a + 1 for a, b in zip(values, values[1:])):
        return None
    first, last = values[0], values[-1]
    if first < 0 <= last:
        return None
    stop = last + 1
    return slice(first, None if stop == 0 else stop)


def _rewritten(index, ndim: int, shape) -> Optional[tuple]:
    items = index if isinstance(index, tuple) else (index,)
    advanced = [i for i, item in enumerate(items)
                if isinstance(item, (list, torch.Tensor)) or (item is not None and not isinstance(item, (int, slice))
                                                               and item is not Ellipsis)]
    if len(advanced) != 1:
        return None
    position = advanced[0]
    replacement = _as_slice(items[position])
    if replacement is None:
        return None
    # The dimension the list indexes: a slice clamps where the list would raise, so only lists
    # within that dimension are rewritten.
    consumes = lambda item: item is not None and item is not Ellipsis
    if any(item is Ellipsis for item in items[:position]):
        dim = ndim - sum(consumes(item) for item in items[position + 1:]) - 1
    else:
        dim = sum(consumes(item) for item in items[:position])
    values = items[position]
    if not 0 <= dim < ndim or not all(-shape[dim] <= v < shape[dim] for v in values):
        return None
    items = items[:position] + (replacement,) + items[position + 1:]
    return items if isinstance(index, tuple) else items[0]


class ConsecutiveIndexLists(TorchFunctionMode):
    """While active, ``tensor[..., [a, a + 1, ...], ...]`` runs as ``tensor[..., a:b, ...]``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = _rewritten(args[1], args[0].dim(), args[0].shape)
            if index is not None:
                # A copy, as the list gives: a write into the result leaves the tensor alone.
                return func(args[0], index).clone()
        return func(*args, **(kwargs or {}))
