"""Embeddings split over their rows (the vocabulary): nn.Embedding as VocabParallelEmbedding,
a subclass with a forward of its own changed in place (nn/embedding_subclass.py)."""

from typing import Dict, Optional

import torch
from torch import nn

from ..nn.embedding import VocabParallelEmbedding
from ..nn.embedding_subclass import shard_embedding_subclass
from ..core.styles import Style, TokenRole
from .base import LayerConstruct, register
from .layer_info import LayerInfo


def _own_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Embedding.forward


@register
class EmbeddingConstruct(LayerConstruct):
    kind = "embedding"
    planner_kind = "embedding"
    order = 40
    last_axis_features = False
    # An embedding left whole with no reason given is a position or type table: only the token
    # table is split.
    whole_reason = "position_table"

    def recorded_at_lookup(self, info) -> bool:
        return not isinstance(info.input, torch.Tensor)

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        if not isinstance(module, nn.Embedding):
            return None
        return LayerInfo(name, "embedding", weight_param=param_index.get(id(module.weight), -1),
                         num_embeddings=module.num_embeddings, embedding_dim=module.embedding_dim)

    def planner_fields(self, info, inputs, output):
        return {"num_embeddings": info.num_embeddings, "embedding_dim": info.embedding_dim,
                "weight_param": info.weight_param}

    def weight_shape(self, info):
        return [info.num_embeddings, info.embedding_dim]

    def weight_dim(self, layer) -> Optional[int]:
        return 0 if layer.style is Style.VOCAB else None

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        if _own_forward(module):
            if layer.sequence is TokenRole.REDUCE_SCATTER:
                # Its forward goes on after the lookup with ops the plan never saw (one call, one
                # layer): on this rank's tokens only, one that mixes tokens would be wrong.
                raise ValueError(f"parallelize: the plan cuts the lookup of {layer.module!r} "
                                 f"({type(module).__name__}, a forward of its own) to this rank's tokens; make the "
                                 "plan with sequence_parallel=False")
            return shard_embedding_subclass(module, layer.module, group)
        return VocabParallelEmbedding.from_embedding(module, group)

    def replaces(self, module: nn.Module) -> bool:
        return not _own_forward(module)  # see nn.embedding_subclass
