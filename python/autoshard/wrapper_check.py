"""Data-parallel wrappers laid over the tensor-parallel ranks of a parallelized model: refused.

A parallelized model's sharded parameter is a plain tensor that keeps the unsharded model's
name, and each rank of a tensor-parallel group holds a different shard of it. DDP, FSDP
(both ``FullyShardedDataParallel`` and ``fully_shard``) and the Trainer and accelerate, which
wrap the model in one of them under torchrun, take the ranks' tensors of one name for copies
of one tensor: DDP's construction broadcasts rank 0's shards over the others' and averages
different shards' gradients, FSDP splits each rank's shard as if it were whole. Training
goes on and is silently wrong. Such a wrapper is legitimate only over ranks that each hold a
different tensor-parallel rank: the "dp" dimension of a ("dp", "tp") DeviceMesh.

- DDP is stopped in its constructor, before its first broadcast: it reads the model's
  ``_ddp_params_and_buffers_to_ignore`` once its process group is chosen, and the model's
  attribute is a ``DdpGuard`` that refuses a group holding two tensor-parallel ranks.
- Every wrapper (DDP around a module that holds the model, where that attribute is not read)
  is found at the model's forward: among the modules being called around it (the callers'
  frames of ``nn.Module._call_impl``), the model itself (``fully_shard(model)``), and on the
  first forward among its submodules.
"""

import sys
import weakref
from typing import Iterable, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist
from torch import nn

_ALTERNATIVE = ("Wrap the model over its data-parallel group only, whose ranks each hold a different tensor-parallel "
                "rank: the 'dp' dimension of a ('dp', 'tp') DeviceMesh, as in {how}. Or leave data parallelism to "
                "autoshard: parallelize(model, mesh=mesh) with a ('dp', 'tp') DeviceMesh, and no wrapper. "
                "transformers.Trainer and accelerate wrap the model in DistributedDataParallel or FSDP over every "
                "process when started by torchrun")
_HOW = {"DistributedDataParallel": "DistributedDataParallel(model, process_group=mesh.get_group('dp'))",
        "FullyShardedDataParallel": "FullyShardedDataParallel(model, process_group=mesh.get_group('dp'))",
        "fully_shard": "fully_shard(model, mesh=mesh['dp'])"}
_WHY = {"DistributedDataParallel": "DDP takes the ranks' different shards of a parameter for copies of one tensor: "
                                   "it broadcasts rank 0's shards over the others' and averages different shards' "
                                   "gradients",
        "FullyShardedDataParallel": "FSDP takes each rank's shard of a parameter for the whole parameter and splits "
                                    "it again, so that its all-gather mixes different shards",
        "fully_shard": "FSDP takes each rank's shard of a parameter for the whole parameter and splits it again, "
                       "so that its all-gather mixes different shards"}


def _ranks(groups: Iterable) -> Set[int]:
    ranks: Set[int] = set()
    for group in groups:
        if group is not None:
            ranks.update(dist.get_process_group_ranks(group))
    return ranks


def refusal(tool: str, wrapper_ranks: Set[int], tp_ranks: Sequence[int], when: str) -> ValueError:
    shared = sorted(wrapper_ranks & set(tp_ranks))
    return ValueError(f"autoshard: {tool} spans ranks {sorted(wrapper_ranks)}, which hold {len(shared)} ranks "
                      f"{shared} of the tensor-parallel group {list(tp_ranks)} of a parallelized model. {_WHY[tool]}; "
                      f"{when}. {_ALTERNATIVE.format(how=_HOW[tool])}")


_TYPES: Optional[Tuple[type, type, type]] = None


def _wrapper_types() -> Tuple[type, type, type]:
    global _TYPES
    if _TYPES is None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        _TYPES = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    return _TYPES


def _fully_shard_groups(module) -> List:
    """The process groups over which fully_shard communicates for `module`."""
    groups = []
    try:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
    except (AttributeError, AssertionError):
        param_groups = []
    for param_group in param_groups:
        info = param_group.mesh_info
        groups += [getattr(info, "shard_process_group", None), getattr(info, "replicate_process_group", None)]
    return groups


