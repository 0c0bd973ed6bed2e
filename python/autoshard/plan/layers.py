"""What the capture records of a layer, and the probes that tell what a module computes.

A Linear (or Hugging Face's Conv1D, a Linear stored transposed) maps the last axis of its
input from in_features to out_features; an Embedding looks rows up by index. Whether one is
split by rows or columns is decided by the planner from the dataflow, never from its name.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import torch
from torch import nn

from .. import ops
from ..nn.head_parameters import holds_only_head_parameters


@dataclass
class LayerInfo:
    name: str
    kind: str  # its construct's kind (autoshard.constructs): "linear", "embedding", "einsum", ...
    in_features: int = 0
    out_features: int = 0
    transposed: bool = False  # Conv1D: weight is [in, out]
    weight_param: int = -1
    bias_param: int = -1
    num_embeddings: int = 0
    embedding_dim: int = 0
    equation: str = ""  # einsum layers
    bias_axes: str = ""
    weight_shape: Optional[tuple] = None
    input_shape: Optional[tuple] = None
    output_shape: Optional[tuple] = None
    input: Optional[torch.Tensor] = field(default=None, repr=False)
    # Experts (kind "experts"): the module holds E experts' weights as two 3-D parameters,
    # [E, parts * ffn, hidden] read first and [E, hidden, ffn] read second (transposed: [E,
    # hidden, parts * ffn] and [E, ffn, hidden]); each is recorded as one Linear-like node on the
    # FFN axis ("in": hidden -> parts * ffn, "out": ffn -> hidden).
    side: str = ""
    experts_params: tuple = ()  # (in parameter index, out parameter index)
    parts: int = 1
    interleaved: bool = False  # gate and up interleaved on the FFN axis (see ExpertsWeights)
    experts_biases: tuple = ()  # (in bias index, out bias index), or () without biases
    summed_bias: int = 0  # the out bias's elements where it is trained (its gradient is summed)
    granule: int = 1  # experts: the FFN features of 16 bytes (see ExpertsConstruct.stored_layout)
    inputs: tuple = field(default=(), repr=False)  # the whole call's positional inputs
    # A LoRA layer (nn/lora.py): its base Linear is the layer, and each adapter's factors
    # (A's weight, B's weight) as parameter indices, split with it.
    adapters: tuple = ()
    groups: int = 1  # a grouped convolution's groups (kind "grouped_conv")

    @property
    def construct(self):
        """The construct (autoshard.constructs) of this layer's kind."""
        from ..constructs import construct_of

        return construct_of(self.kind)

    def experts_side(self, side: str) -> "LayerInfo":
        """The "in" or "out" layer node of an experts module, its weight_shape as stored."""
        if self.transposed:
            experts, hidden, features_in = self.weight_shape
        else:
            experts, features_in, hidden = self.weight_shape
        ffn = features_in // self.parts
        in_side = side == "in"
        if in_side:
            shape = (experts, hidden, features_in) if self.transposed else (experts, features_in, hidden)
        else:
            shape = (experts, ffn, hidden) if self.transposed else (experts, hidden, ffn)
        bias = self.experts_biases[0 if in_side else 1] if self.experts_biases else -1
        return LayerInfo(self.name, "experts", hidden if in_side else ffn, features_in if in_side else hidden,
                         self.transposed, weight_param=self.experts_params[0 if in_side else 1], bias_param=bias,
                         weight_shape=shape, side=side, experts_params=self.experts_params, parts=self.parts,
                         interleaved=self.interleaved, experts_biases=self.experts_biases, granule=self.granule)

    def planner_fields(self, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        """The fields of this layer's node in the planner's graph document (csrc/plan/graph.h)."""
        shape = self.weight_shape or (self.in_features, self.out_features)
        return {**self.construct.planner_fields(self, inputs, output), "weight_elements": math.prod(shape)}

    def record_call(self, inputs: torch.Tensor, output: torch.Tensor) -> "LayerInfo":
        self.input_shape = tuple(inputs.shape)
        self.output_shape = tuple(output.shape)
        return self


_COMPUTES_LINEAR: Dict[tuple, bool] = {}
# nn.Linear's own attributes: the probe has its own sizes, and training does not change F.linear.
_LINEAR_ATTRIBUTES = ("in_features", "out_features", "training")
_PLAIN = (int, float, str, bool, type(None))


def _instance_state(module: Optional[nn.Module]):
    """The plain attributes a subclass's forward may read from `module` beyond nn.Linear's, as
    a sorted tuple; None where the module holds more than nn.Linear's weight and bias and such
    attributes (a buffer, a submodule, a tensor or object attribute), which a probe of the
    class cannot stand for."""
    if module is None:
        return ()
    if set(module._parameters) - {"weight", "bias"} or module._buffers or module._modules:
        return None
    found = []
    for key, value in vars(module).items():
        if key.startswith("_") or key in _LINEAR_ATTRIBUTES:
            continue
        if not isinstance(value, _PLAIN):
            return None
        found.append((key, value))
    return tuple(sorted(found))


def computes_linear(cls: type, module: Optional[nn.Module] = None) -> bool:
    """Whether the nn.Linear subclass `cls` (for `module`, an instance of it, with the plain
    attributes that instance holds) computes F.linear: its own forward, if it has one, checked
    once per class and attributes on small float64 layers of its own (with and without bias,
    inputs of 1 to 3 dimensions) against F.linear. A class whose __init__ is not nn.Linear's,
    an instance holding more than plain attributes, or one that does anything else, is not
    taken for a Linear: its ops are followed one by one."""
    if cls.forward is nn.Linear.forward:
        return True
    state = _instance_state(module)
    if state is None or cls.__init__ is not nn.Linear.__init__:
        return False
    key = (cls, state)
    known = _COMPUTES_LINEAR.get(key)
    if known is not None:
        return known
    same = False
    generator = torch.Generator().manual_seed(0)
    # Outside any mode a capture or a dry run has on: this is a check, not the model's call.
    with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        try:
            same = True
            for bias in (True, False):
                layer = cls(5, 3, bias=bias, device="cpu", dtype=torch.float64)
                for attr, value in state:  # a scale set on the instance after its class's __init__
                    setattr(layer, attr, value)
                with torch.no_grad():
                    for p in layer.parameters():
                        p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
                for shape in ((5,), (4, 5), (2, 4, 5)):
                    x = torch.randn(shape, generator=generator, dtype=torch.float64)
                    got = cls.forward(layer, x)
                    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                    same = same and isinstance(got, torch.Tensor) and got.shape == want.shape and \
                        bool(torch.allclose(got, want, rtol=1e-12, atol=1e-12))
        except Exception:
            same = False
    _COMPUTES_LINEAR[key] = same
    return same


def describe_layer(name: str, module: nn.Module, param_index: Dict[int, int]) -> Optional[LayerInfo]:
    """The LayerInfo of the construct (autoshard.constructs) that recognises `module`, or None."""
    from ..constructs import recognise

    # A forward set on the instance (in place of its class's) computes what it will: its ops
    # are followed one by one, and the module, never replaced, keeps it. The capture's own
    # stand-in for a block it replays (plan/folding.py) is not the model's.
    forward = vars(module).get("forward")
    if forward is not None and not getattr(forward, "autoshard_folded_block", False):
        return None
    return recognise(name, module, param_index)


def is_linear_like(module: nn.Module) -> bool:
    """Whether a layer module maps its input's features as a Linear does (a Linear, Conv1D or
    einsum layer, sharded or not): a norm called on its output may split with its features."""
    from ..nn.einsum import ShardedEinsumDense
    from ..nn.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ShardedEinsumDense)) \
            or getattr(type(module), "autoshard_linear_like", False):
        return True
    from ..constructs import construct_of

    info = describe_layer("", module, {})
    return info is not None and construct_of(info.kind).last_axis_features


