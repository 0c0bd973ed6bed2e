"""What a training step keeps for backward: the activation memory a rank holds at the peak of
its forward."""

from typing import Dict, Iterable, Tuple

import torch

__all__ = ["SavedTensorCounter"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the bytes: a DTensor's local shard, else the tensor."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


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
        self._ignored = {self._key(_local(t)) for t in ignored if _local(t).device.type != "meta"}
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
        local = _local(t)
        if local.device.type == "meta":
            return t
        key = self._key(local)
        if key not in self._ignored:
            self._storages[key] = local.untyped_storage().nbytes()
            self.largest = max(self.largest, local.numel() * local.element_size())
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
