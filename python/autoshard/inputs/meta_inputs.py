"""Meta copies of a model and its example inputs, and the recorded inputs of a module call
replayed later (the attribute choice, the dry run)."""

import copy
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .hf_inputs import example_inputs_for
from .meta_shadow import tensors_within
from .meta_values import KnownValues


def split_inputs(example_inputs) -> Tuple[tuple, dict]:
    """example_inputs as (args, kwargs): a dict is keyword arguments, a tuple or list positional
    arguments, anything else the one positional argument."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def inputs_on_meta(model: nn.Module, example_inputs, values: KnownValues, media: bool = True) -> Tuple[tuple, dict]:
    """The example inputs (made for `model` if None, with images or audio beside its text unless
    `media` is False) on meta, their values known to `values`."""
    if example_inputs is None:
        args, kwargs = example_inputs_for(model, media=media)
    else:
        args, kwargs = split_inputs(example_inputs)
    return values.to_meta(args), values.to_meta(kwargs)


def clone_or_none(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if value is None else value.clone()


def describe_inputs(args, kwargs) -> Dict[str, Any]:
    """The shapes and dtypes of example inputs, as a plan records them (None for an argument that
    is no tensor)."""
    describe = lambda v: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} \
        if isinstance(v, torch.Tensor) else None
    return {"args": [describe(a) for a in args],
            "kwargs": {k: describe(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}


class StateAtCall:
    """A stateful input (a key/value cache that grows with each call) as it was when a module
    was first called: each replay gets a fresh copy of it, so that the replay traces the ops
    the capture traced (a sliding window's slices of the cache) and leaves no trace behind."""

    def __init__(self, state):
        self._state = _copy_structure(state)

    def fresh(self):
        return _copy_structure(self._state)

    # Identical blocks are given caches of the same kind; what they hold of earlier blocks is
    # not what a block's own call reads.
    def __eq__(self, other):
        return isinstance(other, StateAtCall) and type(other._state) is type(self._state)

    def __hash__(self):
        return hash(type(self._state))


def _copy_structure(state):
    """A deep copy of `state` that shares its tensors: the containers and objects that a cache
    rebinds as it grows are copied, while meta tensors, which hold no data to change, are not
    (copying them would make the capture's cost grow with the square of the layer count)."""
    return copy.deepcopy(state, {id(t): t for t in tensors_within(state)})


def replayable(value):
    """A module's inputs with stateful objects kept as they were at the call (StateAtCall),
    or None for one that cannot be copied."""
    if isinstance(value, (torch.Tensor, int, float, bool, str, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(replayable(v) for v in value)
    if isinstance(value, dict):
        return {k: replayable(v) for k, v in value.items()}
    try:
        return StateAtCall(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is replayed as None
        return None


def replay_inputs(value):
    """Recorded inputs ready for one replay: every StateAtCall replaced by a fresh copy."""
    return tree_map(lambda v: v.fresh() if isinstance(v, StateAtCall) else v, value)


def input_shapes(args, kwargs) -> str:
    """The example inputs' shapes in words: "input_ids (2, 8), ..."."""
    named = [(f"input {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in named if isinstance(v, torch.Tensor))
