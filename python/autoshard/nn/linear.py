"""Megatron's column- and row-parallel Linear layers, with uneven splits.

A column-parallel layer holds this rank's rows of the weight (output features): its input
is replicated, so the input's gradient is all-reduced in backward. A row-parallel layer
holds this rank's columns (input features): each rank computes a partial sum, all-reduced
in forward. Paired (column, then row, with any elementwise function between), a block
costs one all-reduce in forward and one in backward.

Both layers keep the weight in the source layer's layout: ``[out, in]`` for ``nn.Linear``,
``[in, out]`` for Hugging Face's ``Conv1D`` (``transposed_weight=True``), so a checkpoint
slice and ``shard_specs`` describe the parameter as it is stored.
"""

import operator
from dataclasses import replace
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import backward_overlap
from ..core import ops, region_generators
from ..core.distributed import ProcessGroup, resolve
from ..conventions.huggingface import is_conv1d
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec


def as_int(value, argument: str, owner: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}: {argument} must be an int, got {type(value).__name__}") from None


def _source_shape(layer, owner: str) -> Tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an nn.Linear or a transformers Conv1D."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features, False
    if is_conv1d(layer):
        in_features, out_features = layer.weight.shape
        return in_features, out_features, True
    raise TypeError(f"{owner}.from_linear: layer must be a torch.nn.Linear or a transformers Conv1D, "
                    f"got {type(layer).__name__}")


