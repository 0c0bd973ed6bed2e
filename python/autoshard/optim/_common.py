"""What AdamW and SGD share: hyperparameter checks, and gathering a step's tensors into one
fused call per (param group, dtype, ...) after checking all of them, so that a bad
parameter raises before any parameter or state has changed.

All parameters of one optimizer live on one device. A parameter whose state is partitioned
across data-parallel replicas (optimizer_partition) is stepped through its owned piece: the
piece of the parameter, the same piece of its gradient, and state tensors of that piece's
shape; after the step, every replica's pieces are all-gathered."""

import numbers
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

from ..runtime.fully_sharded import local_tensor
from ..runtime.nonfinite import agreements_for
from ..state.optimizer_views import local_state_dict
from ..runtime.optimizer_partition import all_gather_pieces, piece_of

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)
# What a parameter may have an fp32 master of: a float64 one would lose precision.
_MASTERABLE = (torch.float32, torch.float16, torch.bfloat16)
MASTER = "master"  # the state key of a parameter's fp32 master weight


def check_master_weights(optimizer: str, name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be None (on for bf16/fp16 parameters), True or False, "
                        f"got {value!r}")


def uses_master(group: Dict, dtype: torch.dtype) -> bool:
    """Whether parameters of `dtype` in `group` step through an fp32 master weight."""
    master_weights = group.get("master_weights")
    if master_weights is None:
        return dtype in _HALF
    return bool(master_weights) and dtype in _MASTERABLE


