"""AdamW whose step is one fused autoshard op per (param group, dtype)."""

from typing import Dict, Optional

import torch

from ..core import ops
from .fused_calls import fused_step
from .fused_optimizer import FusedOptimizer
from .hyperparameters import check_at_least, check_settings
from .optimizer_state import MASTER, new_master, scalar_dtype, uses_master

_NAME = "AdamW"


def _check_hyperparameters(values: Dict, group_index: Optional[int], defaults: Optional[Dict] = None) -> None:
    """Checks the AdamW settings present in `values` (all of them for a complete group); no
    check needs `defaults`."""
    # amsgrad is checked at every step too: a loaded state dict of torch's may hold amsgrad=True.
    name = check_settings(_NAME, values, group_index, ("lr", "eps", "weight_decay"), ("maximize",), dict(
        amsgrad=(False, "autoshard.optim.AdamW keeps no running maximum of exp_avg_sq (max_exp_avg_sq)"),
        capturable=(False, "autoshard.optim.AdamW reads each step count on the host, so its step cannot be "
                    "captured in a CUDA graph"),
        differentiable=(False, "autoshard.optim.AdamW steps in place without autograd"),
        decoupled_weight_decay=(True, "AdamW's weight decay is decoupled (torch.optim.Adam's L2 penalty is not "
                                "implemented)")))
    if "betas" in values:
        betas = values["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{_NAME}: {name('betas')} must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            value = check_at_least(_NAME, f"{name('betas')}[{i}]", beta)
            if not value < 1:
                raise ValueError(f"{_NAME}: {name('betas')}[{i}] must be in [0, 1), got {value}")


def _state_rule(group: Dict, state: Optional[Dict], dtype: torch.dtype):
    """A parameter with state has both moments (and its master weight, if it steps through one);
    parameters step together at equal step counts."""
    if not state:
        return (), 1
    step = state.get("step")
    if step is None:
        raise ValueError(f"{_NAME}: a parameter's state has no 'step'")
    keys = ("exp_avg", "exp_avg_sq") + ((MASTER,) if uses_master(group, dtype) else ())
    return keys, (int(step.item()) if isinstance(step, torch.Tensor) else int(step)) + 1


class AdamW(FusedOptimizer):
    """``torch.optim.AdamW`` (decoupled weight decay), stepping each (param group, dtype)
    with one fused multi-tensor op, ``torch.ops.autoshard.fused_adamw_``.

    The state is torch's: ``step`` (a scalar tensor on the host, float32, or float64 under a
    float64 default dtype, as torch.optim makes it), ``exp_avg`` and ``exp_avg_sq``, each shaped
    like its parameter, so a sharded parameter's state is sharded with it. The param groups hold
    every key of ``torch.optim.AdamW``'s (``amsgrad``, ``foreach``, ``capturable``,
    ``differentiable``, ``fused``, ``decoupled_weight_decay`` ...), so state dicts load into and
    from ``torch.optim.AdamW``, through DCP's ``get_state_dict`` / ``set_state_dict`` as well.
    Of those, ``amsgrad``, ``capturable`` and ``differentiable`` must be False (refused by name
    otherwise; ``amsgrad`` also at a step after loading a state dict that has it True);
    ``foreach`` and ``fused`` are taken and kept but change nothing, the step being always one
    fused op. A loaded state dict's ``capturable`` and ``differentiable`` become False and its
    ``decoupled_weight_decay`` True, as torch.optim.AdamW forces the latter on load. The
    learning rate is read from the param group at every step, so torch's LR schedulers drive
    it. All parameters must be on one device.

    Mixed precision: with ``master_weights=None`` (the default) every bfloat16 or float16
    parameter steps through an fp32 master weight, and float32 ones do not; ``True`` or
    ``False`` forces it (``True`` for bf16, fp16 or fp32 parameters). Such a parameter's state
    also holds ``master`` (fp32, shaped like the parameter), and its ``exp_avg`` and
    ``exp_avg_sq`` are fp32: one fused op (``fused_adamw_master_``) reads the 16-bit gradient,
    updates master and moments in fp32 and writes the parameter as the master rounded to
    nearest even. Memory per parameter is 2 bytes (bf16 weight) + 4 (master) + 8 (moments) =
    14 bytes of weights and state, against 12 for fp32 training and 6 for bf16 without masters;
    updates smaller than half a bf16 ulp accumulate in the master instead of being lost.

    A parameter whose state ``parallelize`` partitioned across data-parallel replicas is
    stepped only in the piece this rank owns, and then all-gathered: its ``exp_avg`` and
    ``exp_avg_sq`` are 1-D, of ``split_sizes(numel, dp_size)[dp_rank]`` elements (this
    rank's piece of the flattened parameter), and so are they in ``state_dict()``. Such a
    state dict loads back on the same dp rank of the same dp size; ``load_state_dict`` of one
    whose tensors are shaped like whole parameters (``torch.optim.AdamW``'s, or one saved
    without partitioning) keeps this rank's piece of each.
    """

    _name = _NAME
    _check_hyperparameters = staticmethod(_check_hyperparameters)
    _state_rule = staticmethod(_state_rule)
    _loaded_settings = dict(capturable=False, differentiable=False, decoupled_weight_decay=True)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        master_weights: Optional[bool] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=True, master_weights=master_weights)
        super().__init__(params, defaults)

    def _step_fused_calls(self, group: Dict, calls: Dict) -> None:
        """One AdamW step for each fused call of `group`: one op per (dtype, step count)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        for (dtype, step), call in calls.items():
            master = uses_master(group, dtype)
            exp_avgs, exp_avg_sqs, masters, steps = [], [], [], []
            for key, p, state in zip(call.keys, call.params, call.states):
                if not state:
                    state = self.state[key]
                    state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                    for moment in ("exp_avg", "exp_avg_sq"):
                        state[moment] = torch.zeros_like(p, dtype=torch.float32 if master else p.dtype,
                                                         memory_format=torch.preserve_format)
                    if master:
                        state[MASTER] = new_master(p)
                elif not isinstance(state["step"], torch.Tensor):
                    state["step"] = torch.tensor(float(state["step"]), dtype=scalar_dtype())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if master:
                    masters.append(state[MASTER])
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
            hyperparameters = (float(group["lr"]), beta1, beta2, float(group["weight_decay"]),
                               float(group["eps"]), step, bool(group["maximize"]))
            op, weights = (ops.fused_adamw_master_, (masters,)) if master else (ops.fused_adamw_, ())
            fused_step(op, dtype, (call.params, call.grads, *weights, exp_avgs, exp_avg_sqs), hyperparameters)
