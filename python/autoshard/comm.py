"""The mappings of tensor parallelism, and a counter of the collectives they issue.

Each mapping is a C++ op whose gradient is its partner mapping, so the collectives of
backward are issued (and counted) in C++ too::

    copy_to_parallel      forward identity            backward all-reduce (sum)
    reduce_from_parallel  forward all-reduce (sum)    backward identity
    gather_from_parallel  forward all-gather          backward this rank's piece
    scatter_to_parallel   forward this rank's piece   backward all-gather

Pieces along a split dimension follow ``split_sizes(length, world_size)``: rank r holds
``split_sizes(length, world_size)[r]`` elements, uneven sizes included. A group of one
rank issues no collective at all.
"""

import operator
from typing import Dict, List, Optional

import torch

from . import ops
from .distributed import ProcessGroup, group_name, resolve


def _check_tensor(x, function: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{function}: x must be a torch.Tensor, got {type(x).__name__}")


def _as_int(value, argument: str, function: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{function}: {argument} must be an int, got {type(value).__name__}") from None


def world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (None: the default tensor-parallel group)."""
    return resolve(group, "world_size").size()


def rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank inside ``group`` (None: the default tensor-parallel group)."""
    return resolve(group, "rank").rank()


def copy_to_parallel(x: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Identity (a copy) in forward; all-reduces (sums) the gradient in backward. Enters a
    region where every rank computes on the same, replicated ``x``."""
    _check_tensor(x, "copy_to_parallel")
    return ops.copy_to_parallel(x, group_name(group))


def reduce_from_parallel(x: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """All-reduces (sums) ``x`` over the group in forward; identity in backward. Leaves a
    region where every rank holds a partial sum."""
    _check_tensor(x, "reduce_from_parallel")
    return ops.reduce_from_parallel(x, group_name(group))


def gather_from_parallel(x: torch.Tensor, dim: int, length: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Concatenates every rank's piece along ``dim`` into the full ``length``; ``x`` must
    hold ``split_sizes(length, world_size)[rank]`` elements there. Backward keeps this
    rank's piece of the gradient."""
    _check_tensor(x, "gather_from_parallel")
    return ops.gather_from_parallel(
        x,
        _as_int(dim, "dim", "gather_from_parallel"),
        _as_int(length, "length", "gather_from_parallel"),
        group_name(group),
    )


def scatter_to_parallel(x: torch.Tensor, dim: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (``autoshard.shard`` with the group's rank and
    size); backward all-gathers the gradient."""
    _check_tensor(x, "scatter_to_parallel")
    return ops.scatter_to_parallel(x, _as_int(dim, "dim", "scatter_to_parallel"), group_name(group))


def _totals() -> Dict[str, List[int]]:
    kinds = ops.comm_counter_kinds()
    flat = ops.comm_counters()
    return {kind: [flat[2 * i], flat[2 * i + 1]] for i, kind in enumerate(kinds)}


class CommCounter:
    """Counts the collectives autoshard issues in this process while inside ``with``, forward
    and backward alike::

        with autoshard.CommCounter() as comm:
            model(x).sum().backward()
        comm.counts  # {"all_reduce": 2}
        comm.bytes   # {"all_reduce": 8192}: payload this rank contributed

    Kinds that did not occur are left out. Counters nest freely (an inner one does not hide
    anything from an outer one), and re-entering the same counter adds to what it has
    counted so far. Reading ``counts`` inside the block gives the counts up to that point.
    A gather's bytes are those of the padded piece that goes over the wire.
    """

    def __init__(self):
        self._counted: Dict[str, List[int]] = {}
        self._start: Optional[Dict[str, List[int]]] = None
        self._depth = 0

    def __enter__(self) -> "CommCounter":
        if self._depth == 0:
            self._start = _totals()
        self._depth += 1
        return self

    def __exit__(self, *exc_info) -> None:
        if self._depth == 0:
            # Leaving unchanged: a negative depth would stop every later ``with`` from counting.
            raise RuntimeError("CommCounter.__exit__ called without a matching __enter__ (use it as "
                               "`with CommCounter() as c:`); the counter is unchanged")
        self._depth -= 1
        if self._depth == 0:
            self._counted = self._current()
            self._start = None

    def _current(self) -> Dict[str, List[int]]:
        result = {kind: list(value) for kind, value in self._counted.items()}
        if self._start is not None:
            for kind, (count, size) in _totals().items():
                start_count, start_size = self._start.get(kind, (0, 0))
                before = result.setdefault(kind, [0, 0])
                before[0] += count - start_count
                before[1] += size - start_size
        return result

    @property
    def counts(self) -> Dict[str, int]:
        return {kind: count for kind, (count, _) in self._current().items() if count}

    @property
    def bytes(self) -> Dict[str, int]:
        return {kind: size for kind, (count, size) in self._current().items() if count}

    def __repr__(self) -> str:
        return f"CommCounter(counts={self.counts}, bytes={self.bytes})"
