"""Giving meta tensors real storage, and values to those no checkpoint holds.

A model built on the meta device has no storage at all. Tensors that a checkpoint fills get
empty storage first; the rest (non-persistent buffers such as rotary ``inv_freq``, BERT's
``position_ids``) are computed by the model's own initialisation: for a transformers model,
``initialize_weights()`` with every loaded tensor and every module that owns nothing to
compute marked as initialised, which is how transformers' ``from_pretrained`` fills them.
A tensor that nothing writes is an error, never left holding whatever its memory held.
"""

import weakref
from typing import Dict, List

import torch
from torch import nn

from ..conventions.huggingface import INITIALISED_FLAG, initialises_itself
from ..core.parallel_state import keep_state_across_swap


def check_movable(tensors: Dict[str, torch.Tensor]) -> None:
    """Raises, before anything changes, if a meta tensor cannot get storage in place (torch
    refuses to swap the storage of a tensor that something holds a weak reference to)."""
    held = [name for name, t in tensors.items() if t.device.type == "meta" and weakref.getweakrefcount(t) > 0]
    if held:
        raise RuntimeError(f"load_pretrained: {held} are on the meta device and something holds weak references "
                           "to them, so they cannot be given storage in place; drop those references, or "
                           "materialize the model (model.to_empty(device=...)) before loading")


def check_computable(model: nn.Module, unread: Dict[str, torch.Tensor]) -> None:
    """Raises, before anything changes, if meta tensors that the checkpoint does not hold would
    be left for an initialisation the model does not have (the check after the fact, in
    initialise_remaining, covers an initialisation that skips some)."""
    on_meta = [name for name, t in unread.items() if t.device.type == "meta"]
    if on_meta and not _initialisers(model):
        raise RuntimeError(
            f"load_pretrained: {on_meta} are on the meta device, the checkpoint does not hold them, and the model "
            "has no initialisation to compute them (initialize_weights); load a checkpoint that holds them, or "
            "give the model real tensors for them before loading. The model was left unchanged")


def materialize(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """Gives a meta tensor (a Parameter or a buffer) empty storage, in place: the object stays
    the same, so every module that shares it, an optimizer built on it and its hooks carry over."""
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(torch.empty(tensor.shape, device=device, dtype=dtype), requires_grad=tensor.requires_grad)
    else:
        new = torch.empty(tensor.shape, device=device, dtype=dtype)
    # The swap exchanges the objects' __dict__ too: the reference to the model's state stays.
    keep_state_across_swap(tensor, new)
    torch.utils.swap_tensors(tensor, new)
    # Hooks registered on the meta tensor (parallelize's data-parallel gradient averaging, a
    # user's) stay with the Python object, but autograd looks for them on the storage that was
    # swapped out: assigning them again registers them with the new one.
    for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(tensor, attr, None)
        if hooks is not None:
            setattr(tensor, attr, hooks)


def _initialisers(model: nn.Module) -> List[nn.Module]:
    """The outermost modules that know how to initialise themselves (transformers models)."""
    if initialises_itself(model):
        return [model]
    found = []
    for child in model.children():
        found += _initialisers(child)
    return found


def initialise_remaining(model: nn.Module, pending: Dict[str, torch.Tensor], loaded: Dict[str, torch.Tensor]) -> None:
    """Computes the ``pending`` tensors (name -> tensor with fresh storage) with the model's own
    initialisation, leaving every ``loaded`` tensor untouched; raises naming any tensor that
    nothing wrote, or any loaded one that the initialisation changed."""
    if not pending:
        return
    versions = {name: t._version for name, t in {**pending, **loaded}.items()}
    owners = {id(t) for t in pending.values()}
    # Everything that carries the flag only while this runs (transformers also flags the
    # modules it initialises): the model is left as it was found.
    objects = list(model.modules()) + list(loaded.values()) + list(pending.values())
    unflagged = [obj for obj in objects if not getattr(obj, INITIALISED_FLAG, False)]
    try:
        for tensor in loaded.values():
            setattr(tensor, INITIALISED_FLAG, True)
        for module in model.modules():
            own = list(module._parameters.values()) + list(module._buffers.values())
            if not any(t is not None and id(t) in owners for t in own):
                setattr(module, INITIALISED_FLAG, True)
        with torch.no_grad():
            for initialiser in _initialisers(model):
                initialiser.initialize_weights()
    finally:
        for obj in unflagged:
            if INITIALISED_FLAG in getattr(obj, "__dict__", {}):
                delattr(obj, INITIALISED_FLAG)
    changed = [name for name, t in loaded.items() if t._version != versions[name]]
    if changed:
        raise RuntimeError(f"load_pretrained: the model's own initialisation overwrote loaded tensors {changed}")
    unwritten = [name for name, t in pending.items() if t._version == versions[name]]
    if unwritten:
        raise RuntimeError(
            f"load_pretrained: {unwritten} are on the meta device, the checkpoint does not hold them, and the "
            "model's initialisation does not compute them; load a checkpoint that holds them, or give the "
            "model real tensors for them before loading")
