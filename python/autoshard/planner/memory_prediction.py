"""Memory per rank under a plan, predicted before the first step (ShardingPlan.memory).

For each rank, in bytes:

- parameters: the elements the rank holds (ShardingPlan.held_parameters, tied parameters
  once) times their dtype's size;
- gradients: the same for every parameter that requires a gradient;
- optimizer state: AdamW keeps two moments, SGD with momentum one buffer, both shaped like
  the parameter, fp32 with an fp32 master weight beside them where autoshard.optim steps the
  parameter through one (bf16 and fp16 parameters by default), and a 4-byte step count each
  for AdamW;
- activations: the bytes autograd saves for backward in one forward, counted by running the
  model sharded for that rank (parallelize's own layer surgery, loss parallelism included) on
  a meta copy, under a process group that only names the rank (torch's fake backend), with
  saved-tensor hooks; each storage counts once, whole, the parameters not at all, as
  autoshard.SavedTensorCounter counts them on a real device;
- transient: what else the step's ops hold at once, at the most: the same meta copy runs
  backward from its loss (its gradients allocated beforehand, as in a step after the first),
  every storage an op makes counted while any tensor of it lives; the most held at once, less
  the saved activations (where backward cannot run on meta: twice the largest tensor one op
  makes in the forward).

The peak of one training step is modelled as their sum: parameters + gradients + optimizer
state + saved activations + transient. It is the state at the start of backward of a step
after the first (gradients and optimizer state already allocated), an upper bound for a loop
that frees gradients in zero_grad, and it leaves out what the allocator keeps in reserve and
the process's own (CUDA context, libraries).

The parts: memory_plan_reads.py (what is read of the plan), memory_model_state.py
(parameters, gradients, optimizer state), memory_activations.py (the meta forward),
memory_inputs.py (the inputs it runs on); largest_world.py finds the largest world size that
splits every layer.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..core.split import split_sizes
from .memory_activations import activation_bytes, fake_world
from .memory_inputs import describe_inputs, scaled_inputs
from .memory_model_state import OPTIMIZERS, model_state_bytes
from .memory_plan_reads import captured_model, held_counts, parameter_records


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on one rank for one training step."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward in one forward
    transient: int

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.transient

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer


@dataclass
class MemoryPrediction:
    """ShardingPlan.memory's answer: one RankMemory per rank, and what it was predicted for."""

    world_size: int
    ranks: List[RankMemory]
    inputs: str  # the input shapes the activations were counted on
    optimizer: Optional[str]
    master_weights: Optional[bool]
    dtype: Optional[torch.dtype]

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]

    def largest(self) -> RankMemory:
        """The rank with the highest predicted peak (the first such rank)."""
        return max(self.ranks, key=lambda r: (r.peak, -r.rank))

    def __str__(self) -> str:
        return "\n".join(table(self))


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _unit(largest: int) -> Tuple[str, int]:
    """The unit the table shows: the largest in which the largest figure is at least 10."""
    return next(((name, size) for name, size in _UNITS if largest >= 10 * size), _UNITS[-1])


def table(prediction: MemoryPrediction, ranks: Optional[Iterable[int]] = None) -> List[str]:
    """The prediction as text lines: one row per rank (all up to 8 ranks, else the largest)."""
    if ranks is None:
        ranks = range(prediction.world_size) if prediction.world_size <= 8 else [prediction.largest().rank]
    ranks = list(ranks)
    unit, size = _unit(max(prediction.ranks[r].peak for r in ranks))
    show = lambda n: f"{n / size:,.1f}"
    dtype = "model's" if prediction.dtype is None else str(prediction.dtype).replace("torch.", "")
    lines = [f"memory per rank at world size {prediction.world_size}, inputs {prediction.inputs}, "
             f"optimizer {prediction.optimizer}, dtype {dtype} ({unit}; peak = parameters + gradients + optimizer "
             f"+ saved activations + transient):",
             f"  {'rank':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'saved':>10} {'transient':>10} "
             f"{'peak':>10}"]
    for rank in ranks:
        r = prediction.ranks[rank]
        lines.append(f"  {r.rank:>5} {show(r.parameters):>10} {show(r.gradients):>10} {show(r.optimizer):>10} "
                     f"{show(r.activations):>10} {show(r.transient):>10} {show(r.peak):>10}")
    return lines


def _check_model(model: nn.Module) -> None:
    if any(hasattr(m, "shard_specs") for m in model.modules()) or hasattr(model, "autoshard_state"):
        raise ValueError("ShardingPlan.memory: the model is already parallelized; pass model= a model built as "
                         "the plan saw it (on meta is enough)")


def _rank_key(plan, rank: int, token_lengths: List[int]) -> tuple:
    """What decides a rank's figures: what it holds and its share of the tokens."""
    held = tuple(held_counts(plan, rank).values())
    return held, tuple(split_sizes(n, plan.world_size)[rank] for n in token_lengths)


def predict(plan, example_inputs=None, *, batch: Optional[int] = None, seq: Optional[int] = None,
            optimizer: Optional[str] = "adamw", master_weights: Optional[bool] = None,
            dtype: Optional[torch.dtype] = None, model: Optional[nn.Module] = None,
            loss_parallel: bool = True) -> MemoryPrediction:
    """What ShardingPlan.memory returns (see there and this module's docstring)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"ShardingPlan.memory: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if master_weights is not None and not isinstance(master_weights, bool):
        raise TypeError(f"ShardingPlan.memory: master_weights must be None, True or False, got {master_weights!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"ShardingPlan.memory: dtype must be None or a floating-point torch.dtype, got {dtype!r}")
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (type(value) is not int or value <= 0):
            raise ValueError(f"ShardingPlan.memory: {name} must be a positive int, got {value!r}")
    if model is None:
        model = captured_model(plan)
        if model is None:
            raise ValueError("ShardingPlan.memory: this plan holds no model (it was read from JSON); pass model=")
    if not isinstance(model, nn.Module):
        raise TypeError(f"ShardingPlan.memory: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_model(model)
    if not parameter_records(plan):
        raise ValueError("ShardingPlan.memory: this plan records no parameters; make it again with autoshard.plan")
    world = plan.world_size
    params = dict(model.named_parameters())
    dtypes = {name: (dtype if dtype is not None and p.is_floating_point() else p.dtype) for name, p in params.items()}
    trainable = {name: p.requires_grad for name, p in params.items()}
    args, kwargs = scaled_inputs(plan, model, example_inputs, batch, seq)
    token_lengths = sorted({d for t in list(args) + list(kwargs.values())
                            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 2
                            for d in (t.shape[1], t.shape[0] * t.shape[1])})
    found: Dict[tuple, Tuple[int, int]] = {}
    results = []
    with fake_world(world) as group:
        for rank in range(world):
            key = _rank_key(plan, rank, token_lengths)
            if key not in found:
                found[key] = activation_bytes(model, plan, group(rank), (args, kwargs), dtype, loss_parallel)
            saved, transient = found[key]
            p, g, s = model_state_bytes(plan, rank, dtypes, trainable, optimizer, master_weights)
            results.append(RankMemory(rank, p, g, s, saved, transient))
    return MemoryPrediction(world, results, describe_inputs(args, kwargs), optimizer, master_weights, dtype)
