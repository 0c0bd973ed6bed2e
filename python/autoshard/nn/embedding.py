"""The vocab-parallel embedding: the table's rows split across the ranks.

Each rank looks up the ids it holds rows for (zeros for the others) in one fused op, and one
all-reduce sums the ranks' partial outputs into the full lookup. The backward needs no
collective: every rank receives the full output gradient and accumulates its own rows.
"""

from typing import Optional

import torch
from torch import nn

from ..core import comm, ops
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec
from .linear import as_int

_NAME = "VocabParallelEmbedding"


def _reject_max_norm(max_norm) -> None:
    if max_norm is not None:
        # Renormalising looked-up rows in place needs each row's norm, and a row lives on one
        # rank while the ids that touch it arrive on all of them.
        raise ValueError(
            "VocabParallelEmbedding: max_norm is not supported by the vocab-parallel table "
            f"(got max_norm={max_norm!r}); use max_norm=None"
        )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split across the ranks of ``group`` by ``split_sizes``
    (the first ranks get one extra row). Outputs and gradients equal ``nn.Embedding``'s;
    ``padding_idx`` is a row of the full table that gets no gradient."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _reject_max_norm(max_norm)
        num_embeddings = as_int(num_embeddings, "num_embeddings", _NAME)
        embedding_dim = as_int(embedding_dim, "embedding_dim", _NAME)
        if num_embeddings <= 0:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings must be positive, got {num_embeddings}")
        if embedding_dim < 0:
            raise ValueError(f"VocabParallelEmbedding: embedding_dim must be >= 0, got {embedding_dim}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        if padding_idx is not None:  # nn.Embedding's rule: a negative index counts from the end of the full table
            padding_idx = as_int(padding_idx, "padding_idx", _NAME)
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: padding_idx must be in [{-num_embeddings}, "
                                 f"{num_embeddings}) for num_embeddings={num_embeddings}, got {padding_idx}")
            padding_idx += num_embeddings if padding_idx < 0 else 0
        self.padding_idx = padding_idx
        self.max_norm = None
        # Resolved now: the table is split for this group, whatever the default is later.
        self.group = resolve(group, "VocabParallelEmbedding")
        spec = ShardSpec(dim=0, full_size=num_embeddings, rank=comm.rank(self.group),
                         world_size=comm.world_size(self.group))
        self.shard_specs = {"weight": spec}
        ((self.vocab_start, rows),) = spec.local_ranges()
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()
        attach_layer_state(self)

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.weight.shape[0]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            with torch.no_grad():
                self.weight[self.padding_idx - self.vocab_start].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding`` (a meta embedding gives a meta layer)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"VocabParallelEmbedding.from_embedding: embedding must be a torch.nn.Embedding, "
                f"got {type(embedding).__name__}"
            )
        _reject_max_norm(embedding.max_norm)
        for flag in ("scale_grad_by_freq", "sparse"):
            if getattr(embedding, flag):
                raise ValueError(
                    f"VocabParallelEmbedding.from_embedding: {flag}=True is not supported by the vocab-parallel "
                    f"table; the embedding must have {flag}=False"
                )
        full = embedding.weight
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            group=group,
            device="meta",
            dtype=full.dtype,
        )
        local = layer.shard_specs["weight"].take(full.detach())
        layer.weight = nn.Parameter(local, requires_grad=full.requires_grad)
        attach_layer_state(layer)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup(self, ids, self.padding_idx)

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        text = (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
            f"on rank {spec.rank} of {spec.world_size}"
        )
        return text if self.padding_idx is None else f"{text}, padding_idx={self.padding_idx}"


def lookup(module: nn.Module, ids: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    """The rows of the whole table for `ids` (`padding_idx` a row of the whole table, >= 0): this
    rank's rows of `module` (a VocabParallelEmbedding, or an Embedding split by rows), summed over
    the ranks, or with sequence parallelism this rank's tokens of that sum."""
    padding_idx = -1 if padding_idx is None else padding_idx
    partial = ops.vocab_parallel_lookup(ids, module.weight, module.vocab_start, padding_idx, module.num_embeddings)
    output_tokens = getattr(module, "output_tokens", None)
    if output_tokens is not None:
        return output_tokens(partial, module.training)
    return comm.reduce_from_parallel(partial, module.group)