def plain_linear_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The weight of a Linear layer stored [out, in] (nn.Linear, or a column- or row-parallel
    one made from it), which a model may multiply itself; None for any other module."""
    from ..nn.linear import _ParallelLinear

    if isinstance(module, _ParallelLinear) and not module.transposed_weight:
        return module.weight
    if isinstance(module, nn.Linear) and isinstance(module.weight, torch.Tensor) and module.weight.dim() == 2:
        return module.weight
    return None


def in_projection_layer(name: str, module: nn.MultiheadAttention, param_index: Dict[int, int]) -> LayerInfo:
    """The q/k/v projection of an nn.MultiheadAttention named `name` as the layer
    `name + ".in_proj"` (see constructs/attention.py)."""
    from ..constructs import construct_of

    return construct_of("attention").projection(name, module, param_index)


def layer_at(root: nn.Module, relative: str, name: str, param_index: Dict[int, int]) -> Optional[LayerInfo]:
    """The layer at `relative` inside `root`, named `name`: a module, or the q/k/v projection
    of an nn.MultiheadAttention (`<attention>.in_proj`, which is no module)."""
    from ..nn.multihead_attention import IN_PROJECTION

    parent, _, child = relative.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    if child == IN_PROJECTION and isinstance(owner, nn.MultiheadAttention):
        return in_projection_layer(name[:-len(IN_PROJECTION) - 1], owner, param_index)
    return describe_layer(name, root.get_submodule(relative), param_index)


def is_layer_module(module: nn.Module) -> bool:
    """Whether a trace records a module's call as one layer: a layer the planner plans, a
    sharded one, unless the module says otherwise (`autoshard_layer`: a sharded attention is
    traced op by op, its q/k/v projection is one layer)."""
    flag = getattr(type(module), "autoshard_layer", None)
    if flag is not None:
        return flag
    sharded = hasattr(module, "shard_specs") and not holds_only_head_parameters(module)
    return sharded or describe_layer("", module, {}) is not None


class ExpertsWeights(NamedTuple):
    """Where an experts module keeps its weights (see experts_weights)."""
    first: str  # the in weight's name
    second: str  # the out weight's name
    parts: int  # 2: gated (gate and up in the in weight), 1: plain
    transposed: bool
    # Gate and up interleaved on the FFN axis (gate 0, up 0, gate 1, ...: gpt-oss, transformers'
    # is_concatenated=False) rather than one after the other.
    interleaved: bool = False
    in_bias: Optional[str] = None  # [E, parts * F], added to each expert's in product
    out_bias: Optional[str] = None  # [E, H], added to each expert's output


def experts_weights(module: nn.Module) -> Optional[ExpertsWeights]:
    """Where a module holding mixture-of-experts weights as 3-D parameters keeps them, or None:
    exactly two 3-D parameters, [E, parts * F, H] then [E, H, F] (each expert a gated or plain
    MLP whose input and output have H features), gated ones holding the gate and up projections
    one after the other on the FFN axis (parts = 2), or interleaved where the module says so
    (transformers' `is_concatenated=False`); or, stored transposed for `x @ w` (transformers'
    `is_transposed`, Llama 4's, Aria's and gpt-oss's experts), [E, H, parts * F] then [E, F, H].
    Without the flag the first layout is read where it fits. A module flagged `has_bias` (gpt-oss)
    also holds one bias per side, [E, parts * F] and [E, H], after its weight."""
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    weights = [(name, p) for name, p in params if p.dim() == 3]
    biases = [(name, p) for name, p in params if p.dim() == 2]
    with_bias = bool(getattr(module, "has_bias", False))
    if len(weights) != 2 or len(biases) != (2 if with_bias else 0) or len(params) != len(weights) + len(biases):
        return None
    interleaved = not getattr(module, "is_concatenated", True)
    (first, a), (second, b) = weights
    flagged = getattr(module, "is_transposed", None)
    for transposed in ((False, True) if flagged is None else (bool(flagged),)):
        if transposed:
            experts, hidden, features_in = a.shape
            ffn, out_hidden = b.shape[1], b.shape[2]
        else:
            experts, features_in, hidden = a.shape
            out_hidden, ffn = b.shape[1], b.shape[2]
        if b.shape[0] != experts or out_hidden != hidden or ffn == 0:
            continue
        parts = features_in // ffn if features_in % ffn == 0 else 0
        has_gate = getattr(module, "has_gate", parts == 2)
        if parts != (2 if has_gate else 1) or (interleaved and parts != 2):
            continue
        if not with_bias:
            return ExpertsWeights(first, second, parts, transposed, interleaved)
        (in_bias, c), (out_bias, d) = biases
        if tuple(c.shape) == (experts, features_in) and tuple(d.shape) == (experts, hidden):
            return ExpertsWeights(first, second, parts, transposed, interleaved, in_bias, out_bias)
    return None


def einsum_letters(equation: str, input_ndim: int, output_ndim: int) -> List[Dict[str, object]]:
    """The planner's description of an einsum layer's weight letters, from the C++ equation
    parser: per weight letter, its role ("output", "contracted" or "batch") and its dims in the
    input and the output (from the start; -1 where absent)."""
    letters, roles, input_dims, output_dims = ops.einsum_weight_axes(equation)
    return [{"letter": letter, "role": role,
             "input_dim": -1 if in_dim is None else in_dim % input_ndim,
             "output_dim": -1 if out_dim is None else out_dim % output_ndim}
            for letter, role, in_dim, out_dim in zip(letters, roles, input_dims, output_dims)]
