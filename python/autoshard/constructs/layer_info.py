"""What the capture records of a layer: its construct's kind, sizes, parameters and the shapes
of its call. A Linear (or Hugging Face's Conv1D, a Linear stored transposed) maps the last axis
of its input from in_features to out_features; an Embedding looks rows up by index. Whether one
is split by rows or columns is decided by the planner from the dataflow, never from its name.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .base import construct_of


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
        return construct_of(self.kind)

    def experts_side(self, side: str) -> "LayerInfo":
        """The "in" or "out" layer node of an experts module, its weight_shape as stored."""
        if self.transposed:
            experts, hidden, features_in = self.weight_shape
        else:
            experts, features_in, hidden = self.weight_shape
        ffn = features_in // self.parts
        in_side = side == "in"
        shape = self.weight_shape if in_side else (experts, ffn, hidden) if self.transposed else (experts, hidden, ffn)
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