class _ParallelLinear(nn.Linear):
    """What both layers share: the group, the split of one feature dimension, the weight
    layout and the checks. ``split_dim`` is the split dimension in ``[out, in]`` layout.

    An ``nn.Linear`` by class (``in_features`` and ``out_features`` are the whole layer's), so
    that tools finding layers by class (torchao's ``quantize_``, fp8 and 8-bit converters) find
    it; what such a tool then does with the weight, this rank's shard, the shard guard checks
    (see shard_guard): computed with the whole weight, or refused, never taken for the whole."""

    def __init__(self):
        nn.Module.__init__(self)  # not nn.Linear's: _setup makes the parameters, at their local sizes

    split_dim: int
    split_name: str
    # The dtype in which this layer's parameter gradients are summed over the group (None:
    # their own); parallelize(..., reduce_dtype=) sets it.
    reduce_dtype: Optional[torch.dtype] = None

    def _setup(self, in_features, out_features, bias, group, device, dtype, units, parts, repeat=None,
               whole_parts=None) -> None:
        owner = type(self).__name__
        self.in_features = as_int(in_features, "in_features", owner)
        self.out_features = as_int(out_features, "out_features", owner)
        for name, value in (("in_features", self.in_features), ("out_features", self.out_features)):
            if value < 0:
                raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
        self.group = resolve(group, owner)
        self._group_name = self.group.group_name
        self._rank, self._world = self.group.rank(), self.group.size()
        self.transposed_weight = False
        split_size = self.out_features if self.split_dim == 0 else self.in_features
        units = None if units is None else as_int(units, "units", owner)
        parts = None if parts is None else tuple(as_int(p, "parts", owner) for p in parts)
        repeat = None if repeat is None else as_int(repeat, "repeat", owner)
        if repeat is not None and units is None:
            raise ValueError(f"{owner}: repeat={repeat} needs units (the KV heads)")
        whole_parts = None if whole_parts is None else tuple(as_int(i, "whole_parts", owner) for i in whole_parts)
        spec = ShardSpec(dim=self.split_dim, full_size=split_size, rank=self._rank, world_size=self._world,
                         units=units, parts=parts, repeat=repeat, whole_parts=whole_parts)
        for index, size in enumerate(spec.part_sizes()):
            if index in (whole_parts or ()):
                continue
            pieces = (units or size) * (repeat or 1)
            if pieces < self._world:
                what = f"{size}" if units is None else f"{size} ({units} whole units)"
                raise ValueError(
                    f"{owner}: cannot split {self.split_name}={what} over a group of {self._world} ranks: "
                    f"every rank needs a piece, so {self.split_name} must be at least the group size"
                )
        self.shard_specs = {"weight": spec}
        local = spec.local_size()
        shape = (local, self.in_features) if self.split_dim == 0 else (self.out_features, local)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(local if self.split_dim == 0 else self.out_features, **factory))
            if self.split_dim == 0:
                self.shard_specs["bias"] = replace(spec, dim=0)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        attach_layer_state(self)

    @property
    def _plain_split(self) -> bool:
        spec = self.shard_specs["weight"]
        return spec.units is None and spec.parts is None

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the full layer, drawn from the current RNG, of
        which this rank keeps its slice: the same seed gives the same model at any world
        size. The full weight exists on each rank while this runs; build large models on the
        meta device and load them instead."""
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            full = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                             device=self.weight.device, dtype=self.weight.dtype)
            self._copy_from_full(full.weight.t() if self.transposed_weight else full.weight, full.bias)

    def _copy_from_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight.copy_(self.shard_specs["weight"].take_owned(weight))
        if self.bias is not None:
            spec = self.shard_specs.get("bias")
            self.bias.copy_(spec.take_owned(bias) if spec is not None else bias)

    def _weights_summed_over_holders(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight and bias as forward uses them when other ranks hold some of the same KV
        heads (``repeat``): equal values, but backward sums their gradients over the group,
        each rank's at its place in the full layer and zeros elsewhere (one all-reduce of the
        layer's full size, weight and bias together, that never leaves the device), so every
        holder gets the whole gradient and the copies stay equal under any optimizer."""
        spec = self.shard_specs["weight"]
        ((start, length),) = spec.local_ranges()
        after = spec.full_size - start - length
        pad = [0, 0] * (self.weight.dim() - 1 - spec.dim) + [start, after]
        pieces = [F.pad(self.weight, pad).reshape(-1)]
        if self.bias is not None:
            pieces.append(F.pad(self.bias, [start, after]))
        flat = torch.cat(pieces)
        wide = flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)
        full = ops.copy_to_parallel(wide, self._group_name).to(flat.dtype)
        full_shape = spec.full_shape(self.weight.shape)
        weight_numel = pieces[0].numel()
        weight = full[:weight_numel].view(full_shape).narrow(spec.dim, start, length)
        bias = None if self.bias is None else full[weight_numel:].narrow(0, start, length)
        return weight, bias

    def _whole_parts_summed(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight and bias as forward uses them when every rank holds some parts whole and
        reads them with its own heads only (``whole_parts`` with ``sum_whole_parts``): equal
        values, but backward sums those parts' gradient over the group (one all-reduce of their
        rows, weight and bias together), so every rank gets the whole gradient."""
        spec = self.shard_specs["weight"]
        whole = set(spec._whole_ranges())
        runs, offset = [], 0
        for start, length in spec.local_ranges():
            runs.append((offset, length, (start, length) in whole))
            offset += length
        weights = [self.weight.narrow(spec.dim, at, length) for at, length, _ in runs]
        biases = [None] * len(runs) if self.bias is None else [self.bias.narrow(0, at, length) for at, length, _ in runs]
        held = [i for i, run in enumerate(runs) if run[2]]
        flat = torch.cat([weights[i].reshape(-1) for i in held] + [biases[i] for i in held if biases[i] is not None])
        wide = flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)
        summed = ops.copy_to_parallel(wide, self._group_name).to(flat.dtype)
        at = 0
        for i in held:
            weights[i], at = summed[at:at + weights[i].numel()].view(weights[i].shape), at + weights[i].numel()
        for i in held:
            if biases[i] is not None:
                biases[i], at = summed[at:at + biases[i].numel()], at + biases[i].numel()
        weight = torch.cat(weights, dim=spec.dim)
        return weight, None if self.bias is None else torch.cat(biases)

    @classmethod
    def _from_layer(cls, layer, group, units, parts, **options):
        owner = cls.__name__
        in_features, out_features, transposed = _source_shape(layer, owner)
        weight, bias = layer.weight, layer.bias
        module = cls(in_features, out_features, bias=bias is not None, group=group, device="meta",
                     dtype=weight.dtype, units=units, parts=parts, **options)
        if transposed:
            module.transposed_weight = True
            module.shard_specs["weight"] = replace(module.shard_specs["weight"], dim=1 - module.split_dim)
        module.weight = nn.Parameter(module.shard_specs["weight"].take_owned(weight), requires_grad=weight.requires_grad)
        if bias is not None:
            spec = module.shard_specs.get("bias")
            local_bias = spec.take_owned(bias) if spec is not None else bias.detach().clone()
            module.bias = nn.Parameter(local_bias, requires_grad=bias.requires_grad)
        attach_layer_state(module)
        return module

    def _linear_weight(self, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        # [out, in] for F.linear; a transposed view costs no copy (matmul reads it as is).
        weight = self.weight if weight is None else weight
        return weight.t() if self.transposed_weight else weight

    def _check_input(self, x: torch.Tensor, expected: int, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: input must be a torch.Tensor, got {type(x).__name__}")
        got = x.shape[-1] if x.dim() > 0 else None
        if got != expected:
            raise ValueError(f"{type(self).__name__}: input's last dimension must be {what}={expected}, "
                             f"got {got if got is not None else 'a 0-d tensor'} (input shape {tuple(x.shape)})")

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        option = "gather_output" if self.split_dim == 0 else "input_is_parallel"
        layout = "".join(f", {key}={getattr(spec, key)}" for key in ("units", "parts", "repeat", "whole_parts")
                         if getattr(spec, key) is not None)
        if getattr(self, "sum_whole_parts", False):
            layout += ", sum_whole_parts=True"
        if self.transposed_weight:
            layout += ", transposed_weight=True"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{option}={getattr(self, option)}, local_{self.split_name}={spec.local_size()} "
                f"(rank {self._rank} of {self._world}){layout}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W and b split on output features (``split_sizes``: the first
    ranks get the extra). The input is replicated; the output is this rank's slice of the
    features, or all of them with ``gather_output=True`` (an all-gather; prefer feeding a
    RowParallelLinear, which needs none).

    ``units`` and ``parts`` (keyword-only) split in whole units (attention heads) and split
    fused layouts (QKV) part by part, as ``ShardSpec`` does; both need ``gather_output=False``.
    ``repeat`` (with ``units``: a KV projection whose KV heads are fewer than the ranks need)
    holds the KV heads this rank's ``units * repeat`` query-head share uses, as ``ShardSpec``
    describes; ranks holding the same KV head sum its gradient in backward.
    ``whole_parts`` (with ``parts``) holds those parts whole on every rank (one KV head fused
    beside the query heads); with ``sum_whole_parts`` their gradient, partial on each rank
    (each reads them with its own heads), is summed over the group in backward.
    """

    split_dim = 0
    split_name = "out_features"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: Optional[ProcessGroup] = None, device=None, dtype=None, *, units: Optional[int] = None,
                 parts: Optional[Sequence[int]] = None, repeat: Optional[int] = None,
                 whole_parts: Optional[Sequence[int]] = None, sum_whole_parts: bool = False):
        super().__init__()
        self.gather_output = bool(gather_output)
        if not isinstance(sum_whole_parts, bool) or (sum_whole_parts and whole_parts is None):
            raise ValueError(f"ColumnParallelLinear: sum_whole_parts must be a bool, True only with whole_parts; "
                             f"got sum_whole_parts={sum_whole_parts!r}, whole_parts={whole_parts!r}")
        self.sum_whole_parts = sum_whole_parts
        # Column layers that read the same tensor (q, k and v) may share one input copy, so
        # that backward all-reduces their summed input gradient once (see parallelize). With
        # sequence parallelism it gathers the input's tokens instead (nn.sequence.GatherTokens).
        self.input_copy = None
        # The column layers (this one alone, or every one sharing input_copy) whose weight
        # gradients backward computes while the input gradient is all-reduced; None: no overlap
        # (see backward_overlap, parallelize(..., overlap_backward=True)).
        self.overlap_readers = None
        self._setup(in_features, out_features, bias, group, device, dtype, units, parts, repeat, whole_parts)
        self.local_out_features = self.shard_specs["weight"].local_size()
        if self.gather_output and not self._plain_split:
            raise ValueError("ColumnParallelLinear: gather_output=True needs a plain split (units=None, parts=None): "
                             "the gathered features must be in their original order")

    @classmethod
    def from_linear(cls, layer, group: Optional[ProcessGroup] = None, gather_output: bool = False, *,
                    units: Optional[int] = None, parts: Optional[Sequence[int]] = None,
                    repeat: Optional[int] = None, whole_parts: Optional[Sequence[int]] = None,
                    sum_whole_parts: bool = False) -> "ColumnParallelLinear":
        """This rank's slice of ``layer`` (an ``nn.Linear`` or a transformers ``Conv1D``), on
        the layer's device and dtype; a meta layer gives a meta module."""
        return cls._from_layer(layer, group, units, parts, gather_output=gather_output, repeat=repeat,
                               whole_parts=whole_parts, sum_whole_parts=sum_whole_parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features, "in_features")
        if self._world == 1:
            return F.linear(x, self._linear_weight(), self.bias)
        return self.finish(self.local_product(self.enter(x)))

    # forward's three steps, apart so that a layer added to this one's output before it is
    # gathered (a LoRA adapter, nn/lora.py) can read the same input copy.

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """x as the rank's product reads it: copied into the parallel region (its gradient
        all-reduced in backward), or its tokens gathered with sequence parallelism. Dropout
        from here on draws this rank's own masks (see region_generators)."""
        copy = self.input_copy(x) if self.input_copy is not None else \
            backward_overlap.copy(x, self._group_name, self.overlap_readers or ())
        return region_generators.enter(copy, self._group_name, self.training)

    @property
    def plain_product(self) -> bool:
        """Whether local_product is one F.linear on the layer's own weight and bias."""
        return not self.sum_whole_parts and self.shard_specs["weight"].repeat is None

    def local_product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features for an input that enter() gave."""
        if not self.plain_product:
            weight, bias = self._whole_parts_summed() if self.sum_whole_parts else self._weights_summed_over_holders()
            return F.linear(x, self._linear_weight(weight), bias)
        deferred = backward_overlap.product(self, x, self._linear_weight(), self.bias)
        return deferred if deferred is not None else F.linear(x, self._linear_weight(), self.bias)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's output features (gathered with gather_output)."""
        if self.gather_output:
            y = region_generators.leave(ops.gather_from_parallel(y, -1, self.out_features, self._group_name))
        return y


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W split on input features. The input is this rank's slice of
    the features (``input_is_parallel=True``, as a ColumnParallelLinear produces) or the
    full input, split here; the partial products are all-reduced, then the bias (replicated,
    full size) is added once.

    ``units`` and ``parts`` (keyword-only) split in whole units and part by part, as
    ``ShardSpec`` does; both need ``input_is_parallel=True``.
    """

    split_dim = 1
    split_name = "in_features"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: Optional[ProcessGroup] = None, device=None, dtype=None, *, units: Optional[int] = None,
                 parts: Optional[Sequence[int]] = None):
        super().__init__()
        self.input_is_parallel = bool(input_is_parallel)
        # Sequence parallelism (set by parallelize): a ReduceScatterTokens in place of the
        # all-reduce, leaving each rank its tokens of the output.
        self.output_tokens = None
        self._setup(in_features, out_features, bias, group, device, dtype, units, parts)
        self.local_in_features = self.shard_specs["weight"].local_size()
        if not self.input_is_parallel and not self._plain_split:
            raise ValueError("RowParallelLinear: input_is_parallel=False needs a plain split (units=None, parts=None): "
                             "the input is split here with split_sizes")

    @classmethod
    def from_linear(cls, layer, group: Optional[ProcessGroup] = None, input_is_parallel: bool = True, *,
                    units: Optional[int] = None, parts: Optional[Sequence[int]] = None) -> "RowParallelLinear":
        """This rank's slice of ``layer`` (an ``nn.Linear`` or a transformers ``Conv1D``), on
        the layer's device and dtype; a meta layer gives a meta module."""
        return cls._from_layer(layer, group, units, parts, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            self._check_input(x, self.in_features, "in_features")
            return F.linear(x, self._linear_weight(), self.bias)
        return self.finish(self.partial(self.enter(x)))

    # forward's three steps, apart so that a layer whose partial sums are added to this one's
    # (a LoRA adapter, nn/lora.py) shares its all-reduce.

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's input features: x itself (input_is_parallel), or its piece of x."""
        if self.input_is_parallel:
            self._check_input(x, self.local_in_features, "local_in_features")
            return x
        self._check_input(x, self.in_features, "in_features")
        return ops.scatter_to_parallel(x, -1, self._group_name)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output, for its input features that enter() gave."""
        return F.linear(x, self._linear_weight())

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from this rank's partial sum: summed over the group, then the bias."""
        if self.output_tokens is not None:
            y = self.output_tokens(partial, self.training)  # sequence parallelism: this rank's tokens of the sum
        else:
            y = region_generators.leave(ops.reduce_from_parallel(partial, self._group_name))
        return y if self.bias is None else y + self.bias
