"""Gradients a model holds from a backward run before parallelize.

parallelize swaps the split layers for sharded ones (whose parameters start without a
gradient) and sums the partial gradients of replicated parameters from the next backward on:
a gradient accumulated before would be dropped for the first and counted again for the
second. A model that has trained is parallelized once its gradients are cleared (zeros are
harmless: they change no sum).
"""

from typing import List

import torch
from torch import nn


def pending_gradients(model: nn.Module) -> List[str]:
    """The names of the parameters holding a nonzero gradient."""
    with torch.no_grad():
        return [name for name, p in model.named_parameters()
                if p.grad is not None and p.grad.device.type != "meta" and bool(p.grad.ne(0).any())]


def check_no_pending_gradients(model: nn.Module) -> None:
    names = pending_gradients(model)
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"parallelize: parameters hold gradients from an earlier backward ({shown}); sharding would drop them "
            "for the split layers and count them again for the replicated parameters. Call "
            "model.zero_grad() (or optimizer.zero_grad()) before parallelize")
