"""Functions over sharded tensors: ``autoshard.nn.functional``.

``vocab_parallel_cross_entropy`` is torch's ``cross_entropy`` for logits whose vocabulary
dimension is split across the ranks of a group: no rank ever holds the whole logits.
"""

import operator
from typing import Optional

import torch

from ..core import ops
from ..core.distributed import ProcessGroup, group_name

_REDUCTIONS = ("mean", "sum", "none")


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor,
                                 group: Optional[ProcessGroup] = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(full_logits.view(-1, V), labels.view(-1), ...)``
    computed from this rank's vocabulary shard of the logits.

    ``logits_shard`` is ``[..., V_local]``: rank r of ``group`` (None: the default
    tensor-parallel group) holds the contiguous columns ``split_sizes(V, world_size)[r]`` after
    those of the ranks before it (as a column-parallel output head produces them). ``labels`` is
    ``[...]`` (logits' shape without the last dimension) of global class ids in ``[0, V)`` or
    ``ignore_index``, the same on every rank; V is learned from the group. The result is a
    scalar for ``"mean"`` and ``"sum"``, ``[labels.numel()]`` for ``"none"``, in logits' dtype
    (computed in float32 for bf16 and fp16, in float64 for float64); it is the same on every
    rank. An all-ignored batch gives nan for ``"mean"``, as torch does.

    Forward issues three all-reduces of one value per row (row maximum, sum of exponentials,
    target logit and, with ``label_smoothing``, the sum of the logits); backward none. Every
    rank of the group must call it with the same labels and arguments."""
    if not isinstance(logits_shard, torch.Tensor):
        raise TypeError(f"vocab_parallel_cross_entropy: logits_shard must be a torch.Tensor, "
                        f"got {type(logits_shard).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"vocab_parallel_cross_entropy: labels must be a torch.Tensor, got {type(labels).__name__}")
    try:
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"vocab_parallel_cross_entropy: ignore_index must be an int, "
                        f"got {type(ignore_index).__name__}") from None
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"vocab_parallel_cross_entropy: label_smoothing must be a float in [0, 1], "
                        f"got {type(label_smoothing).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    loss, _, _ = ops.vocab_parallel_cross_entropy(logits_shard, labels, group_name(group), ignore_index,
                                                  float(label_smoothing), reduction)
    return loss
