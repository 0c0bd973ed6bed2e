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
- transient: twice the largest tensor one op makes in that forward: in backward, that
  tensor's gradient and the gradient the op gives its input live at the same time.

The peak of one training step is modelled as their sum: parameters + gradients + optimizer
state + saved activations + transient. It is the state at the start of backward of a step
after the first (gradients and optimizer state already allocated), an upper bound for a loop
that frees gradients in zero_grad, and it leaves out what the allocator keeps in reserve and
the process's own (CUDA context, libraries).
"""

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import _holders
from ..split import split_sizes

OPTIMIZERS = ("adamw", "sgd", None)
# State tensors shaped like the parameter, per optimizer (SGD: its momentum buffer).
_MOMENTS = {"adamw": 2, "sgd": 1, None: 0}
_STEP_BYTES = {"adamw": 4, "sgd": 0, None: 0}  # AdamW's float32 step count per parameter

_names = itertools.count()


# ---- the plan's records, read in one place each


def _parameter_records(plan) -> Dict[str, object]:
    """Parameter name -> its ParameterRecord for every parameter, tied ones once."""
    return plan.parameters


def _held_counts(plan, rank: int) -> Dict[str, int]:
    """Parameter name -> the elements `rank` holds."""
    return plan.held_parameters(rank)


def _captured_model(plan) -> Optional[nn.Module]:
    """The meta model the plan was captured from, or None (a plan read from JSON)."""
    graph = getattr(getattr(plan, "_prediction", None), "graph", None)
    return getattr(graph, "shadow", None)


def _recorded_inputs(plan):
    """The example inputs the plan was made with: (args, kwargs) of tensors, or None."""
    return getattr(plan, "_input_values", None)


def _input_spec(plan):
    """Shapes and dtypes of the plan's example inputs ({"args": [...], "kwargs": {...}}), or None."""
    return plan.example.get("inputs")


# ---- results


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


# ---- parameters, gradients, optimizer state


