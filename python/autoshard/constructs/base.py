"""LayerConstruct: what every construct answers, and the registry that finds one by kind.

The planner (csrc/plan/) decides a style per layer node from the dataflow; a construct only
describes its layer to it and carries out the decision. `kind` names the construct in the
capture's LayerInfo and in the plan's LayerPlan; `planner_kind` is the node kind the planner
reads (csrc/plan/graph.h: "linear", "embedding" or "einsum").
"""

from typing import Dict, List, Optional

import torch
from torch import nn

from ..nn.spec import ShardSpec


class LayerConstruct:
    """One kind of layer: recognised in the capture, laid out, stood in for, and sharded."""

    kind: str = ""
    planner_kind: str = "linear"
    # Recognition order: a module is the first construct's that recognises it (lower first).
    order: int = 100
    # Whether the layer maps the features of its input's last axis (a norm on its output may
    # split with them, and a user may force the layer to column_gather).
    last_axis_features: bool = True

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        """The layer's LayerInfo (plan/layers.py) if `module` is this construct, else None."""
        return None

    def planner_fields(self, info, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        """The fields of the layer's node in the planner's graph document (csrc/plan/graph.h)."""
        return {"in_features": info.in_features, "out_features": info.out_features,
                "weight_param": info.weight_param, "bias_param": info.bias_param}

    def weight_shape(self, info) -> List[int]:
        """The shape of the layer's weight parameter as it is stored."""
        return list(info.weight_shape)

    def weight_dim(self, layer) -> Optional[int]:
        """The weight dimension a LayerPlan of this construct splits, or None (held whole)."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define weight_dim")

    def bias_spec(self, layer, rank: int, world_size: int) -> Optional[ShardSpec]:
        """The bias's ShardSpec on `rank`: split with the output features of a column layer,
        whole (None) otherwise."""
        if layer.bias is None or not layer.style.is_column:
            return None
        return ShardSpec(0, layer.weight_shape[self.weight_dim(layer)], rank, world_size, units=layer.units or None,
                         parts=tuple(layer.parts) if layer.parts else None, repeat=layer.repeat or None,
                         whole_parts=tuple(layer.whole_parts) if layer.whole_parts else None)

    def bias_size(self, layer) -> int:
        """The number of elements of the layer's bias (the output features)."""
        return layer.weight_shape[1 if layer.transposed else 0]

    def module_of(self, model: nn.Module, layer) -> nn.Module:
        """The module a LayerPlan of this construct names in `model` (AttributeError if none)."""
        return model.get_submodule(layer.module)

    def weight_of(self, module: nn.Module, layer):
        """The weight parameter of `module` that `layer` plans, or None."""
        return getattr(module, "weight", None)

    def stand_in(self, layer, module: nn.Module, rank: int, world_size: int) -> Optional[nn.Module]:
        """A meta module computing the shapes the sharded layer computes on `rank`, with no
        collective (the dry run's choice of local attributes traces it); None where there is none."""
        return None

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        """The sharded module that replaces `module` under the planned `layer`."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define shard")

    def replaces(self, module: nn.Module) -> bool:
        """Whether shard() gives a new module (which has none of the old one's hooks) rather than
        changing `module` in place."""
        return True


_BY_KIND: Dict[str, LayerConstruct] = {}


def register(cls):
    """Class decorator: makes `cls` the construct of its kind."""
    if not cls.kind or cls.kind in _BY_KIND:
        raise ValueError(f"register: construct kind {cls.kind!r} is empty or taken")
    _BY_KIND[cls.kind] = cls()
    return cls


def construct_of(kind: str) -> LayerConstruct:
    """The construct of a LayerInfo's or LayerPlan's kind."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise ValueError(f"no layer construct of kind {kind!r} (known: {sorted(_BY_KIND)})") from None


def constructs() -> List[LayerConstruct]:
    """Every construct, in recognition order."""
    return sorted(_BY_KIND.values(), key=lambda c: (c.order, c.kind))


def recognise(name: str, module: nn.Module, param_index: Dict[int, int]):
    """The LayerInfo of the first construct that recognises `module`, or None."""
    for construct in constructs():
        info = construct.recognise(name, module, param_index)
        if info is not None:
            return info
    return None
