"""Overlap in backward: the input-gradient all-reduce of column layers runs while their
weight gradients are computed (``parallelize(..., overlap_backward=True)``, the default).

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
their own nodes as before. With sequence parallelism the copy is a gather of the tokens and the
collective in flight is the reduce-scatter of its gradient. Under autocast and under
torch.compile layers take the path without overlap; double backward through a deferred layer
raises.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from ..core import ops
from ..core.comm import wait


class _Overlap:
    """One copy's backward in one forward: its readers' parameters, what their matmul nodes
    kept for the weight gradients, and the all-reduce in flight."""

    def __init__(self, group_name: str, readers: Sequence[torch.nn.Module], tokens: Optional[Tuple[int, int]] = None):
        self.group_name = group_name
        self.readers = list(readers)
        # With sequence parallelism, (dim, length) of the tokens gathered in forward, whose
        # gradient backward reduce-scatters; None: a copy, whose gradient is all-reduced.
        self.tokens = tokens
        # reader -> [(output gradient [n, out], input [n, in]), ...], one per call of the reader
        self.kept: Dict[int, List[tuple]] = {}
        self.reduced: Optional[torch.Tensor] = None
        self.finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Forward's copy of x (copy_to_parallel's), or every rank's tokens of it."""
        if self.tokens is None:
            return x.clone(memory_format=torch.contiguous_format)
        dim, length = self.tokens
        return ops.all_gather_from_sequence(x, dim, length, self.group_name)

    def parameters(self) -> List[torch.Tensor]:
        """The readers' weights and biases, in order, that need a gradient."""
        found = []
        for layer in self.readers:
            found.extend(p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad)
        return found

    def keep(self, layer: torch.nn.Module, grad: torch.Tensor, x: torch.Tensor) -> None:
        self.kept.setdefault(id(layer), []).append((grad, x))

    def start(self, grad: torch.Tensor) -> None:
        """Starts the collective of x's gradient: all_reduce_bucket for a copy; for gathered
        tokens, reduce_scatter_to_sequence's steps with the reduce-scatter started only."""
        if self.tokens is None:
            shape = grad.shape
            self.reduced = ops.all_reduce_bucket([grad], self.group_name, True)
            self.finish = lambda reduced: reduced.view(shape)
            return
        dim = self.tokens[0] % grad.dim()
        front = grad.movedim(dim, 0).contiguous()
        if front.numel() == 0:
            # Nothing to overlap: the op itself, nothing in flight.
            self.reduced, self.finish = None, lambda _: ops.reduce_scatter_to_sequence(grad, dim, self.group_name)
            return
        group = c10d._resolve_process_group(self.group_name)
        tokens = ops.split_sizes(front.size(0), group.size())
        per_token = front.numel() // front.size(0)
        local_shape = (tokens[group.rank()],) + tuple(front.shape[1:])
        self.reduced = ops.reduce_scatter_uneven(front.view(-1), [n * per_token for n in tokens], self.group_name, True)
        self.finish = lambda reduced: reduced.view(local_shape).movedim(0, dim).contiguous()

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

    def summed_input_gradient(self) -> torch.Tensor:
        """x's gradient, summed over the group (this rank's tokens of it with sequence
        parallelism), once the collective start() began is done."""
        reduced, finish, self.reduced, self.finish = self.reduced, self.finish, None, None
        return finish(None if reduced is None else wait(reduced))


def _refuse_double_backward() -> None:
    # Grad mode in backward means create_graph=True: the deferred weight gradients would lose
    # their own graph (the second-order terms), so this is refused where it is asked for.
    if torch.is_grad_enabled():
        raise RuntimeError("autoshard: backward with create_graph=True (double backward) through column layers "
                           "whose weight gradients are computed during the input gradient's collective is not "
                           "supported; parallelize the model with overlap_backward=False")


class GradientsAfterReduce(torch.autograd.Function):
    """Forward: x as it is. Backward: the readers' parameter gradients, computed while the
    all-reduce that ReduceStarts began is in flight, then the summed gradient of x."""

    @staticmethod
    def forward(ctx, overlap: _Overlap, x: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.overlap = overlap
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _refuse_double_backward()
        overlap = ctx.overlap
        parameter_grads = overlap.parameter_gradients()
        return (None, overlap.summed_input_gradient(), *parameter_grads)


class ReduceStarts(torch.autograd.Function):
    """Forward: a contiguous copy of x (copy_to_parallel's), or every rank's tokens of it.
    Backward: starts the all-reduce (the reduce-scatter) of the gradient, which
    GradientsAfterReduce waits for."""

    @staticmethod
    def forward(ctx, overlap: _Overlap, x: torch.Tensor) -> torch.Tensor:
        ctx.overlap, ctx.input_shape = overlap, x.shape
        return overlap.enter(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _refuse_double_backward()
        ctx.overlap.start(grad)
        # GradientsAfterReduce, the only reader of this node's input, takes the collective's
        # result instead: a placeholder of the input's shape, no memory, goes its way.
        return None, grad.new_zeros(()).expand(ctx.input_shape)


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
    def backward(ctx, grad: torch.Tensor):
        _refuse_double_backward()
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        flat = x.reshape(-1, x.shape[-1])
        ctx.overlap.keep(ctx.layer, rows, flat)
        return None, None, rows.mm(weight).view(x.shape), None, None


def copy(x: torch.Tensor, group_name: str, readers: Sequence[torch.nn.Module],
         tokens: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """x copied into the parallel region (with `tokens` = (dim, length), every rank's tokens
    of it) for `readers` (column layers), with their weight gradients computed during the input
    gradient's collective; copy_to_parallel (all_gather_from_sequence) where that does not apply
    (no readers, no gradient to x, autocast)."""
    # torch.compile traces the path without overlap: its graphs refuse the autograd nodes' shared
    # state (a side effect under fullgraph), and it orders the collectives itself. torch.jit.trace
    # too: it would keep this forward's _Overlap in its graph, shared by every later call.
    if not (readers and torch.is_grad_enabled() and x.requires_grad) or torch.is_autocast_enabled(x.device.type) \
            or torch.compiler.is_compiling() or torch.jit.is_tracing():
        if tokens is None:
            return ops.copy_to_parallel(x, group_name)
        return ops.all_gather_from_sequence(x, tokens[0], tokens[1], group_name)
    overlap = _Overlap(group_name, readers, tokens)
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
