"""The forward check that no data-parallel wrapper spans the tensor-parallel ranks of a
parallelized model (data_parallel_wrappers says why one would be silently wrong).

DDP is stopped in its constructor already when it wraps the model itself (ddp_guard). Any
wrapper is found at the model's forward, before it computes anything:

- around it: among the modules being called (the callers' frames of ``nn.Module._call_impl``),
  a DDP or FSDP wrapper of a module that holds the model;
- the model itself, which ``fully_shard(model)`` makes an ``FSDPModule``;
- its submodules (FSDP applied layer by layer), on its first forward, and again at a forward
  that finds a sharded module's parameter replaced (fully_shard applied after a forward): a
  walk over every module costs about a millisecond on a model of a few hundred modules, too
  much for each forward; looking up one parameter per sharded module costs far less.

fully_shard over data-parallel ranks is exact: the first forward that finds it hands the model
to fully_sharded.adopt. FSDP1's FullyShardedDataParallel (flat parameters) is refused.

A DDP over data-parallel ranks found around the model is held to ddp_guard's rules.
"""

import sys
import weakref
from typing import Optional, Sequence, Set, Tuple

from torch import nn

from ..conventions.data_parallel_wrappers import (DDP, FULLY_SHARD, describe, fsdp_refusal, fully_shard_groups, refusal,
                                                  spans_tensor_parallel)
from .ddp_guard import check_over_data_parallel
from .fully_sharded import adopt
from ..core.parallel_state import state_of

_CALL_CODE = nn.Module._call_impl.__code__
_STACK_DEPTH = 64  # frames above the check searched for modules being called

_WHEN = "the model's weights or their gradients are no longer those of its shards: build and parallelize the model again"


class WrapperCheck:
    """Raises at a forward of `model` that runs under, or with, a data-parallel wrapper over
    two or more of its tensor-parallel ranks `tp_ranks`."""

    def __init__(self, model: nn.Module, tp_ranks: Sequence[int]):
        self._model = weakref.ref(model)
        self.tp_ranks = list(tp_ranks)
        self._scanned = False
        # (module, attribute, parameter) of each sharded module, as found at the last scan: one
        # replaced since (fully_shard applied after a forward) calls for another scan.
        self._registered: list = []
        # Modules called around the model's forward -> (their class, the wrapper they are of
        # the model, or None). Kept with the class: fully_shard changes a module's class.
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._exact_ddps: weakref.WeakSet = weakref.WeakSet()  # DDPs over "dp" found exact

    def _check(self, found: Optional[Tuple[str, Set[int]]], module: nn.Module, model: nn.Module) -> None:
        if found is not None and spans_tensor_parallel(found[1], self.tp_ranks):
            raise refusal(found[0], found[1], self.tp_ranks, _WHEN)
        if found is not None and found[0] == FULLY_SHARD:
            adopt(model, state_of(model), found[1], fully_shard_groups(module))
        elif found is not None and found[0] != DDP:
            raise fsdp_refusal(found[0], found[1])

    def _around(self, module: nn.Module, model: nn.Module) -> Optional[Tuple[str, Set[int]]]:
        seen = self._seen.get(module)
        if seen is None or seen[0] is not type(module):
            found = describe(module)
            holds = found is not None and any(m is model for m in module.modules())
            seen = self._seen[module] = (type(module), found if holds else None)
        return seen[1]

    def __call__(self) -> None:
        model = self._model()
        if model is None:
            return
        self._check(describe(model), model, model)
        frame = sys._getframe(1)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            if frame.f_code is _CALL_CODE:
                caller = frame.f_locals.get("self")
                if isinstance(caller, nn.Module) and caller is not model:
                    found = self._around(caller, model)
                    self._check(found, caller, model)
                    if found is not None and found[0] == DDP and caller not in self._exact_ddps:
                        check_over_data_parallel(found[1], model, state_of(model))
                        self._exact_ddps.add(caller)
            frame = frame.f_back
        # Once fully_shard is adopted, FSDP swaps the parameters at every forward, as it should.
        adopted = getattr(state_of(model), "fully_sharded_over", None) is not None
        if self._scanned and not adopted and any(
                module._parameters.get(attr) is not param for module, attr, param in self._registered):
            self._scanned = False
        if not self._scanned:
            for module in model.modules():
                if module is not model:
                    self._check(describe(module), module, model)
            self._scanned = True
            self._registered = [(m, attr, m._parameters.get(attr)) for m in model.modules()
                                for attr in list(getattr(m, "shard_specs", {}))[:1] if attr in m._parameters]
