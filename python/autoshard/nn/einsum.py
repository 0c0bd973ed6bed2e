"""Keras-style einsum layers for PyTorch: ``EinsumDense`` and its sharded form.

An equation ``"input,weight->output"`` (``"btd,dnh->btnh"``) names every dim of the weight.
Each weight letter has a role: ``output`` (in the output, not the input: sharding it gives a
column-style layer), ``contracted`` (in the input, not the output: a row-style layer) or
``batch`` (in all three: not shardable). Parsing, roles and shapes come from C++ ops.
"""

import math
import operator
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..core import comm, ops, region_generators
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.styles import Style
from ..core.spec import ShardSpec

Shape = Tuple[Optional[int], ...]


def _check_equation(equation, who: str) -> str:
    if not isinstance(equation, str):
        raise TypeError(f"{who}: equation must be a str, got {type(equation).__name__}")
    return equation


def classify(equation: str) -> Dict[str, str]:
    """The role of each weight letter, in weight order: ``"output"``, ``"contracted"`` or
    ``"batch"``. ``classify("btd,dnh->btnh") == {"d": "contracted", "n": "output", "h": "output"}``."""
    letters, roles, _, _ = ops.einsum_weight_axes(_check_equation(equation, "classify"))
    return dict(zip(letters, roles))


def _as_shape(value: Union[int, Sequence[Optional[int]]], argument: str) -> Shape:
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"EinsumDense: {argument} must be an int or a sequence of ints and Nones, got {value!r}")
    try:
        return (operator.index(value),)
    except TypeError:
        pass
    try:
        entries = list(value)
    except TypeError:
        raise TypeError(
            f"EinsumDense: {argument} must be an int or a sequence of ints and Nones, got {type(value).__name__}"
        ) from None
    shape = []
    for entry in entries:
        try:
            shape.append(None if entry is None else operator.index(entry))
        except TypeError:
            raise TypeError(
                f"EinsumDense: {argument} must hold ints and Nones, got {entry!r} in {tuple(entries)!r}"
            ) from None
    return tuple(shape)


