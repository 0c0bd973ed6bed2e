"""Function caches in a model's code, emptied before each trace on meta.

A model may cache what a function computed from its arguments (functools.lru_cache;
transformers' compile_compatible_method_lru_cache, over DINOv3's patch coordinates and SAM 3's
position encodings). A trace on meta fills such a cache with meta tensors, and the next trace
with the same arguments, parallelize's dry run, gets them back without running their ops: it
would see fewer ops than the plan traced, and keep the model whole for that. Emptied before
each trace, every trace runs the same ops. A cache only saves work, so emptying it changes no
result."""

import functools
import sys
from typing import Iterable, Set

from torch import nn

# functools' cache wrapper type (functools.cache and lru_cache give one), found without naming
# its private class.
_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(lambda: None))


def _is_cache(value) -> bool:
    return isinstance(value, _LRU_WRAPPER)


def _caches_of(value) -> Iterable:
    """The lru caches `value` is, or wraps: itself, or one held in its closure (a decorator's
    wrapper around functools.lru_cache), looked through staticmethod, classmethod and property."""
    for candidate in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
        if candidate is None:
            continue
        if _is_cache(candidate):
            yield candidate
            continue
        for cell in getattr(candidate, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_cache(contents):
                yield contents


def clear_model_caches(model: nn.Module) -> int:
    """Empties the lru caches defined in the classes of `model`'s modules and in the Python
    modules that define them (torch's own left alone); returns how many were emptied."""
    namespaces, seen = [], set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if id(cls) in seen or cls.__module__.split(".")[0] in ("torch", "builtins", "autoshard"):
                continue
            seen.add(id(cls))
            namespaces.append(vars(cls))
            defining = sys.modules.get(cls.__module__)
            if defining is not None and id(defining) not in seen:
                seen.add(id(defining))
                namespaces.append(vars(defining))
    cleared: Set[int] = set()
    for namespace in namespaces:
        for value in list(namespace.values()):
            for cache in _caches_of(value):
                if id(cache) not in cleared:
                    cache.cache_clear()
                    cleared.add(id(cache))
    return len(cleared)