def model_state_bytes(plan, rank: int, dtypes: Dict[str, torch.dtype], trainable: Dict[str, bool],
                      optimizer: Optional[str], master_weights: Optional[bool]) -> Tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes on `rank`."""
    from ..optim._common import state_dtype, uses_master

    group = {"master_weights": master_weights}
    params = grads = state = 0
    for name, count in _held_counts(plan, rank).items():
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


# ---- activations saved for backward, on meta


class _MetaSavedBytes:
    """Saved-tensor hooks counting each saved storage once, whole (meta tensors have storages
    of a known size and a distinct identity), except the storages of `ignore`."""

    def __init__(self, ignore: Iterable[torch.Tensor]):
        self._ignored = {h.untyped_storage()._cdata for t in ignore for h in _holders(t)}
        self._storages: Dict[int, int] = {}
        self._alive: List[torch.UntypedStorage] = []  # keeps each identity unique while counting
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        holders = _holders(t)
        storages = [h.untyped_storage() for h in holders]
        if holders and not any(s._cdata in self._ignored for s in storages):
            for storage in storages:
                if storage._cdata not in self._storages:
                    self._storages[storage._cdata] = storage.nbytes()
                    self._alive.append(storage)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op makes while active, in bytes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


@contextlib.contextmanager
def fake_world(world_size: int):
    """A function giving a process group of `world_size` for any rank, whose collectives do
    nothing (torch's fake backend): the sharded layers built with it run on meta as they will
    on that rank. Without a default process group, a fake one is started for the duration."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup, _register_process_group, _unregister_process_group

    started = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        started = True
    names: List[str] = []

    def group(rank: int):
        name = f"autoshard_memory_{os.getpid()}_{next(_names)}"
        pg = dist.ProcessGroup(dist.HashStore(), rank, world_size)
        backend = FakeProcessGroup._create_internal(rank, world_size)
        for device in ("cpu", "meta"):
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
        pg._set_group_name(name)
        _register_process_group(name, pg)
        names.append(name)
        return pg

    try:
        yield group
    finally:
        for name in names:
            _unregister_process_group(name)
        if started:
            dist.destroy_process_group()


def _sharded_copy(model: nn.Module, plan, group, dtype: Optional[torch.dtype], loss_parallel: bool) -> nn.Module:
    """A meta copy of `model` sharded for `group`'s rank as parallelize shards it."""
    from .. import loss_parallel as loss_parallelism
    from ..parallelize import _apply
    from .meta_inputs import meta_shadow

    shadow = meta_shadow(model, always_copy=True)
    if dtype is not None:
        shadow.to(dtype)
    _apply(shadow, plan, group)
    loss_parallelism.install(shadow, plan, group, loss_parallel)
    return shadow


def activation_bytes(model: nn.Module, plan, group, inputs, dtype: Optional[torch.dtype],
                     loss_parallel: bool) -> Tuple[int, int]:
    """(bytes saved for backward, largest tensor an op makes) in one forward of `model` sharded
    for `group`'s rank, on meta."""
    from .meta_autocast import meta_autocast
    from .meta_values import KnownValues

    shadow = _sharded_copy(model, plan, group, dtype, loss_parallel)
    values = KnownValues()
    args, kwargs = values.to_meta(inputs[0]), values.to_meta(inputs[1])
    if dtype is not None:
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        args, kwargs = torch.utils._pytree.tree_map(cast, (args, kwargs))
    saved = _MetaSavedBytes(ignore=list(shadow.parameters()))
    largest = _LargestOutput()
    with torch.enable_grad(), values, meta_autocast(), saved, largest:
        shadow(*args, **kwargs)
    return saved.bytes, largest.bytes


# ---- inputs


def _fill(name: str, token: int):
    return token if name.endswith("input_ids") or name == "labels" else 1 if name.endswith("mask") else 0


def scaled_inputs(plan, model: nn.Module, example_inputs, batch: Optional[int], seq: Optional[int]):
    """(args, kwargs) of real tensors for the forward whose memory is predicted: `example_inputs`
    as given; else the plan's own example inputs, their batch dim (dim 0) made `batch` and the
    token dims of id and mask tensors (integer tensors' dims of the example's sequence length)
    made `seq`. A language model whose inputs hold input_ids and no labels gets labels (the
    ids), so that the loss is part of the step."""
    from .inputs import ordinary_token
    from .meta_inputs import split_inputs

    if example_inputs is not None:
        if batch is not None or seq is not None:
            raise ValueError("ShardingPlan.memory: give example_inputs or batch/seq, not both")
        return split_inputs(example_inputs)
    spec = _input_spec(plan)
    recorded = _recorded_inputs(plan)
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
    import inspect

    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _describe(args, kwargs) -> str:
    from .meta_inputs import input_shapes

    return input_shapes(args, kwargs)


# ---- the prediction


def _check_model(model: nn.Module) -> None:
    if any(hasattr(m, "shard_specs") for m in model.modules()) or hasattr(model, "autoshard_state"):
        raise ValueError("ShardingPlan.memory: the model is already parallelized; pass model= a model built as "
                         "the plan saw it (on meta is enough)")


def _rank_key(plan, rank: int, token_lengths: List[int]) -> tuple:
    """What decides a rank's figures: what it holds and its share of the tokens."""
    held = tuple(_held_counts(plan, rank).values())
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
        model = _captured_model(plan)
        if model is None:
            raise ValueError("ShardingPlan.memory: this plan holds no model (it was read from JSON); pass model=")
    if not isinstance(model, nn.Module):
        raise TypeError(f"ShardingPlan.memory: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_model(model)
    if not _parameter_records(plan):
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
            saved, largest = found[key]
            p, g, s = model_state_bytes(plan, rank, dtypes, trainable, optimizer, master_weights)
            results.append(RankMemory(rank, p, g, s, saved, 2 * largest))
    return MemoryPrediction(world, results, _describe(args, kwargs), optimizer, master_weights, dtype)


def largest_world_size(make_plan, start: int, limit: int = 4096):
    """(world size, plan) for the largest world size, from `start` up to `limit`, at which the plan
    `make_plan(world_size)` splits every layer it can split at all: no layer held whole for having
    too few whole units (heads) for the ranks. Doubling, then halving the gap."""
    good, good_plan = start, None
    bad = None
    n = max(start, 1) * 2
    while n <= limit:
        found = _splits_everything(make_plan, n)
        if found is None:
            bad = n
            break
        good, good_plan = n, found
        n *= 2
    if bad is None:
        return good, good_plan
    while bad - good > 1:
        middle = (good + bad) // 2
        found = _splits_everything(make_plan, middle)
        if found is None:
            bad = middle
        else:
            good, good_plan = middle, found
    return good, good_plan


def _too_few_units(plan) -> bool:
    """Whether some layer is held whole for having fewer whole units than ranks."""
    return any(layer.reason == "too_few_units" for layer in plan.layers)


def _splits_everything(make_plan, world_size: int):
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(world_size)
    except ValueError:
        return None
    return None if _too_few_units(plan) else plan
