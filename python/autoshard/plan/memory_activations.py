"""The bytes autograd saves for backward in one forward of a model sharded for one rank, and the
largest tensor an op makes in it, counted on a meta copy under a fake process group."""

import contextlib
import itertools
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import _holders

_names = itertools.count()


class _MetaSavedBytes:
    """Saved-tensor hooks counting each saved storage once, whole (meta tensors have storages
    of a known size and a distinct identity), except the storages of `ignore`."""

    def __init__(self, ignore: Iterable[torch.Tensor]):
        self._ignored = {h.untyped_storage()._cdata for t in ignore for h in _holders(t)}
        self._storages: Dict[int, int] = {}
        self._alive: List[torch.UntypedStorage] = []  # keeps each identity unique while counting
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        holders = _holders(t)
        storages = [h.untyped_storage() for h in holders]
        if holders and not any(s._cdata in self._ignored for s in storages):
            for storage in storages:
                if storage._cdata not in self._storages:
                    self._storages[storage._cdata] = storage.nbytes()
                    self._alive.append(storage)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op makes while active, in bytes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


@contextlib.contextmanager
def fake_world(world_size: int):
    """A function giving a process group of `world_size` for any rank, whose collectives do
    nothing (torch's fake backend): the sharded layers built with it run on meta as they will
    on that rank. Without a default process group, a fake one is started for the duration."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup, _register_process_group, _unregister_process_group

    started = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        started = True
    names: List[str] = []

    def group(rank: int):
        name = f"autoshard_memory_{os.getpid()}_{next(_names)}"
        pg = dist.ProcessGroup(dist.HashStore(), rank, world_size)
        backend = FakeProcessGroup._create_internal(rank, world_size)
        for device in ("cpu", "meta"):
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
        pg._set_group_name(name)
        _register_process_group(name, pg)
        names.append(name)
        return pg

    try:
        yield group
    finally:
        for name in names:
            _unregister_process_group(name)
        if started:
            dist.destroy_process_group()


def _sharded_copy(model: nn.Module, plan, group, dtype: Optional[torch.dtype], loss_parallel: bool) -> nn.Module:
    """A meta copy of `model` sharded for `group`'s rank as parallelize shards it."""
    from .. import loss_parallel as loss_parallelism
    from ..parallelize import _apply
    from .meta_inputs import meta_shadow

    shadow = meta_shadow(model, always_copy=True)
    if dtype is not None:
        shadow.to(dtype)
    _apply(shadow, plan, group)
    loss_parallelism.install(shadow, plan, group, loss_parallel)
    return shadow


def activation_bytes(model: nn.Module, plan, group, inputs, dtype: Optional[torch.dtype],
                     loss_parallel: bool) -> Tuple[int, int]:
    """(bytes saved for backward, largest tensor an op makes) in one forward of `model` sharded
    for `group`'s rank, on meta."""
    from .meta_autocast import meta_autocast
    from .meta_values import KnownValues

    shadow = _sharded_copy(model, plan, group, dtype, loss_parallel)
    values = KnownValues()
    args, kwargs = values.to_meta(inputs[0]), values.to_meta(inputs[1])
    if dtype is not None:
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        args, kwargs = torch.utils._pytree.tree_map(cast, (args, kwargs))
    saved = _MetaSavedBytes(ignore=list(shadow.parameters()))
    largest = _LargestOutput()
    with torch.enable_grad(), values, meta_autocast(), saved, largest:
        shadow(*args, **kwargs)
    return saved.bytes, largest.bytes