def _check_input(x: torch.Tensor, expected: Shape, who: str) -> None:
    """``expected`` is the full input shape, None where any size goes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: input must be a torch.Tensor, got {type(x).__name__}")
    fits = x.dim() == len(expected) and all(want is None or got == want for got, want in zip(x.shape, expected))
    if not fits:
        wanted = "(" + ", ".join("*" if want is None else str(want) for want in expected) + ")"
        raise ValueError(f"{who}: input must have shape {wanted} (* = any size), got {tuple(x.shape)}")


def _prod(values) -> int:
    return math.prod(values) if values else 1


class EinsumDense(nn.Module):
    """``keras.layers.EinsumDense`` for PyTorch: ``torch.einsum(equation, x, weight) + bias``.

    ``input_shape`` and ``output_shape`` leave out the batch dim (the input's first dim, also
    the output's first). ``output_shape`` lists the output letters' sizes (not the dims a "..."
    carries); ``None`` takes a size from the input. The weight's shape follows from the
    equation; ``bias_axes`` are output letters, the bias broadcast over the others.
    """

    def __init__(
        self,
        equation: str,
        output_shape: Union[int, Sequence[Optional[int]]],
        *,
        input_shape: Sequence[Optional[int]],
        bias_axes: Optional[str] = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_equation(equation, "EinsumDense")
        if bias_axes is not None and not isinstance(bias_axes, str):
            raise TypeError(f"EinsumDense: bias_axes must be a str of output letters or None, got {bias_axes!r}")
        input_shape = _as_shape(input_shape, "input_shape")
        output_shape = _as_shape(output_shape, "output_shape")
        weight_shape, bias_shape, full_output = ops.einsum_dense_shapes(equation, input_shape, output_shape, bias_axes)
        self.equation = equation
        self.input_shape = input_shape
        self.output_shape = tuple(full_output[1:])
        self.bias_axes = bias_axes
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        if bias_axes is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def fans(self) -> Tuple[int, int]:
        """(fan_in, fan_out): the sizes of the contracted and of the output weight letters."""
        sizes = {"contracted": [], "output": [], "batch": []}
        for (letter, role), size in zip(classify(self.equation).items(), self.weight.shape):
            sizes[role].append(size)
        return _prod(sizes["contracted"]), _prod(sizes["output"])

    def reset_parameters(self) -> None:
        # Glorot uniform, as Keras; each batch letter indexes an independent matrix.
        fan_in, fan_out = self.fans()
        bound = math.sqrt(6.0 / max(fan_in + fan_out, 1))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, (None,) + self.input_shape, "EinsumDense")
        y = torch.einsum(self.equation, x, self.weight)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"'{self.equation}', input_shape={self.input_shape}, output_shape={self.output_shape}, "
            f"bias_axes={self.bias_axes!r}"
        )


class ShardedEinsumDense(nn.Module):
    """An ``EinsumDense`` with one weight letter split across the ranks of ``group``.

    Sharding an ``output`` letter gives a column-style layer: the replicated input's gradient
    is all-reduced, and the output comes out sharded along that letter's dim (or gathered
    back with ``gather_output=True``). Sharding a ``contracted`` letter gives a row-style
    layer: the input arrives sharded along that letter's dim (or is cut here with
    ``input_is_parallel=False``), the partial outputs are all-reduced, then the bias is added
    once. Build one with ``from_einsum_dense``.
    """

    # The dtype in which a replicated bias's gradient is summed over the group (None: its own);
    # parallelize(..., reduce_dtype=) sets it.
    reduce_dtype: Optional[torch.dtype] = None

    def __init__(
        self,
        layer: EinsumDense,
        shard_axis: str,
        group=None,
        *,
        gather_output: bool = False,
        input_is_parallel: bool = True,
    ):
        super().__init__()
        if not isinstance(layer, EinsumDense):
            raise TypeError(
                f"ShardedEinsumDense: layer must be an autoshard.nn.EinsumDense, got {type(layer).__name__}"
            )
        equation = layer.equation
        if not isinstance(shard_axis, str):
            raise TypeError(f"ShardedEinsumDense: shard_axis must be a one-letter str, got {type(shard_axis).__name__}")
        letters, roles, input_dims, output_dims = ops.einsum_weight_axes(equation)
        if shard_axis not in letters:
            raise ValueError(
                f"ShardedEinsumDense: shard_axis '{shard_axis}' is not a letter of the weight '{''.join(letters)}' "
                f"in equation '{equation}'"
            )
        axis = letters.index(shard_axis)
        role = roles[axis]
        if role == "batch":
            raise ValueError(
                f"ShardedEinsumDense: shard_axis '{shard_axis}' is a batch letter of equation '{equation}' (in the "
                "input, the weight and the output), which cannot be sharded: pick an output or contracted letter"
            )
        style = Style.COLUMN if role == "output" else Style.ROW
        if gather_output and style is Style.ROW:
            raise ValueError(
                f"ShardedEinsumDense: gather_output=True needs an output letter, but shard_axis '{shard_axis}' is "
                f"contracted in equation '{equation}'"
            )
        if not input_is_parallel and style is Style.COLUMN:
            raise ValueError(
                f"ShardedEinsumDense: input_is_parallel=False needs a contracted letter, but shard_axis "
                f"'{shard_axis}' is an output letter of equation '{equation}'"
            )
        group = resolve(group, "ShardedEinsumDense")
        full_size = layer.weight.shape[axis]
        world = comm.world_size(group)
        if world > full_size:
            raise ValueError(
                f"ShardedEinsumDense: cannot shard letter '{shard_axis}' of size {full_size} in equation "
                f"'{equation}' over {world} ranks: the world size must be at most {full_size}"
            )
        spec = ShardSpec(dim=axis, full_size=full_size, rank=comm.rank(group), world_size=world)
        self.equation = equation
        self.input_shape = layer.input_shape
        self.output_shape = layer.output_shape
        self.bias_axes = layer.bias_axes
        self.shard_axis = shard_axis
        self.style = style
        self.group = group
        self.gather_output = bool(gather_output)
        self.input_is_parallel = bool(input_is_parallel)
        self.full_size = full_size
        self.local_size = spec.local_size()
        self._input_dim = input_dims[axis]
        self._output_dim = output_dims[axis]
        self.shard_specs = {"weight": spec}
        self.input_copy = None  # may be shared with other column layers reading the same input
        self.weight = nn.Parameter(spec.take(layer.weight.detach()), requires_grad=layer.weight.requires_grad)
        if layer.bias is None:
            self.register_parameter("bias", None)
        elif style is Style.COLUMN and shard_axis in layer.bias_axes:
            # The bias lines up with the output's trailing dims.
            output_rank = 1 + len(layer.output_shape)
            from_end = self._output_dim - output_rank if self._output_dim >= 0 else self._output_dim
            bias_spec = ShardSpec(dim=layer.bias.dim() + from_end, full_size=full_size, rank=spec.rank,
                                  world_size=world)
            self.shard_specs["bias"] = bias_spec
            self.bias = nn.Parameter(bias_spec.take(layer.bias.detach()), requires_grad=layer.bias.requires_grad)
        else:
            self.bias = nn.Parameter(layer.bias.detach(), requires_grad=layer.bias.requires_grad)
        attach_layer_state(self)

    @classmethod
    def from_einsum_dense(cls, layer: EinsumDense, shard_axis: str, group=None, **options) -> "ShardedEinsumDense":
        """This rank's shard of ``layer``, split along weight letter ``shard_axis``; ``options``
        are the constructor's (``gather_output``, ``input_is_parallel``)."""
        return cls(layer, shard_axis, group, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = [None, *self.input_shape]
        if self.style is Style.ROW and self.input_is_parallel:  # else the input is whole
            expected[self._input_dim] = self.local_size
        _check_input(x, tuple(expected), "ShardedEinsumDense")
        if self.style is Style.COLUMN:
            x = self.input_copy(x) if self.input_copy is not None else comm.copy_to_parallel(x, self.group)
            region_generators.enter(x, self.group.group_name, self.training)
            y = torch.einsum(self.equation, x, self.weight)
            if self.bias is not None:
                # A bias replicated over the sharded letter collects gradient from every shard.
                if "bias" in self.shard_specs:
                    bias = self.bias
                else:  # summed in reduce_dtype when parallelize sets one
                    wide = self.bias if self.reduce_dtype is None else self.bias.to(self.reduce_dtype)
                    bias = comm.copy_to_parallel(wide, self.group).to(self.bias.dtype)
                y = y + bias
            if self.gather_output:
                y = comm.gather_from_parallel(y, self._output_dim % y.dim(), self.full_size, self.group)
                region_generators.leave(y)
            return y
        if not self.input_is_parallel:
            x = comm.scatter_to_parallel(x, self._input_dim % x.dim(), self.group)
        y = region_generators.leave(comm.reduce_from_parallel(torch.einsum(self.equation, x, self.weight), self.group))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return (
            f"'{self.equation}', shard_axis='{self.shard_axis}' ({self.style}), {self.local_size} of "
            f"{self.full_size} on rank {spec.rank} of {spec.world_size}, bias_axes={self.bias_axes!r}"
        )