def state_dtype(group: Dict, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state tensors of a parameter of `dtype`: fp32 with a master weight."""
    return torch.float32 if uses_master(group, dtype) else dtype


def check_masterable(optimizer: str, param_group: Dict, group_index: int) -> None:
    """master_weights=True needs bf16, fp16 or fp32 parameters (checked as the group joins)."""
    if param_group.get("master_weights") is not True:
        return
    for param_index, p in enumerate(param_group.get("params", [])):
        if isinstance(p, tuple) and len(p) == 2:
            p = p[1]
        if isinstance(p, torch.Tensor) and p.dtype not in _MASTERABLE:
            raise TypeError(f"{optimizer}: master_weights=True needs bfloat16, float16 or float32 parameters, but "
                            f"{param_name(group_index, param_index)} has dtype {p.dtype}")


def new_master(target: torch.Tensor) -> torch.Tensor:
    """An fp32 master weight of the stepped tensor (a parameter or its owned piece)."""
    return torch.empty_like(target, dtype=torch.float32, memory_format=torch.preserve_format).copy_(target)


def hyperparameter_name(key: str, group_index) -> str:
    """``lr`` for an optimizer default, ``param_groups[1]['lr']`` for a group's own value."""
    return key if group_index is None else f"param_groups[{group_index}][{key!r}]"


def as_float(optimizer: str, name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{optimizer}: {name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{optimizer}: {name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_at_least(optimizer: str, name: str, value, minimum: float = 0.0) -> float:
    number = as_float(optimizer, name, value)
    if not number >= minimum:  # also rejects nan
        raise ValueError(f"{optimizer}: {name} must be >= {minimum:g}, got {number}")
    return number


def check_bool(optimizer: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be a bool, got {type(value).__name__}")
    return value


def check_none_or_bool(optimizer: str, name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{optimizer}: {name} must be None, True or False, got {value!r}")


def check_only(optimizer: str, name: str, value, supported: bool, why: str) -> None:
    """A setting of torch's that autoshard's optimizer keeps in its param groups (so that state
    dicts move between them) but runs with one value only."""
    check_bool(optimizer, name, value)
    if value is not supported:
        raise ValueError(f"{optimizer}: {name}={value} is not supported: {why}; only {name}={supported} is")


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives a host-side ``step`` tensor (float64 under a float64 default
    dtype), so that a state dict's ``step`` is the same tensor either optimizer would make."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def param_name(group_index: int, param_index: int) -> str:
    return f"param_groups[{group_index}]['params'][{param_index}]"


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


class FusedCall:
    """Parameters that step together in one fused op, with their gradients and states.
    `params` are the tensors stepped: a parameter, or the owned piece of a partitioned one;
    `keys` the parameters themselves, which key the optimizer state."""

    __slots__ = ("keys", "params", "grads", "states")

    def __init__(self) -> None:
        self.keys: List[torch.Tensor] = []
        self.params: List[torch.Tensor] = []
        self.grads: List[torch.Tensor] = []
        self.states: List[Dict] = []


# (group, group_index) -> None, raising for bad settings
GroupCheck = Callable[[Dict, int], None]
# (group, param state or None, param dtype) -> (state tensors it must have, what else splits fused calls)
StateRule = Callable[[Dict, Optional[Dict], torch.dtype], Tuple[Tuple[str, ...], Hashable]]


def gather_fused_calls(
    optimizer: str, param_groups: List[Dict], state: Dict, check_group: GroupCheck, state_rule: StateRule
) -> Tuple[List[Tuple[Dict, Dict[Hashable, FusedCall]]], List[torch.Tensor]]:
    """For every group, its parameters with gradients sorted into fused calls of one dtype (and
    whatever else state_rule says must match); and the partitioned parameters among them, for
    finish_step. Checks every group, gradient and state first; changes nothing."""
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
            call = calls.get((dtype, extra))
            if call is None:
                call = calls[(dtype, extra)] = FusedCall()
            call.keys.append(p)
            call.params.append(target)
            call.grads.append(grad if piece is None else piece.of(grad))
            call.states.append(param_state)
            if piece is not None:
                partitioned.append(p)
        plan.append((group, calls))
    return plan, partitioned


def local_tensors(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """What a fused op steps: this rank's piece of each of FSDP's DTensors (fully_shard over "dp"),
    in place; the tensor itself otherwise. States are kept as DTensors like their parameters, as
    torch.optim keeps them, so that the state dict describes them as FSDP does."""
    return [local_tensor(t) for t in tensors]


def finish_step(partitioned: List[torch.Tensor]) -> None:
    """After the owned pieces of partitioned parameters were stepped: every replica gets the
    whole parameters back."""
    if partitioned:
        all_gather_pieces(partitioned)


def load_state_dict_keeping_masters(optimizer: torch.optim.Optimizer, state_dict: Dict, load: Callable) -> None:
    """torch's Optimizer.load_state_dict (`load`) casts every floating state tensor to its
    parameter's dtype, which would round fp32 master weights and states to bf16: those of
    parameters stepped through a master weight are set aside and put back as saved."""
    # The state dict as this rank holds it (its own shards), before anything reads it.
    state_dict = local_state_dict(optimizer, state_dict)
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    saved_state = state_dict.get("state") if isinstance(state_dict, dict) else None
    kept = []
    if isinstance(saved_groups, list) and isinstance(saved_state, dict) and len(saved_groups) == len(optimizer.param_groups):
        for group, saved_group in zip(optimizer.param_groups, saved_groups):
            settings = {**group, **{k: v for k, v in saved_group.items() if k != "params"}}
            for saved_id, p in zip(saved_group.get("params", []), group["params"]):
                if not uses_master(settings, p.dtype):
                    continue
                for key, value in saved_state.get(saved_id, {}).items():
                    if key != "step" and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                        kept.append((p, key, value))
    settings_before = [group.get("master_weights") for group in optimizer.param_groups]
    load(state_dict)
    # A state dict of torch.optim's has no master_weights: the groups keep their own.
    for group, before in zip(optimizer.param_groups, settings_before):
        group.setdefault("master_weights", before)
    for p, key, value in kept:
        optimizer.state[p][key] = value.to(device=p.device, copy=True)
    conform_master_state(optimizer)


def conform_master_state(optimizer: torch.optim.Optimizer) -> None:
    """After a load: a parameter stepped through a master weight whose state was saved without
    one (by torch.optim, or with master_weights=False) gets one from its current value, and fp32
    states; one stepped without drops a saved master and keeps states of its own dtype."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            param_state = optimizer.state.get(p)
            if not param_state:
                continue
            master = uses_master(group, p.dtype)
            if master and MASTER not in param_state:
                piece = piece_of(p)
                param_state[MASTER] = new_master(p.detach() if piece is None else piece.of(p.detach()))
            elif not master:
                param_state.pop(MASTER, None)
            step = param_state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                # torch.optim keeps it on the device when fused or capturable; the step count is
                # read on the host at every step here, which would sync once per parameter.
                param_state["step"] = step.to("cpu")
            wanted = state_dtype(group, p.dtype)
            for key, value in param_state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and value.dtype != wanted:
                    param_state[key] = value.to(wanted)


def keep_owned_pieces(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: a partitioned parameter's state tensors shaped like the whole
    parameter (saved by torch.optim or without partitioning) keep only this rank's piece."""
    for p, param_state in optimizer.state.items():
        piece = piece_of(p)
        if piece is None:
            continue
        for key, value in param_state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape:
                param_state[key] = piece.of(value.contiguous()).clone()


def as_real(tensors: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """Complex tensors are stepped as pairs of reals, as torch.optim does."""
    return [torch.view_as_real(t) for t in tensors] if dtype.is_complex else tensors


class FusedOptimizer(torch.optim.Optimizer):
    """What AdamW and SGD share as optimizers: checking the defaults and each param group as it
    joins, loading a state dict, and a step that gathers and checks every fused call before
    making any.

    A subclass sets `_name` (for messages), `_check_hyperparameters(values, group_index,
    defaults)` (the settings present in `values`; `defaults` fill in what a group does not set)
    and `_state_rule` (see StateRule, as staticmethods), and steps one group's fused calls in
    `_step_fused_calls(group, calls)`. `_loaded_settings` are the settings a loaded group always
    takes (see conform_loaded_groups)."""

    _name: str
    _loaded_settings: Dict = {}

    def __init__(self, params, defaults: Dict) -> None:
        self._check_hyperparameters(defaults, None)
        super().__init__(params, defaults)
        # Hooks that agree, at the end of each backward, on which replicated gradients are not
        # finite on which tensor-parallel rank (runtime/nonfinite.py), installed before the first backward.
        agreements_for(self._all_params())

    def _all_params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for agreement in agreements_for(self._all_params()):
            agreement.forget()

    def add_param_group(self, param_group: Dict) -> None:
        if isinstance(param_group, dict):
            self._check_hyperparameters(param_group, len(self.param_groups), self.defaults)
            check_one_device(self._name, self.param_groups, param_group)
            check_masterable(self._name, {**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)

    def state_dict(self) -> Dict:
        """torch's state_dict, without ``master_weights`` where it is None (the default): a
        group then holds exactly torch.optim's keys, so that DCP, which loads the keys of the
        loading optimizer's own state dict, finds all of them in a checkpoint of torch.optim's.
        A loading autoshard optimizer keeps its own master_weights where none was saved."""
        state = super().state_dict()
        groups = [{k: v for k, v in group.items() if not (k == "master_weights" and v is None)}
                  for group in state["param_groups"]]
        return {**state, "param_groups": groups}

    def __setstate__(self, state: Dict) -> None:
        # torch's load_state_dict ends here with the saved groups, as do unpickling and deepcopy.
        super().__setstate__(state)
        self.conform_loaded_groups()

    def conform_loaded_groups(self) -> None:
        """Groups that came from a state dict: torch's switches missing from it (amsgrad,
        nesterov, foreach ...: one saved before they were kept) get their defaults, and
        `_loaded_settings` their only value here. capturable and differentiable say how torch's
        optimizer ran, not what its state is: refusing them at the next step would refuse a
        state that continues correctly here. decoupled_weight_decay becomes True as
        torch.optim.AdamW makes it on load."""
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key != "master_weights" and (value is None or isinstance(value, bool)):
                    group.setdefault(key, value)
            group.update(self._loaded_settings)

    def load_state_dict(self, state_dict: Dict) -> None:
        """torch's load_state_dict, keeping fp32 master weights and states fp32 (a state saved
        without master weights gets them); a partitioned parameter keeps only its own piece of
        state tensors saved whole (see the class docstring)."""
        load_state_dict_keeping_masters(self, state_dict, super().load_state_dict)
        keep_owned_pieces(self)

    def conform_loaded_state(self) -> None:
        """After a state was put in place from elsewhere (autoshard.checkpoint.load): master
        weights and fp32 states where master_weights asks for them, none where it does not; the
        groups' settings as conform_loaded_groups makes them."""
        self.conform_loaded_groups()
        conform_master_state(self)

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan, partitioned = gather_fused_calls(self._name, self.param_groups, self.state,
                                               self._check_hyperparameters, self._state_rule)
        # A replicated gradient that is not finite on some tensor-parallel ranks only: every rank
        # raises alike, before anything is stepped (the ranks agreed on it in backward).
        stepped = [p for _, calls in plan for call in calls.values() for p in call.keys]
        for agreement in agreements_for(self._all_params()):
            agreement.check(stepped)
        for group, calls in plan:
            self._step_fused_calls(group, calls)
        finish_step(partitioned)
        return loss

    def _step_fused_calls(self, group: Dict, calls: Dict[Hashable, FusedCall]) -> None:
        """One parameter group's step, one fused op per call: what each optimizer (AdamW, SGD)
        defines for itself; the base class has no step of its own."""
        raise NotImplementedError(f"{type(self).__name__} defines no _step_fused_calls")
