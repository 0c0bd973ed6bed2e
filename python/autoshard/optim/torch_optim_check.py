"""Refuses a torch.optim optimizer that steps parameters whose optimizer state autoshard
partitions over the data-parallel replicas (optimizer_partition).

Such a parameter's gradient holds, after backward, the average of this rank's piece only
(zeros elsewhere), and only autoshard's optimizers know to step that piece and all-gather
the pieces afterwards. torch.optim's optimizers (and any other torch.optim.Optimizer) step
every element, so the replicas drift apart, silently. A global optimizer step pre-hook,
registered once a model has partitioned parameters, raises before such a step changes
anything, naming the two ways out.
"""

from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.parallel_state import parameter_state
from ..runtime.optimizer_partition import piece_of
from . import SGD, AdamW

_handle = None
_epoch = 0  # how many times install() was called: a checked optimizer is checked again after it


def _autoshard_optimizer(optimizer) -> bool:
    """Whether `optimizer`, or the optimizer it wraps (accelerate's AcceleratedOptimizer holds
    it as .optimizer), is one of autoshard's."""
    for _ in range(4):
        if isinstance(optimizer, (AdamW, SGD)):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


def _name_of(param: torch.Tensor) -> Optional[str]:
    model = getattr(parameter_state(param), "model", None)
    return None if model is None else next((name for name, p in model.named_parameters() if p is param), None)


def _before_step(optimizer, args, kwargs) -> None:
    layout = (_epoch,) + tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
    if optimizer.__dict__.get("_autoshard_checked_layout") == layout:
        return  # the same parameters as at a step already checked
    if not _autoshard_optimizer(optimizer):
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if piece_of(param) is None:
                    continue
                name = _name_of(param)
                which = f"param_groups[{g}]['params'][{i}]" + (f" ({name})" if name else "")
                cls = type(optimizer)
                raise ValueError(
                    f"{cls.__module__}.{cls.__qualname__}: {which} belongs to a model parallelized over a "
                    "('dp', 'tp') DeviceMesh whose optimizer state is partitioned over 'dp' "
                    "(parallelize(model, mesh=mesh) with partition_optimizer_state=True, the default): after "
                    "backward its gradient holds only this rank's piece, which only autoshard's optimizers step "
                    "and all-gather. Use autoshard.optim.AdamW or autoshard.optim.SGD, or call parallelize(model, "
                    "mesh=mesh, partition_optimizer_state=False) to keep this optimizer. Nothing was stepped")
    optimizer.__dict__["_autoshard_checked_layout"] = layout


def install() -> None:
    """Registers the check (once per process), and has every optimizer checked again at its
    next step: a parameter it steps may just have been partitioned."""
    global _handle, _epoch
    _epoch += 1
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)
