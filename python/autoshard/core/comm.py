"""The mappings of tensor parallelism, and a counter of the collectives they issue.

Each mapping is a C++ op whose gradient is its partner mapping, so the collectives of
backward are issued (and counted) in C++ too::

    copy_to_parallel      forward identity            backward all-reduce (sum)
    reduce_from_parallel  forward all-reduce (sum)    backward identity
    gather_from_parallel  forward all-gather          backward this rank's piece
    scatter_to_parallel   forward this rank's piece   backward all-gather
    reduce_scatter_to_sequence  forward reduce-scatter (tokens)  backward all-gather
    all_gather_from_sequence    forward all-gather (tokens)      backward reduce-scatter

Pieces along a split dimension follow ``split_sizes(length, world_size)``: rank r holds
``split_sizes(length, world_size)[r]`` elements, uneven sizes included. A group of one
rank issues no collective at all.

The other collectives autoshard issues (clipping's norms, data-parallel gradient buckets,
partitioned optimizer state, gathering full tensors) are C++ ops too, wrapped below, so that
``CommCounter`` sees every one of them. Pieces of unequal sizes are padded for the wire inside
those ops, and nowhere else.
"""

from typing import Dict, List, Optional, Sequence

import torch

from . import ops
from .distributed import ProcessGroup, group_name, prepare_rings, resolve
from .split import _as_int, _check_tensor


def _collective_group_name(group: Optional[ProcessGroup], x: torch.Tensor, function: str) -> str:
    """The name the op resolves ``group`` by, once ``x`` is checked to be a tensor, with the
    group's rings prepared first for a CPU tensor ``x``: every rank of the group calls a
    collective at the same point, so it may set up what the collective needs."""
    _check_tensor(x, function)
    if x.device.type == "cpu":
        prepare_rings(group)
    return group_name(group)


def world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (None: the default tensor-parallel group)."""
    return resolve(group, "world_size").size()


def rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank inside ``group`` (None: the default tensor-parallel group)."""
    return resolve(group, "rank").rank()


