"""A parallelized model's ``state_dict()`` as the tools that read it by name expect: the global
tensors, each rank holding its chunks.

A sharded parameter is a plain local tensor under the unsharded model's name. A tool that reads
``model.state_dict()`` by name (torch's DCP, ``get_model_state_dict``) would take each rank's
shard for the whole tensor and save one rank's piece under the full name. So in the state dict
each sharded entry is a ``ShardView``: a tensor subclass of the *global* shape and dtype whose data
is this rank's local tensor, which describes its chunks through the protocol DCP's planners read
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). DCP then writes
global metadata, reshards on load to any world size, and a plain unsharded model loads the same
checkpoint. The chunks follow the shard's own layout (numpy's ``array_split`` rule, whole heads,
fused q/k/v parts, KV heads held by several ranks), not torch.chunk's.

Anything else done to a ``ShardView`` as if it were the whole tensor raises an error naming
``autoshard.full_state_dict``; ``model.load_state_dict`` takes ``ShardView`` entries back (DCP loads
into them in place) and also full tensors, keeping this rank's part.
"""

from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..core.spec import ShardSpec
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["ShardView", "fully_sharded_entry", "install_state_dict_views", "local_of", "unwrap_shard_views"]


class ShardView(torch.Tensor):
    """This rank's shard of a sharded tensor, seen as the global tensor it belongs to.

    ``shape`` and ``dtype`` are the global tensor's; ``local`` is the rank's tensor (its chunks,
    in local order, along ``spec.dim``). DCP saves the chunks this rank owns and loads into every
    chunk it holds."""

    _local: torch.Tensor
    spec: ShardSpec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec):
        if local.dim() <= spec.dim or local.shape[spec.dim] != spec.local_size():
            raise ValueError(f"ShardView: the local tensor has shape {tuple(local.shape)}, the shard spec expects "
                             f"{spec.local_size()} on dim {spec.dim}")
        view = torch.Tensor._make_wrapper_subclass(cls, spec.full_shape(local.shape), dtype=local.dtype,
                                                   device=local.device, requires_grad=False)
        view._local = local
        view.spec = spec
        return view

    @property
    def local(self) -> torch.Tensor:
        return self._local

    def __repr__(self) -> str:
        return (f"ShardView(shape={tuple(self.shape)}, rank={self.spec.rank} of {self.spec.world_size}, "
                f"local shape={tuple(self._local.shape)}, dtype={self.dtype})")

    def __reduce_ex__(self, protocol):
        # Pickled as what it holds (torch.save of one rank's state dict, reloaded at the same size).
        return (ShardView, (self._local, self.spec))

    # -- where the local chunks sit in the global tensor --------------------------------------
    def _runs(self, ranges: List[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
        """(global start, length, local start) of each run in `ranges` (full coordinates)."""
        runs, local_start = [], 0
        held = []
        for start, length in self.spec.local_ranges():
            held.append((start, length, local_start))
            local_start += length
        for start, length in ranges:
            for held_start, held_length, held_local in held:
                if held_start <= start and start + length <= held_start + held_length:
                    runs.append((start, length, held_local + start - held_start))
                    break
            else:
                raise ValueError(f"ShardView: rank {self.spec.rank} holds no run [{start}, {start + length})")
        return runs

    def _chunk(self, start: int, length: int) -> Tuple[torch.Size, torch.Size]:
        offsets = [0] * self.dim()
        offsets[self.spec.dim] = start
        sizes = list(self.shape)
        sizes[self.spec.dim] = length
        return torch.Size(offsets), torch.Size(sizes)

    def __create_write_items__(self, fqn: str, obj) -> list:
        items = []
        # Several ranks may hold one KV head: the lowest holder writes it, so chunks never overlap.
        for start, length, _ in self._runs(self.spec.owned_ranges()):
            if length == 0:
                continue
            offsets, sizes = self._chunk(start, length)
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                       properties=TensorProperties.create_from_tensor(self._local),
                                       size=self.size())))
        return items

    def __create_chunk_list__(self) -> list:
        chunks = []
        for start, length, _ in self._runs(self.spec.local_ranges()):
            if length:
                offsets, sizes = self._chunk(start, length)
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        return chunks

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        if index.offset is None:
            raise ValueError(f"ShardView: DCP asked for {index.fqn!r} without an offset")
        start = index.offset[self.spec.dim]
        for held_start, length, local_start in self._runs(self.spec.local_ranges()):
            if held_start == start:
                return self._local.narrow(self.spec.dim, local_start, length)
        raise ValueError(f"ShardView: rank {self.spec.rank} holds no chunk of {index.fqn!r} at offset "
                         f"{tuple(index.offset)}")

    # -- every other use ----------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func.overloadpacket
        if base in (torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten._to_copy, torch.ops.aten.clone):
            # Moving or copying the view keeps it a view (DCP's and state_dict's own detach, .cpu()).
            (view,) = [a for a in args if isinstance(a, ShardView)][:1]
            local = func(view._local, *args[1:], **kwargs)
            return ShardView(local, view.spec)
        if base in (torch.ops.aten.new_empty, torch.ops.aten.empty_like) and isinstance(args[0], ShardView) \
                and (base is torch.ops.aten.empty_like or list(args[1]) == list(args[0].shape)):
            # A buffer shaped like the view (DCP's async staging copies into one): shaped like its local.
            view = args[0]
            shape = () if base is torch.ops.aten.empty_like else (tuple(view._local.shape),)
            return ShardView(func(view._local, *shape, *args[2:], **kwargs), view.spec)
        names = ", ".join(repr(a) for a in args if isinstance(a, ShardView))
        raise _not_whole(f"{func} on {names}")

    def numpy(self, *args, **kwargs):
        raise _not_whole(f"numpy() on {self!r}")

    def tolist(self):
        raise _not_whole(f"tolist() on {self!r}")

    def __array__(self, *args, **kwargs):
        raise _not_whole(f"numpy.asarray on {self!r}")

    def untyped_storage(self):
        # What a name-based saver (save_pretrained, safetensors) reads first: the whole tensor's bytes.
        raise _not_whole(f"untyped_storage() of {self!r}")


