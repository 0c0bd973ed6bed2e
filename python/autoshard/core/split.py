"""numpy's ``array_split`` for tensors, and one rank's piece of it.

Pieces are contiguous copies (they feed collectives and become parameters), and the sizes
follow numpy's rule everywhere in autoshard: ``split_sizes(10, 3) == [4, 3, 3]``.
"""

import operator
from typing import List, Sequence, Union

import torch

from . import ops


def _as_int(value, argument: str, function: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{function}: {argument} must be an int, got {type(value).__name__}") from None
    # The ops take int64: a larger Python int would fail in the binding with no argument named.
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{function}: {argument} must fit in a signed 64-bit integer, got {value}")
    return value


def _check_tensor(x, function: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{function}: x must be a torch.Tensor, got {type(x).__name__}")


def split_sizes(length: int, sections: int) -> List[int]:
    """Sizes of numpy's split of ``length`` into ``sections``: the first ``length % sections``
    pieces get one extra element."""
    return ops.split_sizes(_as_int(length, "length", "split_sizes"), _as_int(sections, "sections", "split_sizes"))


def array_split(
    x: torch.Tensor, sections_or_indices: Union[int, Sequence[int]], dim: int = 0
) -> List[torch.Tensor]:
    """``numpy.array_split`` for tensors: an int splits into that many near-equal pieces, a
    sequence of indices splits at those indices (python slice rules, as numpy). Differentiable."""
    _check_tensor(x, "array_split")
    dim = _as_int(dim, "dim", "array_split")
    if hasattr(sections_or_indices, "__len__") and not (
        isinstance(sections_or_indices, torch.Tensor) and sections_or_indices.dim() == 0
    ):
        indices = [_as_int(i, "sections_or_indices (an index)", "array_split") for i in sections_or_indices]
        return ops.array_split_indices(x, indices, dim)
    try:
        sections = operator.index(sections_or_indices)
    except TypeError:
        raise TypeError(
            "array_split: sections_or_indices must be an int or a sequence of ints, "
            f"got {type(sections_or_indices).__name__}"
        ) from None
    sections = _as_int(sections, "sections_or_indices", "array_split")
    return ops.array_split_sections(x, sections, dim)


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``array_split(x, world_size, dim)``, computed without
    materialising the other pieces. Differentiable."""
    _check_tensor(x, "shard")
    return ops.shard(
        x, _as_int(rank, "rank", "shard"), _as_int(world_size, "world_size", "shard"), _as_int(dim, "dim", "shard")
    )
