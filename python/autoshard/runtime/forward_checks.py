"""What a parallelized model checks at each forward, before it computes anything: that no
data-parallel wrapper spans its tensor-parallel ranks (wrapper_check), that those ranks are at
the same forward and were given inputs of the same shapes (always) and values (with
check_inputs; input_check), and every `check_replicas_every` forwards, that their replicated
parameters are still equal (replica_check).

``parallelize`` installs them on a model sharded over more than one rank, as a forward
pre-hook on the model itself, run before its other hooks. The checks read the Python stack and
compare values across ranks, so a graph can hold them only as an opaque custom op
(side-effectful, so that it is kept). Where they run:

- eagerly, in the hook;
- ``torch.compile(model)``: torch calls a compiled module's hooks outside the frame of its
  forward, so a traced hook would be a graph of its own, one op long, before the forward's (a
  second graph where the model has one). The hook is therefore ``torch.compiler.disable``d: it
  runs eagerly there, and the forward is one graph;
- where Dynamo traces the model's call itself (a compiled function or module that calls the
  model, ``torch.export``): the hook's substitute in the graph (``substitute_in_graph``) is the
  custom op, run at every call of the compiled code, with no graph break; under torch.export's
  non-strict tracing, which runs the hook as Python, the hook records the same op;
- ``torch.jit.trace``: no check. The tracer would record the checks' own collectives, which are
  no part of the model, and it drops an op that returns nothing; the traced module runs the
  model's computation and collectives only, so its callers must give every rank the same inputs.

Under activation checkpointing that recomputes the whole model, a recomputation checks again, on
every rank alike.
"""

import functools
import itertools
import weakref
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .input_check import check_same_inputs
from ..conventions.huggingface import CACHE_INPUTS
from ..conventions.pipelining import inferring_shapes_from_empty_inputs
from .replica_check import check_replicas
from .ddp_guard import install_ddp_guard
from .wrapper_check import WrapperCheck

_registry: "weakref.WeakValueDictionary[int, ForwardChecks]" = weakref.WeakValueDictionary()
_keys = itertools.count()
_SEPARATOR = "\x1f"  # between the names the op receives as one string (it takes no list of them)


@torch.library.custom_op("autoshard::check_forward", mutates_args=())
def _check_forward(tensors: List[torch.Tensor], names: str, key: int) -> None:
    checks = _registry.get(key)
    if checks is not None:
        checks.run(names.split(_SEPARATOR), tensors)


_check_forward.register_fake(lambda tensors, names, key: None)
torch.fx.node.has_side_effect(torch.ops.autoshard.check_forward.default)


def _collect(name: str, value, names: List[str], tensors: List[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        names.append(name)
        tensors.append(value.detach())
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _collect(f"{name}[{i}]", item, names, tensors)
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect(f"{name}[{key!r}]", item, names, tensors)


def tensor_inputs(args: tuple, kwargs: dict) -> Tuple[List[str], List[torch.Tensor]]:
    """The tensors among a forward's arguments (in lists, tuples and dicts too), with names."""
    names: List[str] = []
    tensors: List[torch.Tensor] = []
    for i, value in enumerate(args):
        _collect(f"args[{i}]", value, names, tensors)
    for key, value in kwargs.items():
        # Inputs that hold the model's own state from an earlier call (each rank's shard of the
        # attention keys and values), not data: left out of the comparison.
        if key not in CACHE_INPUTS:
            _collect(key, value, names, tensors)
    return names, tensors


class ForwardChecks:
    """The checks of one parallelized model over its tensor-parallel `group`."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, check_inputs: bool, check_replicas_every: int):
        self.group = group
        self.check_inputs = check_inputs
        self.check_replicas_every = check_replicas_every
        self.model = weakref.ref(model)
        self.forwards = 0  # forwards run so far: the step named in errors, compared across ranks
        self.wrappers = WrapperCheck(model, dist.get_process_group_ranks(group))
        self.key = next(_keys)
        _registry[self.key] = self

    def run(self, names: List[str], tensors: List[torch.Tensor]) -> None:
        if any(t.is_meta for t in tensors):  # a run on meta has no values to compare
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # A CUDA graph replays kernels, not this hook: a check captured once would compare
            # the captured inputs forever, and its host reads would break the capture.
            return
        self.wrappers()
        forward = self.forwards
        self.forwards += 1
        # A pipeline stage's shape inference feeds uninitialised buffers, different on every
        # rank: their shapes are still compared, and the stage's real forwards compare values.
        values = self.check_inputs and not inferring_shapes_from_empty_inputs()
        check_same_inputs(names, tensors, self.group, forward, values=values)
        model = self.model()
        if self.check_replicas_every and forward % self.check_replicas_every == 0 and model is not None:
            check_replicas(model, self.group, forward)


def _check_in_graph(key: int, names: List[str], tensors: List[torch.Tensor]) -> None:
    if not tensors:  # the dispatcher routes an op by its tensors: give it one
        tensors = [torch.zeros(0)]
        names = ["(no tensor input)"]
    torch.ops.autoshard.check_forward(tensors, _SEPARATOR.join(names), key)


def _pre_forward(key: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.jit.is_tracing():  # the tracer can record neither the checks' collectives nor their op
        return
    names, tensors = tensor_inputs(args, kwargs)
    if torch.compiler.is_compiling():  # torch.export's non-strict tracing runs hooks as Python
        _check_in_graph(key, names, tensors)
        return
    checks = _registry.get(key)
    if checks is not None:
        checks.run(names, tensors)


def _pre_forward_in_graph(key: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    _check_in_graph(key, *tensor_inputs(args, kwargs))


@functools.lru_cache(maxsize=None)
def _model_hook():
    """The disabled hook with its substitute, made at the first parallelize, not at import:
    torch.compiler's decorators import torch._dynamo."""
    hook = torch.compiler.disable(_pre_forward)
    torch.compiler.substitute_in_graph(hook)(_pre_forward_in_graph)
    return hook


def install(model: nn.Module, group: dist.ProcessGroup, check_inputs: bool,
            check_replicas_every: int = 0) -> ForwardChecks:
    """Installs the checks on `model`, sharded over `group` (of more than one rank)."""
    checks = ForwardChecks(model, group, check_inputs, check_replicas_every)
    model.register_forward_pre_hook(functools.partial(_model_hook(), checks.key), with_kwargs=True, prepend=True)
    install_ddp_guard(model)
    return checks