def _not_whole(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what}: this state-dict entry is one rank's shard of a tensor split by autoshard, shown with the "
        "global shape so that torch.distributed.checkpoint saves and reshards it. It holds no whole tensor: use "
        "autoshard.full_state_dict(model) for the unsharded tensors (a collective: call it on every rank; to write "
        "a Hugging Face directory, pass them as save_pretrained(..., state_dict=...) on rank 0), autoshard.checkpoint "
        "or torch.distributed.checkpoint for sharded checkpoints, or `.local` for this rank's piece.")


def unwrap_shard_views(tree):
    """`tree` with every ShardView replaced by its local tensor."""
    return tree_map_only(ShardView, lambda v: v.local, tree)


def install_state_dict_views(model: nn.Module, shards: Dict[int, Tuple[ShardSpec, object]]) -> None:
    """Makes `model.state_dict()` (and any submodule's) give ShardViews for the sharded
    parameters, and `load_state_dict` take them, or full tensors, back: on every module that
    registers a sharded parameter (a tied one under each of its owners)."""
    for module in model.modules():
        specs = {attr: shards[id(param)][0] for attr, param in module._parameters.items()
                 if param is not None and id(param) in shards}
        if specs:
            module.register_state_dict_post_hook(_views_on_save(specs))
            module.register_load_state_dict_pre_hook(_local_on_load(specs))


def _views_on_save(specs: Dict[str, ShardSpec]):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        for attr, spec in specs.items():
            key = prefix + attr
            value = state_dict.get(key)
            # keep_vars=True asks for the parameters themselves (DDP, FSDP, accelerate): left as they
            # are; so is a whole tensor (full_state_dict runs the model's own hooks on whole tensors).
            if hasattr(value, "device_mesh") and not isinstance(value, nn.Parameter):
                raise fully_sharded_entry(f"state_dict: {key!r}")
            if isinstance(value, torch.Tensor) and not isinstance(value, (nn.Parameter, ShardView)) \
                    and value.dim() > spec.dim and value.shape[spec.dim] == spec.local_size():
                state_dict[key] = ShardView(value, spec)
    return hook


def fully_sharded_entry(what: str) -> ValueError:
    """The error for a state dict entry that is FSDP's DTensor of a tensor-parallel shard: it has
    the shard's shape, and a tool reading it by name (DCP) would save one tensor-parallel rank's
    shard as the whole tensor."""
    return ValueError(f"{what} is FSDP's piece of a tensor-parallel shard (fully_shard over 'dp' of a "
                      "parallelized model), which a tool reading the state dict by name would take for the whole "
                      "tensor. Save with autoshard.full_state_dict(model) (the unsharded tensors, on every rank), or "
                      "use autoshard's own dp x tp path, parallelize(model, mesh=mesh), with torch.distributed.checkpoint")


def _local_on_load(specs: Dict[str, ShardSpec]):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for attr, spec in specs.items():
            key = prefix + attr
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor):
                try:
                    state_dict[key] = local_of(value, spec)
                except ValueError as error:
                    error_msgs.append(f"{key}: {error}")
    return hook


def local_of(value: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's tensor of `value` for a parameter split by `spec`: a ShardView's local tensor
    (of the same split only), this rank's part of a whole tensor, else `value` as it is."""
    if isinstance(value, ShardView):
        if value.spec != spec:
            raise ValueError(f"the state dict holds the shard {value.spec}, this rank's parameter is the shard {spec}; "
                             "a shard loads only into the same split (use torch.distributed.checkpoint to reshard)")
        return value.local
    if value.dim() > spec.dim and value.shape[spec.dim] == spec.full_size and spec.full_size != spec.local_size():
        return spec.take(value)  # a whole tensor: this rank keeps its part
    return value
