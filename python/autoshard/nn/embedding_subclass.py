"""An nn.Embedding subclass with a forward of its own, its table split by vocabulary rows.

The forward is kept as written: it may scale the lookup (Gemma), add to it, call
nn.Embedding.forward or call F.embedding (or torch.embedding) itself. While it runs, every
lookup in the module's own weight, whichever of those paths (or aten.embedding) reaches it, becomes the
vocab-parallel lookup of this rank's rows followed by their sum over the ranks, so the
forward goes on with the whole table's rows, as unsharded; so does a read of rows by index
(`weight[start:end]`, Whisper's positions, or `weight[ids]`). Any other read of the weight (its
shape, a product with it) would see this rank's rows only: it is refused,
on the meta copy parallelize tries the plan on, before any weight changes (a plan parallelize
makes itself is then made again with the embedding whole; see planner/plan_until_it_runs.py).
"""

import inspect
import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..core.distributed import ProcessGroup
from ..core.parallel_state import attach_layer_state
from .embedding import VocabParallelEmbedding, lookup

_EMBEDDING = inspect.signature(F.embedding)
# Reads of the weight that are the same whichever rows a rank holds.
_SAME_ON_EVERY_RANK = {torch._C.TensorBase.__dict__[name]
                       for name in ("dtype", "device", "requires_grad", "is_cuda", "is_meta", "layout")}


class LookupRefusal(ValueError):
    """A read of a split embedding's weight that its rows on this rank cannot answer; `embedding`
    names the module, `what` the read."""

    embedding = ""
    what = ""


def _refusal(module: nn.Module, what: str) -> ValueError:
    error = LookupRefusal(f"parallelize: the embedding {module.autoshard_name!r} ({module.autoshard_class.__name__}) "
                          f"{what}; its forward sees only this rank's rows of the table. Keep it whole with "
                          f"autoshard.plan(model, overrides={{{module.autoshard_name!r}: 'replicate'}})")
    error.embedding, error.what = module.autoshard_name, what
    return error


def _sharded_lookup(module: nn.Module, ids: torch.Tensor, padding_idx) -> torch.Tensor:
    if padding_idx is not None:
        padding_idx = operator.index(padding_idx)
        if padding_idx < 0:  # counted from the end of the whole table, as nn.Embedding does
            padding_idx += module.num_embeddings
    return lookup(module, ids, padding_idx)


class WholeTableLookups(TorchFunctionMode):
    """While an embedding subclass's forward runs: its lookups become vocab-parallel."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = self.module.weight
        if func is F.embedding:
            call = _EMBEDDING.bind(*args, **kwargs).arguments
            if call["weight"] is weight:
                self._check_flags(call.get("max_norm"), call.get("scale_grad_by_freq", False), call.get("sparse", False))
                return _sharded_lookup(self.module, call["input"], call.get("padding_idx"))
        elif func in (torch.embedding, torch.ops.aten.embedding.default) and args and args[0] is weight:
            # torch.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)
            rest = list(args[2:]) + [None] * 3
            padding_idx = kwargs.get("padding_idx", -1 if rest[0] is None else rest[0])
            self._check_flags(None, kwargs.get("scale_grad_by_freq", rest[1] or False), kwargs.get("sparse", rest[2] or False))
            return _sharded_lookup(self.module, args[1], None if padding_idx == -1 else padding_idx)
        elif func is torch.Tensor.__getitem__ and args[0] is weight:
            ids = self._rows_indexed(args[1])
            if ids is not None:
                return _sharded_lookup(self.module, ids, None)
        if getattr(func, "__self__", None) not in _SAME_ON_EVERY_RANK and \
                any(a is weight for a in tree_flatten((args, kwargs))[0]):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise _refusal(self.module, f"reads its weight other than by a lookup ({name}) in its forward")
        return func(*args, **kwargs)

    def _rows_indexed(self, index):
        """The ids of the rows `weight[index]` reads where that is a lookup (Whisper's positions
        `weight[start:start + length]`, a table indexed by an integer tensor); else None."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, slice):
            return torch.arange(*index.indices(self.module.num_embeddings), device=self.module.weight.device)
        if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
            return index
        return None

    def _check_flags(self, max_norm, scale_grad_by_freq, sparse) -> None:
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise _refusal(self.module, "looks rows up with max_norm, scale_grad_by_freq or sparse, which the "
                                        "vocab-parallel lookup does not support")


def _keeps_own_forward(own_forward):
    def forward(self, *args, **kwargs):
        with WholeTableLookups(self):
            return own_forward(self, *args, **kwargs)

    return forward


def shard_embedding_subclass(module: nn.Embedding, name: str, group: ProcessGroup) -> nn.Module:
    """`module` itself, its table reduced to this rank's rows and its class to one whose forward
    runs its own under WholeTableLookups."""
    sharded = VocabParallelEmbedding.from_embedding(module, group)
    original = type(module)
    cls = type(f"VocabParallel{original.__name__}", (original,),
               {"forward": _keeps_own_forward(original.forward), "autoshard_class": original,
                "__module__": original.__module__})
    module.__class__ = cls
    module.weight = sharded.weight
    module.autoshard_name = name
    for attr in ("vocab_start", "group", "shard_specs", "padding_idx"):
        setattr(module, attr, getattr(sharded, attr))
    attach_layer_state(module)
    return module
