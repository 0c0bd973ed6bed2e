"""Function caches in a model's code, emptied before each trace on meta.

A model may cache what a function computed from its arguments (functools.lru_cache;
transformers' compile_compatible_method_lru_cache, over DINOv3's patch coordinates and SAM 3's
position encodings). A trace on meta fills such a cache with meta tensors, and the next trace
with the same arguments, parallelize's dry run, gets them back without running their ops: it
would see fewer ops than the plan traced, and keep the model whole for that. Emptied before
each trace, every trace runs the same ops. A cache only saves work, so emptying it changes no
result.

A module may also keep what its forward computed in its own attributes (fair-esm's rotary
`_cos_cached` beside `_seq_len_cached`, a table computed on the first call and reused by the
next): every trace runs inside fresh_caches(), which gives each module back the attributes and
buffers it had before the trace, so that no trace, nor the user's model planned on meta, keeps
what a trace left there."""

import contextlib
import functools
import sys
from typing import Iterable, Iterator, Set

import torch
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


def _cached_value(value) -> bool:
    """Whether an attribute's value is one a forward may keep as its cache: a tensor, a size, a
    flag, or None (a cache not filled yet); functions, modules and hooks are not."""
    return value is None or isinstance(value, (torch.Tensor, int, float, bool, tuple))


@contextlib.contextmanager
def fresh_caches(model: nn.Module) -> Iterator[None]:
    """Empties the function caches, and gives each module of `model` back the cached attributes
    and buffers it held on entry when the block ends: those a forward set to another value, and
    tensors it added."""
    clear_model_caches(model)
    kept = [(module, dict(vars(module)), dict(module._buffers)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes, buffers in kept:
            state = vars(module)
            for key in [k for k, v in state.items() if k not in attributes and isinstance(v, torch.Tensor)]:
                del state[key]
            state.update({k: v for k, v in attributes.items() if state.get(k) is not v and _cached_value(v)})
            module._buffers.update(buffers)
