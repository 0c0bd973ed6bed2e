"""torch.nn.MultiheadAttention split by heads (nn/multihead_attention.py).

Its q/k/v projection is no module of its own: the capture records the call's projection as the
layer `<attention>.in_proj` (its in_proj_weight, [q | k | v] by rows), and its out_proj as the
Linear it is. The planner splits the two only together (csrc/plan/settle.cpp, "together"): the
projection a column layer over whole heads, out_proj the row layer after it, and the module,
changed in place, becomes a ParallelMultiheadAttention computing this rank's heads.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Set

from torch import nn

from ..nn.multihead_attention import IN_PROJECTION, shard_multihead_attention
from .base import LayerConstruct, LayerSurgery, construct_of, register, same_split
from .linear import LinearConstruct
from ..core.styles import TokenRole
from .layer_info import LayerInfo
from ..core.sealed import Sealed


@dataclass
class ReturnedAttentionWeights(Sealed):
    """The attention weights an nn.MultiheadAttention split by heads returns with need_weights:
    averaged over every head by one all-reduce where the model reads them (`used`), else None."""

    module: str
    used: bool


def owner_name(layer_name: str) -> Optional[str]:
    """The attention a layer named `<attention>.in_proj` projects for, or None."""
    owner, _, child = layer_name.rpartition(".")
    return owner if child == IN_PROJECTION else None


@register
class MultiheadAttentionConstruct(LayerConstruct):
    kind = "attention"
    order = 0
    fields = {"attention_weights": ReturnedAttentionWeights}
    printout_order = 20

    def read(self, answer, reading):
        return {"attention_weights": [ReturnedAttentionWeights(reading.graph.nodes[w["node"]][0], w["used"])
                                      for w in answer.get("attention_weights", [])]}

    def printout(self, plan, printing):
        lines = []
        for module, _, used in printing.fold([(returned.module, returned.used) for returned in plan.attention_weights]):
            lines.append(f"  {module}: attention weights averaged over every head (one all-reduce of each rank's "
                         "sum in forward)" if used else
                         f"  {module}: attention weights not returned (None): the model never reads them")
        return lines

    def projection(self, name: str, module: nn.MultiheadAttention, param_index: Dict[int, int]):
        """The LayerInfo of the q/k/v projection of the attention `module` named `name`."""
        index = lambda p: param_index.get(id(p), -1) if p is not None else -1
        prefix = name + "." if name else ""
        return LayerInfo(prefix + IN_PROJECTION, self.kind, module.embed_dim, 3 * module.embed_dim, False,
                         index(module.in_proj_weight), index(module.in_proj_bias))

    def adopts(self, layer) -> bool:
        # An nn.MultiheadAttention's projection, in a document that named it linear.
        return layer.kind == "linear" and layer.weight.endswith("in_proj_weight") and \
            layer.module.rpartition(".")[2] == IN_PROJECTION

    def weight_shape(self, info):
        return [info.out_features, info.in_features]

    weight_dim = LinearConstruct.weight_dim

    def owner(self, model: nn.Module, layer) -> Optional[nn.MultiheadAttention]:
        """The nn.MultiheadAttention whose projection `layer` is, or None."""
        name = owner_name(layer.module)
        if name is None:
            return None
        module = model.get_submodule(name) if name else model
        return module if isinstance(module, nn.MultiheadAttention) else None

    def module_of(self, model: nn.Module, layer) -> nn.Module:
        owner = self.owner(model, layer)
        if owner is None:
            raise AttributeError(f"{layer.module!r} is not the projection of an nn.MultiheadAttention")
        return owner

    def weight_of(self, module: nn.Module, layer):
        return getattr(module, "in_proj_weight", None)

    def sharded_with(self, layers) -> Set[str]:
        # Split by heads as one: the projection's plan shards its out_proj too.
        if not any(layer.style.is_split for layer in layers):
            return set()
        return {layers[0].module.rpartition(".")[0] + ".out_proj"}

    def shard_module(self, layers, surgery: LayerSurgery) -> None:
        layer = same_split(layers)
        if not layer.style.is_split:
            return
        # Split by heads in place: its projection as `layer` plans, its out_proj as the row layer
        # the planner paired with it.
        name, group = owner_name(layer.module), surgery.group
        attention = self.owner(surgery.model, layer)
        out_layer = surgery.plan.layer(name + ".out_proj")
        out_proj = construct_of(out_layer.kind).shard(out_layer, attention.out_proj, group)
        if out_layer.sequence is TokenRole.REDUCE_SCATTER:
            out_proj.output_tokens = surgery.tokens.reduce_scatter(out_layer)
        attention = shard_multihead_attention(attention, layer.weight_spec(group.rank(), group.size()), out_proj, group,
                                              surgery.plan.returned_weights(name))
        input_copy = surgery.input_copy([call for call in layers if call.style.is_column])
        if input_copy is not None:
            attention.in_proj.input_copy = input_copy

    def stand_in_within(self, root: nn.Module, prefix: str, plan, layer, rank: int) -> Set[str]:
        # The attention becomes the ParallelMultiheadAttention of `rank`, with no collective.
        name = layer.module.rpartition(".")[0]
        relative = name[len(prefix):] if name != prefix[:-1] else ""
        owner = root.get_submodule(relative) if relative else root
        out_layer = plan.layer(owner_name(layer.module) + ".out_proj")
        out_spec = out_layer.weight_spec(rank, plan.world_size)
        out_proj = nn.Linear(out_spec.local_size(), owner.embed_dim, bias=owner.out_proj.bias is not None,
                             device="meta", dtype=owner.out_proj.weight.dtype)
        shard_multihead_attention(owner, layer.weight_spec(rank, plan.world_size), out_proj, None,
                                  plan.returned_weights(owner_name(layer.module)))
        return {layer.module, name + ".out_proj"}

    def replaces(self, module: nn.Module) -> bool:
        return False  # changed in place (its out_proj is replaced, a layer of its own)
