"""``sequence_parallel="auto"``: whether to split the tokens between layers, from what it costs
and what it saves.

Sequence parallelism replaces a row layer's all-reduce by a reduce-scatter and the next column
layers' input copy by an all-gather, and holds 1/N of the activations between layers. On NCCL
the pair moves the bytes the all-reduce moves and costs about what it costs, so it pays always.
On gloo (autoshard's rings, ``benchmarks/bench_sequence_collectives.py``) the pair costs
0.8-1.0x the all-reduce at 2 ranks and 1.0-1.15x at 4, so it pays always at 2 ranks and, at
more, only where memory needs it:

- a backend whose pair costs no more than the all-reduce at this world size: on;
- a costlier backend and no memory budget: off;
- with ``memory_budget`` (bytes per rank): off where the step's predicted peak without it
  (``ShardingPlan.memory``: AdamW with the model's dtypes, on the plan's example inputs) fits
  the budget; on otherwise, saying whether even then it does not fit.

The choice, with its figures, is the plan's ``sequence_choice`` and is printed with the plan.
A model with no token-wise region between layers has nothing to choose.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from .make_plan import plan_keeping_whole

# The reduce-scatter + all-gather pair's time over the all-reduce's it replaces, by backend:
# (at two ranks, at more).
PAIR_COST = {"nccl": (1.0, 1.0), "gloo": (0.9, 1.05)}
# An unmeasured backend's pair is never assumed cheaper than the costliest measured.
UNKNOWN_BACKEND_COST = max(max(costs) for costs in PAIR_COST.values())


def pair_cost(backend: str, world_size: int) -> float:
    """The pair's time over the all-reduce's on `backend` at `world_size` ranks."""
    costs = PAIR_COST.get(backend)
    if costs is None:
        return UNKNOWN_BACKEND_COST
    return costs[0] if world_size <= 2 else costs[1]


def check_arguments(function: str, sequence_parallel, memory_budget) -> None:
    if sequence_parallel not in (True, False, "auto") or not isinstance(sequence_parallel, (bool, str)):
        raise ValueError(f"{function}: sequence_parallel must be True, False or \"auto\", got {sequence_parallel!r}")
    if memory_budget is None:
        return
    if type(memory_budget) is not int or memory_budget <= 0:
        raise ValueError(f"{function}: memory_budget must be a positive int (bytes per rank) or None, "
                         f"got {memory_budget!r}")
    if sequence_parallel != "auto":
        raise ValueError(f"{function}: memory_budget is read only with sequence_parallel=\"auto\" (it decides "
                         f"whether sequence parallelism is needed), got sequence_parallel={sequence_parallel!r}")


def backend_of(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> str:
    """The backend the model's collectives would run on: the group's for the model's device
    (torch's "cpu:gloo,cuda:nccl" names one per device), else NCCL for a model on a GPU (or on
    meta with a GPU present) and gloo otherwise."""
    devices = {p.device.type for p in model.parameters()}
    on_gpu = "cuda" in devices or (devices <= {"meta"} and torch.cuda.is_available())
    if group is not None or (dist.is_available() and dist.is_initialized()):
        name = str(dist.get_backend(group))
        if ":" not in name:
            return name
        by_device = dict(part.split(":", 1) for part in name.split(","))
        return by_device.get("cuda" if on_gpu else "cpu", name)
    return "nccl" if on_gpu else "gloo"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def choose(model: nn.Module, world_size: int, example_inputs, overrides, memory_budget: Optional[int],
           backend: str, memory_options: Optional[dict] = None, gather_unpaired: bool = True) -> Tuple[bool, str]:
    """(whether to split the tokens, why) for `model` on `world_size` ranks (see the module).
    `memory_options` are ShardingPlan.memory's (batch, seq, optimizer, dtype, ...) for the peak
    compared with the budget."""
    options = dict(memory_options or {})
    with_tokens_split = plan_keeping_whole(model, world_size, example_inputs, overrides, True, {},
                                           gather_unpaired=gather_unpaired)
    if not any(layer.sequence for layer in with_tokens_split.layers):
        return False, "sequence parallelism: none possible (no token-wise region between a row and a column layer)"
    cost = pair_cost(backend, world_size)
    pair = f"on {backend} at {world_size} ranks its reduce-scatter + all-gather cost {cost:g}x the all-reduce they replace"
    if cost <= 1.0:
        return True, f"sequence parallelism on: {pair}, and the activations between layers are 1/{world_size} per rank"
    if memory_budget is None:
        return False, (f"sequence parallelism off: {pair} (benchmarks/bench_sequence_collectives.py); give "
                       "memory_budget= to have it where memory needs it")
    without = plan_keeping_whole(model, world_size, example_inputs, overrides, False, {},
                                 gather_unpaired=gather_unpaired)
    peak_without = without.memory(example_inputs, model=model, **options).largest().peak
    budget = f"the memory budget of {_size(memory_budget)} per rank"
    if peak_without <= memory_budget:
        return False, (f"sequence parallelism off: without it the step's predicted peak, {_size(peak_without)} per "
                       f"rank, is within {budget}, and {pair}")
    peak_with = with_tokens_split.memory(example_inputs, model=model, **options).largest().peak
    fits = "within it" if peak_with <= memory_budget else "still over it: more ranks or a smaller batch are needed"
    return True, (f"sequence parallelism on: without it the step's predicted peak, {_size(peak_without)} per rank, "
                  f"exceeds {budget}; with it {_size(peak_with)}, {fits}")
