"""SGD whose step is one fused autoshard op per (param group, dtype)."""

from typing import Dict, Optional

import torch

from ..core import ops
from .fused_calls import fused_step
from .fused_optimizer import FusedOptimizer
from .hyperparameters import check_settings
from .optimizer_state import MASTER, new_master, uses_master

_NAME = "SGD"


def _check_hyperparameters(values: Dict, group_index: Optional[int], defaults: Optional[Dict] = None) -> None:
    """Checks the SGD settings present in `values`; `defaults` fill in what a group does not set
    when checking that nesterov has momentum and no dampening."""
    name = check_settings(_NAME, values, group_index, ("lr", "momentum", "weight_decay"), ("nesterov", "maximize"),
                          dict(differentiable=(False, "autoshard.optim.SGD steps in place without autograd")),
                          floats=("dampening",))
    merged = {**(defaults or {}), **values}
    if merged.get("nesterov") and (float(merged["momentum"]) <= 0 or float(merged["dampening"]) != 0):
        raise ValueError(
            f"{_NAME}: {name('nesterov')} needs momentum > 0 and dampening == 0, "
            f"got momentum={merged['momentum']}, dampening={merged['dampening']}"
        )


def _state_rule(group: Dict, state: Optional[Dict], dtype: torch.dtype):
    """Parameters that have a momentum buffer update it; the others write theirs (first step).
    A parameter stepped through a master weight has it once it has any state."""
    master = (MASTER,) if state and uses_master(group, dtype) else ()
    if float(group["momentum"]) == 0 or not state or state.get("momentum_buffer") is None:
        return master, False
    return ("momentum_buffer",) + master, True


class SGD(FusedOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize), stepping each
    (param group, dtype) with one fused multi-tensor op, ``torch.ops.autoshard.fused_sgd_``.

    The state is torch's: a ``momentum_buffer`` per parameter when momentum is not 0, shaped
    like its parameter. The param groups hold every key of ``torch.optim.SGD``'s (``foreach``,
    ``differentiable``, ``fused`` ...), so state dicts load into and from ``torch.optim.SGD``,
    through DCP's ``get_state_dict`` / ``set_state_dict`` as well. ``differentiable`` must be
    False (refused by name otherwise; a loaded state dict's becomes False); ``foreach`` and
    ``fused`` are taken and kept but change nothing, the step being always one fused op. The
    learning rate is read from the param group at every step, so torch's LR schedulers drive
    it. All parameters must be on one device.

    Mixed precision: with ``master_weights=None`` (the default) every bfloat16 or float16
    parameter steps through an fp32 master weight (state ``master``) with an fp32
    ``momentum_buffer``, in one fused op (``fused_sgd_master_``) that writes the parameter as
    the master rounded to nearest even; ``True`` or ``False`` forces it.

    A parameter whose state ``parallelize`` partitioned across data-parallel replicas is
    stepped only in the piece this rank owns, and then all-gathered: its ``momentum_buffer``
    is 1-D, this rank's piece of the flattened parameter (``split_sizes(numel,
    dp_size)[dp_rank]`` elements); ``load_state_dict`` of a buffer shaped like the whole
    parameter keeps this rank's piece.
    """

    _name = _NAME
    _check_hyperparameters = staticmethod(_check_hyperparameters)
    _state_rule = staticmethod(_state_rule)
    _loaded_settings = dict(differentiable=False)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        master_weights: Optional[bool] = None,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused, master_weights=master_weights)
        super().__init__(params, defaults)

    def _step_fused_calls(self, group: Dict, calls: Dict) -> None:
        """One SGD step for each fused call of `group`: one op per (dtype, has buffers)."""
        momentum = float(group["momentum"])
        for (dtype, has_buffers), call in calls.items():
            master = uses_master(group, dtype)
            buffers, masters = [], []
            for key, p in zip(call.keys, call.params):
                if not (master or momentum != 0):
                    continue  # plain SGD without momentum keeps no state
                state = self.state[key]
                if master:
                    if MASTER not in state:
                        state[MASTER] = new_master(p)
                    masters.append(state[MASTER])
                if momentum != 0:
                    if not has_buffers:
                        state["momentum_buffer"] = torch.empty_like(
                            p, dtype=torch.float32 if master else p.dtype, memory_format=torch.preserve_format)
                    buffers.append(state["momentum_buffer"])
            hyperparameters = (float(group["lr"]), momentum, float(group["dampening"]),
                               float(group["weight_decay"]), bool(group["nesterov"]), bool(group["maximize"]),
                               not has_buffers)
            op, weights = (ops.fused_sgd_master_, (masters,)) if master else (ops.fused_sgd_, ())
            fused_step(op, dtype, (call.params, call.grads, *weights, buffers), hyperparameters)
