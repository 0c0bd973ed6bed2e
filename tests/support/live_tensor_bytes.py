"""The most bytes of CPU tensors a block's ops hold at once: what torch.cuda.max_memory_allocated
measures on a GPU, for CPU tensors, from the ops themselves (torch's CPU allocator keeps no
statistics)."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """`peak`: the most bytes of storages made by ops inside the block that were alive at once,
    a storage counted from the op that returns it until it is freed; the storages of `existing`
    (and their views) are not counted."""

    def __init__(self, existing=()):
        super().__init__()
        self._existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self._alive = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self._alive.items() if ref.expired()]:
            self.current -= self._alive.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self._alive and ref.cdata not in self._existing and storage.nbytes():
                    self._alive[ref.cdata] = (ref, storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out
