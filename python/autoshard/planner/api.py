"""autoshard.plan: the sharding plan of a model, planned offline or over the default group."""

from typing import Dict, Optional, Union

import torch
from torch import nn

from ..apply.shard_model import apply_plan, check_plan_fits
from ..core.comm import world_size as group_world_size
from . import sequence_choice
from .dry_run import dry_run_on_paper
from .make_plan import check_plain_parameters
from .plan_until_it_runs import plan_until_it_runs
from .sharding_plan import ShardingPlan


def plan(model: nn.Module, world_size: Optional[int] = None, example_inputs=None,
         overrides: Optional[Dict[str, str]] = None, sequence_parallel: Union[bool, str] = True,
         memory_budget: Optional[int] = None, gather_unpaired: bool = True) -> ShardingPlan:
    """The sharding plan for `model` on `world_size` ranks, derived from its dataflow.

    It is the plan parallelize(model) would run: tried on a meta copy of the model sharded for
    each rank in turn, and made again with whole what computed otherwise than the plan predicts
    (the reason "dry_run_mismatch" says so), so that parallelize(model, plan(model)) runs where
    parallelize(model) does. With world_size given no process group is needed, so plans can be
    inspected offline; no collective is made either way, so one rank alone may call it.
    `overrides` maps name patterns (fnmatch, on module or parameter names) to "replicate" or
    "column_gather", and the plan is made again around them. With `sequence_parallel` the
    tokens between a row layer and the next column layers are split over the ranks where every
    op there is per token (see csrc/plan/sequence.cpp). With `sequence_parallel="auto"` the plan
    splits them where it pays: on a backend whose reduce-scatter + all-gather cost what the
    all-reduce costs (NCCL), or where the step's predicted peak without it exceeds
    `memory_budget` (bytes per rank); the plan says why (see planner/sequence_choice.py). Where the
    fewest collectives would leave a rank more than 1/N + 10% of the parameters, the large layers
    that cannot be paired are split and their outputs gathered (reason gathered_unpaired);
    `gather_unpaired=False` keeps them whole, for the fewest collectives whatever the memory."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if world_size is None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise ValueError("plan: world_size is required when torch.distributed is not initialised")
        world_size = group_world_size()
    if type(world_size) is not int or world_size <= 0:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    sequence_choice.check_arguments("plan", sequence_parallel, memory_budget)
    check_plain_parameters(model, "plan")
    if not isinstance(gather_unpaired, bool):
        raise ValueError(f"plan: gather_unpaired must be True or False, got {gather_unpaired!r}")
    choice = ""
    if sequence_parallel == "auto":
        sequence_parallel, choice = sequence_choice.choose(model, world_size, example_inputs, overrides, memory_budget,
                                                           sequence_choice.backend_of(model),
                                                           gather_unpaired=gather_unpaired)
    # The plan parallelize would run: tried on a meta copy sharded for each rank, and made again
    # around what computed otherwise, as parallelize(model) does (planner/plan_until_it_runs.py).
    return plan_until_it_runs(model, world_size, example_inputs, sequence_parallel,
                              lambda candidate: dry_run_on_paper(model, candidate, example_inputs, apply_plan,
                                                                 check_plan_fits),
                              choice, overrides, gather_unpaired)[0]
