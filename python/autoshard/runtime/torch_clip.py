"""torch.nn.utils.clip_grad_norm_ over a parallelized model's parameters computes the global
norm, as autoshard.clip_grad_norm_ does.

torch's function sums the squares of the gradients it is given. On a rank these are the local
shards: each rank would find its own norm, and clip its shards and the replicated parameters by
its own factor, the replicas drifting apart. accelerate, the Trainer and most training loops
call it. Its two steps (`_get_total_norm`, `_clip_grads_with_norm_`) are looked up in torch's
module at each call, so replacing them there reaches every caller, even one that imported
clip_grad_norm_ before autoshard: gradients of a parallelized model's parameters get the global
norm and the scaling of each rank's local part; any other call is torch's own.
"""

import torch

from .clip import global_grad_norm, scale_grads_
from ..core.parallel_state import live_states, parameter_state
import torch.nn.utils as utils
from torch.nn.utils import clip_grad

_ORIGINAL = {}


def _parameters_of(tensors):
    """The parallelized models' parameters whose gradients are `tensors`: (found, all of them?)."""
    by_grad = {id(p.grad): p for state in live_states() if (model := state.model) is not None
               for p in model.parameters() if p.grad is not None}
    found = [by_grad[id(t)] for t in tensors if id(t) in by_grad]
    return found, len(found) == len(tensors)


def _mixed() -> ValueError:
    return ValueError("clip_grad_norm_: the gradients given mix a parallelized model's parameters with others; "
                      "clip each model's parameters in its own call (autoshard.clip_grad_norm_ for the "
                      "parallelized one)")


def _total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    params, all_found = _parameters_of(tensors)
    if not params:
        return _ORIGINAL["_get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)
    if not all_found:
        raise _mixed()
    return global_grad_norm(params, float(norm_type), error_if_nonfinite)


def _of_parallelized_models(parameters):
    """Those of `parameters` a parallelized model holds: tagged by parallelize, or registered on the
    model since. Under fully_shard over "dp" the parameters registered when the first forward
    tagged them are, for the groups FSDP had gathered by then, its unsharded ones: the sharded
    parameters it registers after are untagged."""
    if all(parameter_state(p) is not None for p in parameters):
        return parameters
    registered = {id(p) for state in live_states() if state.model is not None for p in state.model.parameters()}
    return [p for p in parameters if parameter_state(p) is not None or id(p) in registered]


def _clip_with_norm(parameters, max_norm, total_norm, foreach=None):
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    ours = _of_parallelized_models(parameters)
    if not ours:
        return _ORIGINAL["_clip_grads_with_norm_"](parameters, max_norm, total_norm, foreach)
    if len(ours) != len(parameters):
        raise _mixed()
    with torch.no_grad():
        scale_grads_(ours, float(max_norm), total_norm)


def install() -> None:
    """Routes torch's clipping of a parallelized model's gradients to the global norm (once;
    runtime/torch_patches.py installs it while a parallelized model lives)."""
    if _ORIGINAL:
        return
    for name, replacement in (("_get_total_norm", _total_norm), ("_clip_grads_with_norm_", _clip_with_norm)):
        _ORIGINAL[name] = getattr(clip_grad, name)
        setattr(clip_grad, name, replacement)
        public = name.lstrip("_")
        if getattr(utils, public, None) is _ORIGINAL[name]:
            setattr(utils, public, replacement)
        if getattr(clip_grad, public, None) is _ORIGINAL[name]:
            setattr(clip_grad, public, replacement)


def remove() -> None:
    """Gives torch its own clipping back, where nothing replaced autoshard's since."""
    replacements = {"_get_total_norm": _total_norm, "_clip_grads_with_norm_": _clip_with_norm}
    for name, original in list(_ORIGINAL.items()):
        public = name.lstrip("_")
        for owner, attr in ((clip_grad, name), (clip_grad, public), (utils, public)):
            if getattr(owner, attr, None) is replacements[name]:
                setattr(owner, attr, original)
    _ORIGINAL.clear()


def is_installed() -> bool:
    return clip_grad._get_total_norm is _total_norm