def copy_to_parallel(x: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Identity (a copy) in forward; all-reduces (sums) the gradient in backward. Enters a
    region where every rank computes on the same, replicated ``x``."""
    return ops.copy_to_parallel(x, _collective_group_name(group, x, "copy_to_parallel"))


def reduce_from_parallel(x: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """All-reduces (sums) ``x`` over the group in forward; identity in backward. Leaves a
    region where every rank holds a partial sum."""
    return ops.reduce_from_parallel(x, _collective_group_name(group, x, "reduce_from_parallel"))


def gather_from_parallel(x: torch.Tensor, dim: int, length: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Concatenates every rank's piece along ``dim`` into the full ``length``; ``x`` must
    hold ``split_sizes(length, world_size)[rank]`` elements there. Backward keeps this
    rank's piece of the gradient."""
    return ops.gather_from_parallel(x, _as_int(dim, "dim", "gather_from_parallel"),
                                    _as_int(length, "length", "gather_from_parallel"),
                                    _collective_group_name(group, x, "gather_from_parallel"))


def scatter_to_parallel(x: torch.Tensor, dim: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (``autoshard.shard`` with the group's rank and
    size); backward all-gathers the gradient."""
    return ops.scatter_to_parallel(x, _as_int(dim, "dim", "scatter_to_parallel"),
                                   _collective_group_name(group, x, "scatter_to_parallel"))


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Sequence parallelism's exit from a row layer: the sum of ``x`` over the group, of which
    this rank keeps its ``split_sizes`` piece along the token axis ``dim``; backward
    all-gathers the gradient."""
    return ops.reduce_scatter_to_sequence(x, _as_int(dim, "dim", "reduce_scatter_to_sequence"),
                                          _collective_group_name(group, x, "reduce_scatter_to_sequence"))


def all_gather_from_sequence(x: torch.Tensor, dim: int, length: int,
                             group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Sequence parallelism's entry to a column layer: every rank's tokens along ``dim``
    (``length`` in all); backward sums the gradient over the group and keeps this rank's piece."""
    return ops.all_gather_from_sequence(x, _as_int(dim, "dim", "all_gather_from_sequence"),
                                        _as_int(length, "length", "all_gather_from_sequence"),
                                        _collective_group_name(group, x, "all_gather_from_sequence"))


def all_reduce_(x: torch.Tensor, op: str = "sum", group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Sums (``op="sum"``) or takes the maximum (``op="max"``) of ``x`` over the group, in
    place; returns ``x``."""
    ops.all_reduce_(x, op, _collective_group_name(group, x, "all_reduce_"))
    return x


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Every rank's piece concatenated along ``dim`` in rank order; rank r's piece holds
    ``sizes[r]`` elements there (this rank's is ``x``)."""
    return ops.all_gather_uneven(x, _as_int(dim, "dim", "all_gather_uneven"), sizes,
                                 _collective_group_name(group, x, "all_gather_uneven"))


def reduce_scatter_uneven(x: torch.Tensor, sizes: Sequence[int], group: Optional[ProcessGroup] = None,
                          async_op: bool = False) -> torch.Tensor:
    """``x`` (1-d) holds every rank's piece back to back, rank r's of ``sizes[r]`` elements;
    returns this rank's piece of their sum over the group. With ``async_op`` the collective is
    only started: pass the result to ``wait`` before reading it."""
    return ops.reduce_scatter_uneven(x, sizes, _collective_group_name(group, x, "reduce_scatter_uneven"), async_op)


def all_reduce_bucket(tensors: Sequence[torch.Tensor], group: Optional[ProcessGroup] = None,
                      async_op: bool = False) -> torch.Tensor:
    """The tensors flattened into one new 1-d buffer, summed over the group (``async_op``: as
    for reduce_scatter_uneven)."""
    tensors = list(tensors)
    if not tensors:  # the dispatcher cannot route an op without a tensor argument
        raise ValueError("all_reduce_bucket: tensors must not be empty")
    return ops.all_reduce_bucket(tensors, _collective_group_name(group, tensors[0], "all_reduce_bucket"), async_op)


def broadcast_(x: torch.Tensor, src: int, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place; returns ``x``."""
    ops.broadcast_(x, _as_int(src, "src", "broadcast_"), _collective_group_name(group, x, "broadcast_"))
    return x


def wait(x: torch.Tensor) -> torch.Tensor:
    """Waits for the collective started with ``async_op=True`` that produces ``x``."""
    return torch.ops._c10d_functional.wait_tensor(x)


Tally = Dict[str, Dict[str, List[int]]]  # group name -> kind -> [count, bytes]


def _totals() -> Tally:
    kinds = ops.comm_counter_kinds()
    names, flat = ops.comm_group_counters()
    width = 2 * len(kinds)
    return {name: {kind: [flat[g * width + 2 * i], flat[g * width + 2 * i + 1]] for i, kind in enumerate(kinds)}
            for g, name in enumerate(names)}


class CommCounter:
    """Counts the collectives autoshard issues in this process while inside ``with``, forward
    and backward alike, by kind, bytes and process group::

        with autoshard.CommCounter() as comm:
            model(x).sum().backward()
        comm.counts  # {"all_reduce": 2}
        comm.bytes   # {"all_reduce": 8192}: payload this rank contributed
        comm.counts_of(group), comm.bytes_of(group)  # the same over one group only

    Kinds that did not occur are left out. Counters nest freely (an inner one does not hide
    anything from an outer one), and re-entering the same counter adds to what it has
    counted so far. Reading ``counts`` inside the block gives the counts up to that point.
    A gather's bytes are those of the padded piece that goes over the wire, a reduce-scatter's
    those of its padded input.
    """

    def __init__(self):
        self._counted: Tally = {}
        self._start: Optional[Tally] = None
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

    def _current(self) -> Tally:
        result = {name: {kind: list(value) for kind, value in kinds.items()} for name, kinds in self._counted.items()}
        if self._start is not None:
            for name, kinds in _totals().items():
                started = self._start.get(name, {})
                mine = result.setdefault(name, {})
                for kind, (count, size) in kinds.items():
                    start_count, start_size = started.get(kind, (0, 0))
                    before = mine.setdefault(kind, [0, 0])
                    before[0] += count - start_count
                    before[1] += size - start_size
        return result

    def _sum(self, index: int, name: Optional[str] = None) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for group, kinds in self._current().items():
            if name is not None and group != name:
                continue
            for kind, value in kinds.items():
                if value[0]:
                    out[kind] = out.get(kind, 0) + value[index]
        return out

    @property
    def counts(self) -> Dict[str, int]:
        return self._sum(0)

    @property
    def bytes(self) -> Dict[str, int]:
        return self._sum(1)

    @property
    def groups(self) -> List[str]:
        """The names of the groups that saw a collective while counting."""
        return sorted(name for name, kinds in self._current().items() if any(c for c, _ in kinds.values()))

    def counts_of(self, group: Optional[ProcessGroup] = None) -> Dict[str, int]:
        """``counts`` over ``group`` (None: the default tensor-parallel group) alone."""
        return self._sum(0, group_name(group))

    def bytes_of(self, group: Optional[ProcessGroup] = None) -> Dict[str, int]:
        """``bytes`` over ``group`` (None: the default tensor-parallel group) alone."""
        return self._sum(1, group_name(group))

    def __repr__(self) -> str:
        return f"CommCounter(counts={self.counts}, bytes={self.bytes})"
