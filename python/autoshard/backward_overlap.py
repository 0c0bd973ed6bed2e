"""Overlap in backward: the input-gradient all-reduce of column layers runs while their
weight gradients are computed (``parallelize(..., overlap_backward=True)``).

Without it, a column layer's matmul node computes the input's and the weight's gradients
together, and the input copy's node then all-reduces the input's gradient and waits for it:
nothing computes while the collective runs. With it, a tensor copied into the parallel region
passes two nodes, made in forward before the layers that read the copy::

    x -> GradientsAfterReduce(x, weights and biases of the readers) -> ReduceStarts -> copy

and each reader's matmul computes only its input's gradient in backward, keeping its output
gradient and input for later. Backward then runs the readers' nodes, then ``ReduceStarts``
(every reader's input gradient summed by autograd, as before), which starts the all-reduce and
returns, then ``GradientsAfterReduce``, which computes every reader's weight and bias gradient
while the collective is in flight, waits for it, and returns the summed input gradient and the
parameter gradients through autograd's own edges (hooks, ``torch.autograd.grad``, DDP and
``.grad`` accumulation see them as usual). Autograd runs ready nodes newest first, so any other
node that is ready in between (a residual branch) runs during the collective too.

The gradients are computed by the formulas of ``F.linear``'s own backward and the collective
sums the same bytes, so the result is bit-identical to the path without overlap (tested). The
same number of all-reduces is issued, through ``all_reduce_bucket``, so ``CommCounter`` counts
them. Only column layers whose product is one plain ``F.linear`` on the copy defer their weight
gradient; other readers of a shared copy (convolutions, einsum, LoRA factors) compute theirs in
their own nodes as before. Under autocast, with sequence parallelism (the copy is a gather of the
tokens) and in double backward, layers take the path without overlap, or say why they cannot.
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import ops
from .comm import wait


class _Overlap:
    """One copy's backward in one forward: its readers' parameters, what their matmul nodes
    kept for the weight gradients, and the all-reduce in flight."""

    def __init__(self, group_name: str, readers: Sequence[torch.nn.Module]):
        self.group_name = group_name
        self.readers = list(readers)
        # reader -> [(output gradient [n, out], input [n, in]), ...], one per call of the reader
        self.kept: Dict[int, List[tuple]] = {}
        self.reduced: Optional[torch.Tensor] = None

    def parameters(self) -> List[torch.Tensor]:
        """The readers' weights and biases, in order, that need a gradient."""
        found = []
        for layer in self.readers:
            found.extend(p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad)
        return found

    def keep(self, layer: torch.nn.Module, grad: torch.Tensor, x: torch.Tensor) -> None:
        self.kept.setdefault(id(layer), []).append((grad, x))

    def start(self, grad: torch.Tensor) -> None:
        self.reduced = ops.all_reduce_bucket([grad], self.group_name, True)

    def parameter_gradients(self) -> List[Optional[torch.Tensor]]:
        """Each reader's weight and bias gradient, as F.linear's backward computes them (None
        for a reader whose output took no part in the loss)."""
        grads = []
        for layer in self.readers:
            weight_grad = bias_grad = None
            for grad, x in self.kept.pop(id(layer), ()):
                # F.linear's backward: the weight of [out, in] gets (grad^T x), one stored as
                # [in, out] (transformers' Conv1D) gets (x^T grad); the bias the sum over rows.
                w = x.t().mm(grad) if layer.transposed_weight else grad.t().mm(x)
                weight_grad = w if weight_grad is None else weight_grad + w
                if layer.bias is not None:
                    b = grad.sum(0)
                    bias_grad = b if bias_grad is None else bias_grad + b
            for param, value in ((layer.weight, weight_grad), (layer.bias, bias_grad)):
                if param is not None and param.requires_grad:
                    grads.append(value)
        return grads

    def summed_input_gradient(self, like: torch.Tensor) -> torch.Tensor:
        reduced, self.reduced = self.reduced, None
        return wait(reduced).view(like.shape)


class GradientsAfterReduce(torch.autograd.Function):
    """Forward: x as it is. Backward: the readers' parameter gradients, computed while the
    all-reduce that ReduceStarts began is in flight, then the summed gradient of x."""

    @staticmethod
    def forward(ctx, overlap: _Overlap, x: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.overlap = overlap
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        overlap = ctx.overlap
        parameter_grads = overlap.parameter_gradients()
        return (None, overlap.summed_input_gradient(grad), *parameter_grads)


class ReduceStarts(torch.autograd.Function):
    """Forward: a contiguous copy of x (copy_to_parallel's). Backward: starts the all-reduce of
    the gradient, which GradientsAfterReduce waits for."""

    @staticmethod
    def forward(ctx, overlap: _Overlap, x: torch.Tensor) -> torch.Tensor:
        ctx.overlap = overlap
        return x.clone(memory_format=torch.contiguous_format)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        ctx.overlap.start(grad)
        return None, grad


class ProductWeightLater(torch.autograd.Function):
    """F.linear(x, weight, bias) whose backward computes the input's gradient only, keeping
    what the weight's gradient needs for GradientsAfterReduce."""

    @staticmethod
    def forward(ctx, overlap: _Overlap, layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.overlap, ctx.layer = overlap, layer
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        flat = x.reshape(-1, x.shape[-1])
        ctx.overlap.keep(ctx.layer, rows, flat)
        return None, None, rows.mm(weight).view(x.shape), None, None


def copy(x: torch.Tensor, group_name: str, readers: Sequence[torch.nn.Module]) -> torch.Tensor:
    """x copied into the parallel region for `readers` (column layers), with their weight
    gradients computed during the input gradient's all-reduce; copy_to_parallel where that does
    not apply (no gradient to x, autocast)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or torch.is_autocast_enabled(x.device.type):
        return ops.copy_to_parallel(x, group_name)
    overlap = _Overlap(group_name, readers)
    entered = ReduceStarts.apply(overlap, GradientsAfterReduce.apply(overlap, x, *overlap.parameters()))
    entered._autoshard_overlap = overlap
    return entered


def product(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
            bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`layer`'s F.linear(x, weight, bias) with its weight gradient deferred, where x is a copy
    made by copy() for it; None otherwise."""
    overlap = getattr(x, "_autoshard_overlap", None)
    if overlap is None or all(reader is not layer for reader in overlap.readers):
        return None
    return ProductWeightLater.apply(overlap, layer, x, weight.detach(), None if bias is None else bias.detach())


def enable(model: torch.nn.Module) -> int:
    """Turns overlap on for every column-parallel Linear of `model` whose input is copied (not
    gathered by sequence parallelism); returns how many."""
    from .input_copies import SharedInputCopy
    from .nn.linear import ColumnParallelLinear

    count = 0
    for module in model.modules():
        if not isinstance(module, ColumnParallelLinear) or module._world == 1 or not module.plain_product:
            continue
        shared = module.input_copy
        if shared is None:
            module.overlap_readers = [module]
        elif isinstance(shared, SharedInputCopy) and shared.enter is None:
            shared.overlap_readers.append(module)
        else:
            continue
        count += 1
    return count
