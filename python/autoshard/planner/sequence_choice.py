"""``sequence_parallel="auto"``: whether to split the tokens between layers, from what it costs
and what it saves.

Sequence parallelism replaces a row layer's all-reduce by a reduce-scatter and the next column
layers' input copy by an all-gather, and holds 1/N of the activations between layers. The
policy (csrc/plan/policy.cpp) decides from the facts measured here: the backend, the world size,
whether the model has a token-wise region between layers at all, the ``memory_budget`` (bytes
per rank), and where it asks for them the step's predicted peaks without and with it
(``ShardingPlan.memory``: AdamW with the model's dtypes, on the plan's example inputs):

- a backend whose pair costs no more than the all-reduce at this world size: on;
- a costlier backend and no memory budget: off;
- with a budget: off where the peak without it fits the budget; on otherwise, saying whether
  even then it does not fit.

The choice, with its figures, is the plan's ``sequence_choice`` and is printed with the plan.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from . import policy
from .make_plan import plan_keeping_whole


def pair_cost(backend: str, world_size: int) -> float:
    """The reduce-scatter + all-gather pair's time over the all-reduce's on `backend` at
    `world_size` ranks (an unmeasured backend: the costliest measured)."""
    return policy.ask({"ask": "pair_cost", "backend": backend, "world_size": world_size})["pair_cost"]


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


def choose(model: nn.Module, world_size: int, example_inputs, overrides, memory_budget: Optional[int],
           backend: str, memory_options: Optional[dict] = None, gather_unpaired: bool = True) -> Tuple[bool, str]:
    """(whether to split the tokens, why) for `model` on `world_size` ranks (see the module).
    `memory_options` are ShardingPlan.memory's (batch, seq, optimizer, dtype, ...) for the peak
    compared with the budget."""
    options = dict(memory_options or {})
    with_tokens_split = plan_keeping_whole(model, world_size, example_inputs, overrides, True, {},
                                           gather_unpaired=gather_unpaired)

    def peak(plan) -> int:
        return plan.memory(example_inputs, model=model, **options).largest().peak

    measure = {
        "peak_without": lambda answer: peak(plan_keeping_whole(model, world_size, example_inputs, overrides, False,
                                                               {}, gather_unpaired=gather_unpaired)),
        "peak_with": lambda answer: peak(with_tokens_split),
    }
    answer = policy.decide({"ask": "sequence_parallel", "backend": backend, "world_size": world_size,
                            "token_wise_region": any(layer.sequence for layer in with_tokens_split.layers),
                            "memory_budget": memory_budget}, measure)
    return answer["sequence_parallel"], answer["why"]
