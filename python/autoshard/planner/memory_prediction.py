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

The parts: memory_activations.py (the meta forward); here, model_state_bytes (parameters,
gradients, optimizer state) and scaled_inputs (the inputs it runs on); largest_world.py finds
the largest world size that splits every layer.
"""

import inspect
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..core.split import split_sizes
from .memory_activations import activation_bytes, fake_world
from ..inputs.hf_inputs import ordinary_token
from ..inputs.meta_inputs import input_shapes, split_inputs
from ..optim.optimizer_state import state_dtype, uses_master

OPTIMIZERS = ("adamw", "sgd", None)
# State tensors shaped like the parameter, per optimizer (SGD: its momentum buffer).
_MOMENTS = {"adamw": 2, "sgd": 1, None: 0}
_STEP_BYTES = {"adamw": 4, "sgd": 0, None: 0}  # AdamW's float32 step count per parameter


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
    held = tuple(plan.held_parameters(rank).values())
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
        model = getattr(getattr(plan.prediction, "graph", None), "shadow", None)  # the meta model it was captured from
        if model is None:
            raise ValueError("ShardingPlan.memory: this plan holds no model (it was read from JSON); pass model=")
    if not isinstance(model, nn.Module):
        raise TypeError(f"ShardingPlan.memory: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_model(model)
    if not plan.parameters:
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
    return MemoryPrediction(world, results, input_shapes(args, kwargs), optimizer, master_weights, dtype)


def model_state_bytes(plan, rank: int, dtypes: Dict[str, torch.dtype], trainable: Dict[str, bool],
                      optimizer: Optional[str], master_weights: Optional[bool]) -> Tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes on `rank`."""
    group = {"master_weights": master_weights}
    params = grads = state = 0
    for name, count in plan.held_parameters(rank).items():
        dtype = dtypes.get(name, torch.float32)
        size = count * dtype.itemsize
        params += size
        if not trainable.get(name, True):
            continue
        grads += size
        if optimizer is None:
            continue
        state += count * state_dtype(group, dtype).itemsize * _MOMENTS[optimizer] + _STEP_BYTES[optimizer]
        if uses_master(group, dtype):
            state += count * 4
    return params, grads, state


def _fill(name: str, token: int):
    return token if name.endswith("input_ids") or name == "labels" else 1 if name.endswith("mask") else 0


def scaled_inputs(plan, model: nn.Module, example_inputs, batch: Optional[int], seq: Optional[int]):
    """(args, kwargs) of real tensors for the forward whose memory is predicted: `example_inputs`
    as given; else the plan's own example inputs, their batch dim (dim 0) made `batch` and the
    token dims of id and mask tensors (integer tensors' dims of the example's sequence length)
    made `seq`. A language model whose inputs hold input_ids and no labels gets labels (the
    ids), so that the loss is part of the step."""
    if example_inputs is not None:
        if batch is not None or seq is not None:
            raise ValueError("ShardingPlan.memory: give example_inputs or batch/seq, not both")
        return split_inputs(example_inputs)
    spec = plan.example.get("inputs")  # shapes and dtypes: {"args": [...], "kwargs": {...}}
    recorded = plan.input_values  # (args, kwargs) of tensors, or None
    if spec is None:
        raise ValueError("ShardingPlan.memory: this plan records no example inputs; pass example_inputs")
    token = ordinary_token(model.config) if hasattr(model, "config") else 1
    described = [("", s) for s in spec["args"]] + list(spec["kwargs"].items())
    shapes = [s["shape"] for _, s in described if s is not None]
    if not shapes or not shapes[0]:
        raise ValueError("ShardingPlan.memory: the plan's example inputs have no batch dim; pass example_inputs")
    batch0 = shapes[0][0]
    integer = [s["shape"] for _, s in described if s is not None and not s["dtype"].startswith(("float", "bfloat"))]
    seq0 = next((shape[1] for shape in integer if len(shape) >= 2), None)
    if seq is not None and seq0 is None:
        raise ValueError("ShardingPlan.memory: seq= given, but the model's example inputs hold no token ids")

    def make(s, name=""):
        if s is None:
            return None
        shape = list(s["shape"])
        floating = s["dtype"].startswith(("float", "bfloat"))
        if batch is not None and shape and shape[0] == batch0:
            shape[0] = batch
        if seq is not None and not floating:
            shape = [shape[0]] + [seq if d == seq0 else d for d in shape[1:]]
        return torch.full(shape, _fill(name, token), dtype=getattr(torch, s["dtype"]))

    if recorded is not None and batch is None and seq is None:
        args, kwargs = tuple(recorded[0]), dict(recorded[1])
    else:
        args = tuple(make(s) for s in spec["args"])
        kwargs = {k: make(s, k) for k, s in spec["kwargs"].items()}
    if "input_ids" in kwargs and "labels" not in kwargs and _takes_labels(model):
        kwargs["labels"] = kwargs["input_ids"].clone()
    return args, kwargs


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