def describe(module) -> Optional[Tuple[str, Set[int]]]:
    """(the tool's name, the ranks it communicates over) for a data-parallel wrapper, else None."""
    ddp, fsdp1, fsdp2 = _wrapper_types()
    if isinstance(module, ddp):
        return "DistributedDataParallel", _ranks([module.process_group])
    if isinstance(module, fsdp1):
        return "FullyShardedDataParallel", _ranks([module.process_group, getattr(module, "_inter_node_pg", None)])
    if isinstance(module, fsdp2):
        return "fully_shard", _ranks(_fully_shard_groups(module))
    return None


class DdpGuard:
    """Stands for a parallelized model's ``_ddp_params_and_buffers_to_ignore`` (the names it
    held before, if any). DDP's constructor reads it as ``set(...)`` once its process group is
    chosen and before any collective: iterating it from there refuses a DDP over two or more
    tensor-parallel ranks. Anything else iterating it sees the names."""

    def __init__(self, tp_ranks: Sequence[int], names: Iterable[str] = ()):
        self.tp_ranks = tuple(tp_ranks)
        self.names = list(names)

    def __iter__(self):
        ddp_type = _wrapper_types()[0]
        frame = sys._getframe(1)
        for _ in range(4):  # set(...) is called by DistributedDataParallel.__init__ itself
            if frame is None:
                break
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if isinstance(owner, ddp_type) and getattr(owner, "process_group", None) is not None:
                ranks = _ranks([owner.process_group])
                if len(ranks & set(self.tp_ranks)) > 1:
                    raise refusal("DistributedDataParallel", ranks, self.tp_ranks,
                                  "it was refused before its first broadcast, and the model is unchanged")
                break
            frame = frame.f_back
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"DdpGuard(tp_ranks={self.tp_ranks}, names={self.names})"


def install_ddp_guard(model: nn.Module, tp_ranks: Sequence[int]) -> None:
    names = getattr(model, "_ddp_params_and_buffers_to_ignore", ())
    model._ddp_params_and_buffers_to_ignore = DdpGuard(tp_ranks, names)


_CALL_CODES = (nn.Module._call_impl.__code__,)
_STACK_DEPTH = 64  # frames above the check searched for modules being called


class WrapperCheck:
    """Raises at a forward of `model` that runs under, or with, a data-parallel wrapper over
    two or more of its tensor-parallel ranks `tp_ranks`."""

    _WHEN = ("the model's weights or their gradients are no longer those of its shards: build and parallelize the "
             "model again")

    def __init__(self, model: nn.Module, tp_ranks: Sequence[int]):
        self._model = weakref.ref(model)
        self.tp_ranks = set(tp_ranks)
        self._tp_list = list(tp_ranks)
        self._scanned = False
        # Modules called around the model's forward -> (their class, what wraps the model there).
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _check(self, found: Optional[Tuple[str, Set[int]]]) -> None:
        if found is not None and len(found[1] & self.tp_ranks) > 1:
            raise refusal(found[0], found[1], self._tp_list, self._WHEN)

    def _around(self, module: nn.Module, model: nn.Module) -> Optional[Tuple[str, Set[int]]]:
        # Kept with the module's class: fully_shard changes it when it wraps a module.
        seen = self._seen.get(module)
        if seen is None or seen[0] is not type(module):
            found = describe(module)
            seen = self._seen[module] = (type(module), found if found is not None
                                         and any(m is model for m in module.modules()) else None)
        return seen[1]

    def __call__(self) -> None:
        model = self._model()
        if model is None:
            return
        self._check(describe(model))  # fully_shard(model)
        frame = sys._getframe(1)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            if frame.f_code in _CALL_CODES:
                caller = frame.f_locals.get("self")
                if isinstance(caller, nn.Module) and caller is not model:
                    self._check(self._around(caller, model))
            frame = frame.f_back
        # Wrappers of submodules (FSDP applied layer by layer, the model itself left out) are
        # looked for once: a walk over every module costs about a millisecond on a model of a
        # few hundred modules, too much for each forward, and wrapping precedes training.
        if not self._scanned:
            for module in model.modules():
                if module is not model:
                    self._check(describe(module))
            self._scanned = True
