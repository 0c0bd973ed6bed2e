"""The bytes of a rank's parameters, their gradients and their optimizer state under a plan."""

from typing import Dict, Optional, Tuple

import torch

from .memory_plan_reads import held_counts
from ..optim.optimizer_state import state_dtype, uses_master

OPTIMIZERS = ("adamw", "sgd", None)
# State tensors shaped like the parameter, per optimizer (SGD: its momentum buffer).
_MOMENTS = {"adamw": 2, "sgd": 1, None: 0}
_STEP_BYTES = {"adamw": 4, "sgd": 0, None: 0}  # AdamW's float32 step count per parameter


def model_state_bytes(plan, rank: int, dtypes: Dict[str, torch.dtype], trainable: Dict[str, bool],
                      optimizer: Optional[str], master_weights: Optional[bool]) -> Tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes on `rank`."""
    group = {"master_weights": master_weights}
    params = grads = state = 0
    for name, count in held_counts(plan, rank).items():
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
