"""The layer kinds the planner decides about, recognised by what they compute.

A Linear (or Hugging Face's Conv1D, a Linear stored transposed) maps the last axis of its
input from in_features to out_features; an Embedding looks rows up by index. Whether one is
split by rows or columns is decided by the planner from the dataflow, never from its name.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

from .. import ops
# The one Conv1D test, shared with ColumnParallelLinear.from_linear, so that the planner never
# plans a layer that from_linear would refuse.
from ..nn.conv1d import is_conv1d


@dataclass
class LayerInfo:
    name: str
    kind: str  # "linear" or "embedding"
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
    # [E, parts * ffn, hidden] read first and [E, hidden, ffn] read second; each is recorded as
    # one Linear-like node on the FFN axis ("in": hidden -> parts * ffn, "out": ffn -> hidden).
    side: str = ""
    experts_params: tuple = ()  # (in parameter index, out parameter index)
    parts: int = 1
    inputs: tuple = field(default=(), repr=False)  # the whole call's positional inputs

    def planner_kind(self) -> str:
        return "linear" if self.kind == "experts" else self.kind

    def experts_side(self, side: str) -> "LayerInfo":
        """The "in" or "out" layer node of an experts module."""
        experts, features_in, hidden = self.weight_shape
        ffn = features_in // self.parts
        in_side = side == "in"
        return LayerInfo(self.name, "experts", hidden if in_side else ffn, features_in if in_side else hidden,
                         weight_param=self.experts_params[0 if in_side else 1],
                         weight_shape=(experts, features_in, hidden) if in_side else (experts, hidden, ffn),
                         side=side, experts_params=self.experts_params, parts=self.parts)

    def planner_fields(self, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        """The fields of this layer's node in the planner's graph document (csrc/plan/graph.h)."""
        if self.kind in ("linear", "experts"):
            return {"in_features": self.in_features, "out_features": self.out_features,
                    "weight_param": self.weight_param, "bias_param": self.bias_param}
        if self.kind == "einsum":
            return {"weight_param": self.weight_param, "bias_param": self.bias_param,
                    "letters": einsum_letters(self.equation, inputs.dim(), output.dim())}
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "weight_param": self.weight_param}

    def record_call(self, inputs: torch.Tensor, output: torch.Tensor) -> "LayerInfo":
        self.input_shape = tuple(inputs.shape)
        self.output_shape = tuple(output.shape)
        return self


def describe_layer(name: str, module: nn.Module, param_index: Dict[int, int]) -> Optional[LayerInfo]:
    def index(p) -> int:
        return param_index.get(id(p), -1) if p is not None else -1

    # A Linear subclass with a forward of its own computes something else; its ops are
    # followed one by one instead.
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return LayerInfo(name, "linear", module.in_features, module.out_features, False,
                         index(module.weight), index(module.bias))
    if is_conv1d(module):
        return LayerInfo(name, "linear", module.weight.shape[0], module.weight.shape[1], True,
                         index(module.weight), index(getattr(module, "bias", None)))
    from ..nn.einsum import EinsumDense

    if isinstance(module, EinsumDense):
        return LayerInfo(name, "einsum", weight_param=index(module.weight), bias_param=index(module.bias),
                         equation=module.equation, weight_shape=tuple(module.weight.shape),
                         bias_axes=module.bias_axes or "")
    if isinstance(module, nn.Embedding):
        return LayerInfo(name, "embedding", weight_param=index(module.weight),
                         num_embeddings=module.num_embeddings, embedding_dim=module.embedding_dim)
    experts = experts_weights(module)
    if experts is not None:
        first, second, parts = experts
        info = LayerInfo(name, "experts", weight_shape=tuple(getattr(module, first).shape), parts=parts,
                         experts_params=(index(getattr(module, first)), index(getattr(module, second))))
        info.weight_param = info.experts_params[0]
        return info
    return None


def experts_weights(module: nn.Module) -> Optional[tuple]:
    """(in weight name, out weight name, parts) of a module holding mixture-of-experts weights as
    3-D parameters, or None: exactly two parameters, [E, parts * F, H] then [E, H, F] (each
    expert a gated or plain MLP whose input and output have H features), gated ones holding the
    gate and up projections one after the other on the FFN axis (parts = 2)."""
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    if len(params) != 2 or any(p.dim() != 3 for _, p in params):
        return None
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True) \
            or getattr(module, "has_bias", False):
        return None
    (first, a), (second, b) = params
    experts, features_in, hidden = a.shape
    if b.shape[0] != experts or b.shape[1] != hidden or b.shape[2] == 0:
        return None
    ffn = b.shape[2]
    parts = features_in // ffn if features_in % ffn == 0 else 0
    has_gate = getattr(module, "has_gate", parts == 2)
    if parts != (2 if has_gate else 1):
        return None
    return first, second, parts


def einsum_letters(equation: str, input_ndim: int, output_ndim: int) -> List[Dict[str, object]]:
    """The planner's description of an einsum layer's weight letters, from the C++ equation
    parser: per weight letter, its role ("output", "contracted" or "batch") and its dims in the
    input and the output (from the start; -1 where absent)."""
    letters, roles, input_dims, output_dims = ops.einsum_weight_axes(equation)
    return [{"letter": letter, "role": role,
             "input_dim": -1 if in_dim is None else in_dim % input_ndim,
             "output_dim": -1 if out_dim is None else out_dim % output_ndim}
            for letter, role, in_dim, out_dim in zip(letters, roles, input_dims, output_dims)]
