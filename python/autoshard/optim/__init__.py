"""Optimizers whose steps are fused multi-tensor autoshard ops over the local tensors (a rank's
shards): ``AdamW`` and ``SGD``, drop-in for their ``torch.optim`` namesakes."""

from .adamw import AdamW
from .sgd import SGD

__all__ = ["AdamW", "SGD"]
