"""What a training step keeps for backward: the activation memory a rank holds at the peak of
its forward."""

from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["SavedTensorCounter"]


def _holders(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors whose storages hold `t`'s bytes. A wrapper subclass (a DTensor, whose
    local shard holds them; an AsyncCollectiveTensor from torch's functional collectives, whose
    `elem` is the buffer the collective writes into) has a storage of its own that holds
    nothing: its inner tensors, as __tensor_flatten__ names them, are read instead, down to
    plain tensors. Nothing is waited on or copied: a storage's address and size are known as
    soon as the collective's output buffer exists."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, name) for name in names]
    return [leaf for x in inner if isinstance(x, torch.Tensor) for leaf in _holders(x)]


class SavedTensorCounter:
    """Context manager counting the tensors autograd saves for backward while it is active.

        with autoshard.SavedTensorCounter(ignore=model.parameters()) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        saved.bytes, saved.largest  # on this rank

    Each storage counts once, whole, however many saved tensors view it: that is what the
    rank holds until backward frees it. `largest` is the largest single saved tensor's bytes
    (a b x s x V logits tensor shows there). Tensors whose storage is one of `ignore`'s (the
    model's parameters: a Linear saves its weight) are not counted, so that `bytes` is the
    activations alone."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        ignored = list(ignore)
        for i, t in enumerate(ignored):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"SavedTensorCounter: ignore must hold tensors, item {i} is {type(t).__name__}")
        self._ignored = {self._key(h) for t in ignored for h in _holders(t) if h.device.type != "meta"}
        self._storages: Dict[Tuple, int] = {}
        self.largest = 0
        self.tensors = 0
        self._hooks = None

    @staticmethod
    def _key(t: torch.Tensor) -> Tuple:
        return (t.device.type, t.device.index, t.untyped_storage().data_ptr())

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        holders = [h for h in _holders(t) if h.device.type != "meta"]
        keys = [self._key(h) for h in holders]
        if holders and not any(key in self._ignored for key in keys):
            for key, holder in zip(keys, holders):
                self._storages[key] = holder.untyped_storage().nbytes()
            self.largest = max(self.largest, sum(h.numel() * h.element_size() for h in holders))
            self.tensors += 1
        return t

    def __enter__(self) -> "SavedTensorCounter":
        if self._hooks is not None:
            raise RuntimeError("SavedTensorCounter: already active (a counter is entered once at a time)")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
