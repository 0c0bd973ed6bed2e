"""The bytes autograd saves for backward in one forward of a model sharded for one rank, and the
most bytes the ops of one forward and backward hold at once beyond the model's state, counted on
a meta copy under a fake process group."""

import contextlib
import itertools
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.saved_tensors import _holders
from ..apply.shard_model import apply_plan
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, _register_process_group, _unregister_process_group
from ..runtime import loss_parallel as loss_parallelism
from ..inputs.meta_shadow import meta_shadow
from ..runtime.forward_checks import tensor_inputs
from ..runtime.input_check import _CACHED_LENGTH, _position_weights, fingerprint
from ..inputs.meta_autocast import meta_autocast
from ..inputs.meta_values import KnownValues

_names = itertools.count()


def _storages(tensors: Iterable[torch.Tensor]) -> set:
    return {h.untyped_storage()._cdata for t in tensors for h in _holders(t)}


class _MetaSavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks counting each saved storage once, whole (meta tensors have storages
    of a known size and a distinct identity), except the storages of `ignore`."""

    def __init__(self, ignore: Iterable[torch.Tensor]):
        super().__init__(self._pack, lambda t: t)
        self._ignored = _storages(ignore)
        self._storages: Dict[int, int] = {}
        self._alive: List[torch.UntypedStorage] = []  # keeps each identity unique while counting

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def release(self) -> None:
        """Lets go of the storages counted (once counting is over), so that backward frees them
        as it does on a device."""
        self._alive.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        holders = _holders(t)
        storages = [h.untyped_storage() for h in holders]
        if holders and not any(s._cdata in self._ignored for s in storages):
            for storage in storages:
                if storage._cdata not in self._storages:
                    self._storages[storage._cdata] = storage.nbytes()
                    self._alive.append(storage)
        return t


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops make while it is active that are alive at once, at the most
    (a storage counts from the op that makes it until its last tensor is gone; views of the
    storages of `ignore`, the model's state and inputs, never; only meta tensors, not the CPU
    copies of known values the trace keeps beside them), and the largest tensor one op makes."""

    def __init__(self, ignore: Iterable[torch.Tensor]):
        super().__init__()
        self._ignored = _storages(ignore)
        self._live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "meta":
                self.largest = max(self.largest, t.numel() * t.element_size())
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self._live and ref.cdata not in self._ignored and storage.nbytes():
                    self._live[ref.cdata] = (ref, storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _loss_of(outputs) -> Optional[torch.Tensor]:
    """What a training step calls backward on: the model's loss, else the sum of its first output
    that needs a gradient."""
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if hasattr(outputs, "to_tuple"):
        outputs = outputs.to_tuple()
    first = next((t for t in torch.utils._pytree.tree_leaves(outputs)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()), None)
    return None if first is None else first.sum()


@contextlib.contextmanager
def fake_world(world_size: int):
    """A function giving a process group of `world_size` for any rank, whose collectives do
    nothing (torch's fake backend): the sharded layers built with it run on meta as they will
    on that rank. Without a default process group, a fake one is started for the duration."""
    started = False
    if not dist.is_initialized():
        # Registers the "fake" backend; torch.testing is loaded only when memory is predicted.
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

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
    shadow = meta_shadow(model, always_copy=True)
    if dtype is not None:
        shadow.to(dtype)
    apply_plan(shadow, plan, group)
    loss_parallelism.install(shadow, plan, group, loss_parallel)
    return shadow


def _input_check_bytes(args, kwargs) -> int:
    """The most bytes the check that every rank got the same inputs (forward_checks, on by
    default) holds at once while it hashes them at the start of a forward, on meta. Position
    weights of up to input_check's cached length are kept from one step to the next (made
    before counting); longer ones are made each step."""
    names, tensors = tensor_inputs(args, kwargs)
    tensors = [t for t in tensors if t.device.type == "meta"]
    if not tensors:
        return 0
    meta = torch.device("meta")
    if sum(t.numel() for t in tensors) <= _CACHED_LENGTH:
        _position_weights(sum(t.numel() for t in tensors), meta)
    with _LiveBytes(ignore=tensors) as live:
        fingerprint(names, tensors, meta)
    return live.peak


def activation_bytes(model: nn.Module, plan, group, inputs, dtype: Optional[torch.dtype],
                     loss_parallel: bool) -> Tuple[int, int]:
    """(bytes saved for backward, bytes held at once beyond them) in one training step of `model`
    sharded for `group`'s rank, on meta: a forward, then backward from its loss, the gradients
    already allocated (a step after the first) so that what backward makes beyond them counts.
    The second is the most the step's ops hold at once (the saved activations included; the
    input check's hashing at the start of the forward where the group has ranks to compare)
    less the saved activations; where backward cannot run on meta, twice the largest tensor an
    op makes in the forward (in backward, that tensor's gradient and its input's live at once)."""
    shadow = _sharded_copy(model, plan, group, dtype, loss_parallel)
    values = KnownValues()
    args, kwargs = values.to_meta(inputs[0]), values.to_meta(inputs[1])
    if dtype is not None:
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        args, kwargs = torch.utils._pytree.tree_map(cast, (args, kwargs))
    for p in shadow.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    state = [t for p in shadow.parameters() for t in (p, p.grad) if t is not None] + list(shadow.buffers())
    inputs_given = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    check = _input_check_bytes(args, kwargs) if group.size() > 1 else 0
    saved = _MetaSavedBytes(ignore=list(shadow.parameters()))
    live = _LiveBytes(ignore=state + inputs_given)
    with torch.enable_grad(), values, meta_autocast(), saved, live:
        loss = _loss_of(shadow(*args, **kwargs))  # the outputs go, as a training loop's do
        forward_largest = live.largest
        saved.release()
        try:
            if loss is not None:
                loss.backward()
                return saved.bytes, max(live.peak, check) - saved.bytes
        except Exception:  # noqa: BLE001 - an op with no meta backward: the estimate from the forward alone
            pass
    return saved.bytes, max(2 * forward_largest, check - saved.bytes, 0)
