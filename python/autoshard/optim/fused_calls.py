"""Gathering a step's tensors into one fused call per (param group, dtype, ...) after checking all
of them, so that a bad parameter raises before any parameter or state has changed.

All parameters of one optimizer live on one device. A parameter whose state is partitioned
across data-parallel replicas (optimizer_partition) is stepped through its owned piece: the
piece of the parameter, the same piece of its gradient, and state tensors of that piece's
shape; after the step, every replica's pieces are all-gathered."""

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

from ..runtime.fully_sharded import local_tensor
from ..runtime.optimizer_partition import piece_of
from .hyperparameters import param_name
from .optimizer_state import state_dtype

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _raise_for_gradient(optimizer: str, p: torch.Tensor, name: str) -> None:
    grad = p.grad
    if grad.is_sparse:
        raise TypeError(f"{optimizer}: {name}.grad is sparse; {optimizer} needs dense gradients")
    if grad.device != p.device:
        raise ValueError(f"{optimizer}: {name}.grad is on {grad.device} but the parameter is on {p.device}")
    if grad.dtype != p.dtype:
        raise TypeError(f"{optimizer}: {name}.grad has dtype {grad.dtype} but the parameter has dtype {p.dtype}")
    raise TypeError(f"{optimizer}: {name} must be a floating-point or complex tensor, got {p.dtype}")


def _raise_for_state(optimizer: str, p: torch.Tensor, name: str, key: str, value, partitioned: bool,
                     dtype: torch.dtype) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{optimizer}: the state of {name} has no tensor {key!r} (got {type(value).__name__})")
    if value.device != p.device:
        raise ValueError(f"{optimizer}: state {key!r} of {name} is on {value.device} but the parameter is on {p.device}")
    if value.dtype != dtype:
        why = "" if dtype == p.dtype else f" (the parameter is {p.dtype}, stepped through an fp32 master weight)"
        raise TypeError(f"{optimizer}: state {key!r} of {name} has dtype {value.dtype} but must have dtype {dtype}{why}")
    what = "this rank's piece of the parameter (its state is partitioned)" if partitioned else "the parameter"
    raise ValueError(
        f"{optimizer}: state {key!r} of {name} has shape {tuple(value.shape)} but {what} has shape {tuple(p.shape)}"
    )


def _raise_for_devices(optimizer: str, first: Tuple[str, torch.device], other: Tuple[str, torch.device]) -> None:
    raise ValueError(f"{optimizer}: all parameters must be on one device, but {first[0]} is on {first[1]} "
                     f"and {other[0]} is on {other[1]}")


def check_one_device(optimizer: str, param_groups: List[Dict], param_group: Dict) -> None:
    """Before `param_group` joins `param_groups`: its parameters are on the device of all the
    others. Makes its "params" a list, as torch.optim.Optimizer.add_param_group would."""
    params = param_group.get("params")
    if isinstance(params, torch.Tensor):
        param_group["params"] = [params]
    elif params is not None and not isinstance(params, set):  # torch rejects sets itself
        param_group["params"] = list(params)
    else:
        return
    first = None
    groups = list(param_groups) + [param_group]
    for group_index, group in enumerate(groups):
        for param_index, p in enumerate(group["params"]):
            if isinstance(p, tuple) and len(p) == 2:  # named parameters: (name, tensor)
                p = p[1]
            if not isinstance(p, torch.Tensor):
                continue  # torch names what is not a tensor
            if first is None:
                first = (param_name(group_index, param_index), p.device)
            elif p.device != first[1]:
                _raise_for_devices(optimizer, first, (param_name(group_index, param_index), p.device))


@dataclass
class FusedCall:
    """Parameters that step together in one fused op, with their gradients and states.
    `params` are the tensors stepped: a parameter, or the owned piece of a partitioned one;
    `keys` the parameters themselves, which key the optimizer state."""

    keys: List[torch.Tensor] = field(default_factory=list)
    params: List[torch.Tensor] = field(default_factory=list)
    grads: List[torch.Tensor] = field(default_factory=list)
    states: List[Dict] = field(default_factory=list)


# (group, group_index) -> None, raising for bad settings
GroupCheck = Callable[[Dict, int], None]
# (group, param state or None, param dtype) -> (state tensors it must have, what else splits fused calls)
StateRule = Callable[[Dict, Optional[Dict], torch.dtype], Tuple[Tuple[str, ...], Hashable]]


def gather_fused_calls(
    optimizer: str, param_groups: List[Dict], state: Dict, check_group: GroupCheck, state_rule: StateRule
) -> Tuple[List[Tuple[Dict, Dict[Hashable, FusedCall]]], List[torch.Tensor]]:
    """For every group, its parameters with gradients sorted into fused calls of one dtype (and
    whatever else state_rule says must match); and the partitioned parameters among them, for
    the all-gather after the step. Checks every group, gradient and state first; changes nothing."""
    plan, partitioned = [], []
    first = None
    for group_index, group in enumerate(param_groups):
        check_group(group, group_index)
        calls: Dict[Hashable, FusedCall] = {}
        for param_index, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            device, dtype = p.device, p.dtype
            if first is None:
                first = (param_name(group_index, param_index), device)
            elif device != first[1]:
                _raise_for_devices(optimizer, first, (param_name(group_index, param_index), device))
            if grad.is_sparse or grad.device != device or grad.dtype != dtype or not (dtype in _FLOATING or dtype.is_complex):
                _raise_for_gradient(optimizer, p, param_name(group_index, param_index))
            piece = piece_of(p)
            target = p if piece is None else piece.of(p.detach())
            param_state = state.get(p)
            keys, extra = state_rule(group, param_state, dtype)
            expected = state_dtype(group, dtype)
            for key in keys:
                value = param_state.get(key)
                if not (isinstance(value, torch.Tensor) and value.device == device and value.dtype == expected
                        and value.shape == target.shape):
                    _raise_for_state(optimizer, target, param_name(group_index, param_index), key, value,
                                     piece is not None, expected)
            call = calls.setdefault((dtype, extra), FusedCall())
            call.keys.append(p)
            call.params.append(target)
            call.grads.append(grad if piece is None else piece.of(grad))
            call.states.append(param_state)
            if piece is not None:
                partitioned.append(p)
        plan.append((group, calls))
    return plan, partitioned


def fused_step(op: Callable, dtype: torch.dtype, tensors: Tuple[List[torch.Tensor], ...],
               hyperparameters: tuple) -> None:
    """`op` (a fused op) over `tensors`, lists of the tensors it steps for parameters of `dtype`.
    It steps this rank's piece of each of FSDP's DTensors (fully_shard over "dp"), in place; the
    tensor itself otherwise. States are kept as DTensors like their parameters, as torch.optim
    keeps them, so that the state dict describes them as FSDP does. Complex tensors are stepped as
    pairs of reals, as torch.optim does (a parameter stepped through a master weight is real)."""
    real = torch.view_as_real if dtype.is_complex else lambda t: t
    op(*([real(local_tensor(t)) for t in each] for each in tensors), *hyperparameters)
