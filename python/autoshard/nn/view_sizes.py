"""Sizes a module reads from a whole tensor and reshapes a sharded one with.

nanoGPT's attention takes `B, T, C = x.size()` from its input, which every rank holds whole,
and ends with `y.view(B, T, C)` on its heads' output, which a rank holds a part of: C is the
global width there, and no attribute holds it that the plan could make local. The plan names
such calls instead (planner/local_attributes.py finds them on meta): the n-th view or reshape in
one call of the module, the position in its sizes, and the global size found there. While the
module runs, a torch function mode gives those calls this rank's size. The calls counted are
those of the model's own code in the module's own call: a region nested inside counts its own,
and calls made by torch or autoshard (a sharded layer's forward, which the plan's meta trace runs
as a stand-in) are not counted, so that the trace and the sharded model count alike.

A call is changed only where it holds the global size the plan found there, whether or not the
global shape would also fit the local tensor (`reshape(-1, C)` fits a part of the rows): the plan
found that this call meets a part of the tensor it names whole.
"""

import sys
import threading
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Calls that take a target shape, as the model writes them (the ATen ops below them are
# reached from these; a model calling ATen directly is traced and refused as before).
VIEW_FUNCTIONS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape})

# (ordinal of the call within one module call, position in its sizes, global size)
ViewSize = Tuple[int, int, int]

_active = threading.local()


def _stack() -> List["LocalViewSizes"]:
    if not hasattr(_active, "modes"):
        _active.modes = []
    return _active.modes


def view_target(func, args, kwargs):
    """(tensor, sizes) of a view or reshape call, sizes as a list; None for view(dtype)."""
    if func is torch.reshape:
        tensor = args[0] if args else kwargs["input"]
        sizes = args[1] if len(args) > 1 else kwargs["shape"]
    else:
        tensor, rest = args[0], args[1:]
        sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else \
            rest if rest else kwargs.get("shape", kwargs.get("size"))
    if sizes is None or isinstance(sizes, torch.dtype) or not all(isinstance(s, int) for s in sizes):
        return None
    return tensor, list(sizes)


def _library_frame(depth: int) -> bool:
    """Whether the Python code making the call `depth` frames up is torch's or autoshard's."""
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return name.split(".", 1)[0] in ("torch", "autoshard")


class LocalViewSizes(TorchFunctionMode):
    """One call of a module: its view and reshape calls counted, those of `local` (ordinal ->
    {position: (global, local)}) given the local size. `seen`, if given, gets (ordinal, input
    shape, sizes, returned) of every call counted, `returned` set once the call returns: what
    the plan's search reads to find the call that failed."""

    def __init__(self, local: Dict[int, Dict[int, Tuple[int, int]]], seen: list = None):
        super().__init__()
        self.local, self.seen, self.count = local, seen, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stack = _stack()
        if func not in VIEW_FUNCTIONS or not stack or stack[-1] is not self or _library_frame(1):
            return func(*args, **kwargs)
        target = view_target(func, args, kwargs)
        if target is None:
            return func(*args, **kwargs)
        tensor, sizes = target
        ordinal, self.count = self.count, self.count + 1
        record = [ordinal, tuple(tensor.shape), tuple(sizes), False]
        if self.seen is not None:
            self.seen.append(record)
        fixes = self.local.get(ordinal)
        if fixes and all(p < len(sizes) and sizes[p] == g for p, (g, _) in fixes.items()):
            local = list(sizes)
            for position, (_, size) in fixes.items():
                local[position] = size
            result = func(tensor, local)
        else:
            result = func(*args, **kwargs)
        record[3] = True
        return result


class ViewSizeHooks:
    """Forward hooks that run `module`'s calls inside a LocalViewSizes of `local`. `enabled`
    off (the unsharded view of the model, see state/unsharded.py) leaves its calls as written."""

    def __init__(self, module: nn.Module, local: Dict[int, Dict[int, Tuple[int, int]]], seen: list = None):
        self.local, self.seen, self.enabled, self.modes = local, seen, True, []
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args):
        mode = LocalViewSizes(self.local if self.enabled else {}, self.seen)
        mode.__enter__()
        _stack().append(mode)
        self.modes.append(mode)

    def _exit(self, module, args, output):
        mode = self.modes.pop()
        _stack().pop()
        mode.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def local_sizes(view_sizes: Sequence[ViewSize], local_value) -> Dict[int, Dict[int, Tuple[int, int]]]:
    """The plan's records as LocalViewSizes takes them, with `local_value(global)` this rank's size."""
    by_call: Dict[int, Dict[int, Tuple[int, int]]] = {}
    for ordinal, position, size in view_sizes:
        by_call.setdefault(ordinal, {})[position] = (size, local_value(size))
    return by_call


def region_view_sizes(region, rank: int, world_size: int) -> dict:
    """A region's view sizes on `rank`, as nn/view_sizes.LocalViewSizes takes them."""
    return local_sizes(region.view_sizes, lambda size: region.local_value(size, rank, world_size))
