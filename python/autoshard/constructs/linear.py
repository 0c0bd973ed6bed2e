"""Linear layers: nn.Linear (and subclasses that compute F.linear), Hugging Face's Conv1D (a
Linear stored [in, out]) and PEFT's LoRA on a Linear, split as Megatron's column- and
row-parallel layers (nn/linear.py, nn/lora.py)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

from ..conventions.huggingface import is_conv1d
from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..nn.lora import adapter_factors, is_lora_linear, shard_lora
from ..core.styles import Style
from .base import LayerConstruct, register
from ..nn.linear_probe import computes_linear
from .layer_info import LayerInfo
from ..core.sealed import Sealed


@dataclass
class AdapterFactors(Sealed):
    """A LoRA layer's factor weights: those split with the base layer, and those held whole."""

    module: str
    split: List[str] = field(default_factory=list)
    whole: List[str] = field(default_factory=list)


@register
class LinearConstruct(LayerConstruct):
    kind = "linear"
    order = 10
    column_gather_override = True
    splits_logits_for_loss = True
    fields = {"adapters": AdapterFactors}

    def read(self, answer, reading):
        names = reading.names
        return {"adapters": [AdapterFactors(reading.graph.layers[a["node"]].name, [names[i] for i in a["split"]],
                                            [names[i] for i in a["whole"]]) for a in answer.get("adapters", [])]}

    def records_weight_products(self, info) -> bool:
        return not info.transposed

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        index = lambda p: param_index.get(id(p), -1) if p is not None else -1
        # A LoRA adapter on a Linear is one layer with it: split as its base layer is split.
        if is_lora_linear(module):
            base = module.base_layer
            return LayerInfo(name, "linear", base.in_features, base.out_features, False, index(base.weight),
                             index(base.bias),
                             adapters=tuple((index(a), index(b)) for a, b in adapter_factors(module).values()))
        # A Linear subclass with a forward of its own is a layer only where that forward computes
        # F.linear all the same (FalconLinear); otherwise its ops are followed one by one.
        if isinstance(module, nn.Linear) and computes_linear(type(module), module):
            return LayerInfo(name, "linear", module.in_features, module.out_features, False,
                             index(module.weight), index(module.bias))
        if is_conv1d(module):
            return LayerInfo(name, "linear", module.weight.shape[0], module.weight.shape[1], True,
                             index(module.weight), index(getattr(module, "bias", None)))
        return None

    def weight_shape(self, info):
        return [info.in_features, info.out_features] if info.transposed else [info.out_features, info.in_features]

    def weight_dim(self, layer) -> Optional[int]:
        if layer.style.is_column:
            return 1 if layer.transposed else 0
        if layer.style is Style.ROW:
            return 0 if layer.transposed else 1
        return None

    def stand_in(self, layer, module: nn.Module, rank: int, world_size: int) -> Optional[nn.Module]:
        spec = layer.weight_spec(rank, world_size)
        out_features, in_features = layer.weight_shape[::-1] if layer.transposed else layer.weight_shape
        if layer.style is Style.COLUMN:
            out_features = spec.local_size()
        elif layer.style is Style.ROW:
            in_features = spec.local_size()
        # The original layer's dtype: a module that casts its input to its layer's dtype (T5's
        # feed-forward) must trace the same ops as it did in the capture.
        original = getattr(module, "weight", None)
        dtype = original.dtype if isinstance(original, torch.Tensor) else None
        # With its bias (this rank's slice for a column layer): a model that reads the bias apart
        # from the layer's call (Mamba's dt_proj, whose weight it multiplies itself) reads it here.
        bias = isinstance(getattr(module, "bias", None), torch.Tensor)
        return nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        split = layer.weight_shape[self.weight_dim(layer)]
        # A split element by element needs no units; whole heads and fused parts do.
        units = layer.units if (layer.parts or layer.units != split) else None
        parts = layer.parts or None
        column = layer.style.is_column
        column_options = dict(repeat=layer.repeat or None, whole_parts=layer.whole_parts or None,
                              sum_whole_parts=layer.summed_parts) if column else {}
        if is_lora_linear(module):
            return shard_lora(module, layer.style, group, units=layer.units if layer.repeat else units, parts=parts,
                              **column_options)
        if column:
            return ColumnParallelLinear.from_linear(module, group, gather_output=layer.style is Style.COLUMN_GATHER,
                                                    units=layer.units if layer.repeat else units, parts=parts,
                                                    **column_options)
        return RowParallelLinear.from_linear(module, group, input_is_parallel=True, units=units, parts=parts)
