"""Shards that no tool can take for the whole tensor.

A sharded parameter holds this rank's piece of a weight: a plain local tensor would let any code
outside autoshard's own layers compute with the piece as if it were the whole (a fused LM head
reading ``lm_head.weight`` and normalising over half the vocabulary, ``F.linear(x, layer.weight)``
by hand, a per-row statistic over half a row), silently wrong. So every sharded parameter of a
parallelized model is a ``ShardParameter``: a ``torch.nn.Parameter`` with the same storage, shape
and autograd, whose ``__torch_function__`` looks at each op called on it:

- from autoshard's own code (its layers, optimizers, checkpoints, loading, clipping) and from
  torch.distributed's (DCP, FSDP2 and the collectives treat a tensor as a rank's piece by
  contract), the op runs as on a plain tensor, but where DTensor.from_local, distribute_tensor or
  fully_shard would lay the shard over its own tensor-parallel ranks (shard_distribution);
- from the model's own code (the packages its module classes come from) while one of its modules
  is being called, the op runs too: the plan traced that forward and parallelize's dry run checked
  every local shape in it (an attention sink or an expert weight read by the model itself);
- from anywhere else, an op that computes each element from the same element of its inputs
  (arithmetic, casts, copies, random fills, torch.optim's foreach and fused updates) or only
  reshapes or moves the piece runs too: its result is the shard of the whole's result, and stays
  guarded (a ``ShardValue``), so an optimizer state made ``zeros_like`` a shard is one as well;
- any other op (a product, a lookup, a reduction, indexing, ``numpy()``) raises ``ShardReadError``
  naming the op, the parameter, its split and the code that called it, before it computes.

Where the caller knows it holds a piece, ``autoshard.local(tensor)`` gives the plain local tensor
(an alias, differentiable). Under ``torch.compile``, ``torch.export`` and ``torch.jit.trace`` the
ops run unchecked: a compiled graph of a tool reading a shard is not caught.

The cost is one Python call per op on a shard (benchmarks/bench_shard_guard.py).
"""

import sys
from typing import Dict, FrozenSet, Optional, Tuple

import torch
from torch import nn

from . import shard_distribution

__all__ = ["ShardParameter", "ShardValue", "ShardReadError", "guard_value", "install", "local", "remove"]

# (parameter name, description of its split, the packages of the model's code), in the tensor's __dict__
_INFO = "_autoshard_shard_info"
_MODULE_CALLS = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


class ShardReadError(RuntimeError):
    """An op outside autoshard would compute with one rank's shard as if it were the whole tensor."""


# Names of ops (a torch function's or Tensor method's __name__) that are safe on a piece
# whatever called them, beside aten's pointwise ops: they reshape, move, cast, copy or fill it.
_SAFE = frozenset("""
    view view_as reshape reshape_as t t_ transpose transpose_ permute flatten unflatten squeeze squeeze_
    unsqueeze unsqueeze_ expand expand_as contiguous detach detach_ clone to type type_as float double half
    bfloat16 cpu cuda requires_grad_ copy_ zero_ fill_ normal_ uniform_ bernoulli_ exponential_ random_
    zeros_like ones_like empty_like full_like rand_like randn_like new_empty new_zeros new_ones new_full
    size dim ndimension numel nelement element_size stride storage_offset data_ptr is_contiguous
    is_floating_point is_complex get_device is_pinned pin_memory share_memory_ is_shared untyped_storage
    __len__ __repr__ __format__ __hash__ __deepcopy__ __reduce_ex__ __setstate__ __get__ __set__
    register_hook register_post_accumulate_grad_hook retain_grad _is_view _base _version
    is_set_to set_ record_stream grad backward
""".split())
# Gradients of a shard are left plain, as its .grad is.
_UNGUARDED_RESULTS = frozenset({"grad", "backward"})
# Reductions among the foreach ops: a norm or maximum of a piece is not the whole's.
_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})
# Properties read through __get__ whose value is no piece of the parameter.
_UNGUARDED_PROPERTIES = frozenset({"grad", "_grad"})
_pointwise: Optional[FrozenSet[str]] = None


def _pointwise_names() -> FrozenSet[str]:
    """aten's pointwise ops, by name (in place and out of place), read once from their tags."""
    global _pointwise
    if _pointwise is None:
        names = set()
        for name in dir(torch.ops.aten):
            try:
                packet = getattr(torch.ops.aten, name)
                overloads = packet.overloads()
            except Exception:  # not an op packet
                continue
            if any(torch.Tag.pointwise in getattr(packet, o).tags for o in overloads):
                names.add(name)
        _pointwise = frozenset(names)
    return _pointwise


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name.startswith("__") and name.endswith("__") and name not in _SAFE:
        # Operators: __add__ -> add, __iadd__ -> add_, __rsub__ -> sub.
        bare = name[2:-2]
        if bare[:1] in ("i", "r") and bare[1:] in ("add", "sub", "mul", "truediv", "div", "pow", "and", "or", "xor"):
            return bare[1:].replace("truediv", "div") + ("_" if bare[0] == "i" else "")
        return bare.replace("truediv", "div")
    return name


def _is_safe(func) -> bool:
    name = _op_name(func)
    if name in _SAFE:
        return True
    if name.startswith(("is_", "_is_", "_has_")):  # what the tensor is, not what it holds
        return name != "is_nonzero"
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        return name not in _FOREACH_REDUCTIONS
    return name in _pointwise_names() or name.rstrip("_") in _pointwise_names()


def _ours(module_name: str) -> bool:
    return module_name == "autoshard" or module_name.startswith("autoshard.")


def _trusted(module_name: str) -> bool:
    return _ours(module_name) or module_name.startswith("torch.distributed")


def _caller(frame):
    """The first frame outside torch's own generic code (torch.distributed counts as a caller):
    whoever asked for the op."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "torch" or name.startswith("torch.")) or name.startswith("torch.distributed") \
                or _below_a_checked_call(frame):  # inductor's generated modules are named torch._inductor...
            return frame, name
        frame = frame.f_back
    return None, ""


def _below_a_checked_call(frame) -> bool:
    """Code torch's compilers generated from a program they traced (FX's, inductor's), in which the
    guard stepped aside, and a dispatch mode's handler (a memory or FLOP counter) running an aten
    op that reached it from an op the guard already let through."""
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    return (filename.startswith("<eval_with_key") or "torchinductor" in filename
            or frame.f_code.co_name == "__torch_dispatch__")


def _in_module_call(frame) -> bool:
    while frame is not None:
        if frame.f_code in _MODULE_CALLS:
            return True
        frame = frame.f_back
    return False


def _info(args, kwargs):
    source = next(a for a in _flat(args, kwargs) if isinstance(a, (ShardParameter, ShardValue)))
    return source.__dict__.get(_INFO) or ("a sharded parameter", "split over the ranks", frozenset())


def _unchecked() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


# What to use instead, where the caller is a tool autoshard integrates with (by its package).
_INSTEAD = {
    "torchao": "; for torchao's int8 weight-only quantization, autoshard.integrations.torchao_quantize.quantize_("
               "model, config) computes each row's scale over the whole row",
    "trl": "; for TRL's trainers, autoshard.integrations.SFTTrainer / DPOTrainer (or AutoshardTrainerMixin) compute "
           "its fused LM head over the vocabulary shards",
}


def _refusal(func, args, kwargs, frame) -> ShardReadError:
    guarded = [a for a in _flat(args, kwargs) if isinstance(a, (ShardParameter, ShardValue))]
    name, split, _ = _info(args, kwargs)
    where = "unknown code" if frame is None else \
        f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
    return ShardReadError(
        f"autoshard: {_op_name(func)} on {name}, which holds this rank's shard ({split}, local shape "
        f"{tuple(guarded[0].shape)}), called from {where}: it would compute with one rank's piece as if it "
        "were the whole tensor. Call the model's own modules (they compute with the whole tensor), take whole "
        "values with autoshard.full_state_dict(model) (or autoshard.gather_logits for logits), or, to work on "
        "this rank's piece knowingly, autoshard.local(tensor)"
        + _INSTEAD.get(("" if frame is None else frame.f_globals.get("__name__", "")).partition(".")[0], ""))


def _flat(args, kwargs):
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _shard_among(args, kwargs):
    """The first sharded parameter among an op's arguments, its name and its split; or None."""
    tensor = next((a for a in _flat(args, kwargs) if type(a) is ShardParameter), None)
    return None if tensor is None else (tensor, *_info((tensor,), None)[:2])


def _guard(result, info):
    """`result` with every tensor in it a ShardValue carrying `info`."""
    if isinstance(result, torch.Tensor) and not isinstance(result, (ShardParameter, ShardValue)):
        value = result.as_subclass(ShardValue)
        value.__dict__[_INFO] = info
        return value
    if isinstance(result, (list, tuple)) and any(isinstance(r, torch.Tensor) for r in result):
        return type(result)(_guard(r, info) for r in result) if not hasattr(result, "_fields") else result
    return result


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if _unchecked():  # first: a compiler tracing this function cannot read frames
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    frame = sys._getframe(1)
    if _ours(frame.f_globals.get("__name__", "")):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    frame, module_name = _caller(frame)
    if _trusted(module_name) or _below_a_checked_call(frame):
        if module_name.startswith("torch.distributed"):
            # A DTensor or FSDP over the shard's own ranks.
            shard_distribution.check(frame, lambda: _shard_among(args, kwargs), ShardReadError)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    info = _info(args, kwargs)
    if module_name.partition(".")[0] in info[2] and _in_module_call(frame):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if not _is_safe(func):
        raise _refusal(func, args, kwargs, frame)
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    if _op_name(func) in _UNGUARDED_RESULTS or (_op_name(func) == "__get__" and getattr(
            getattr(func, "__self__", None), "__name__", "") in _UNGUARDED_PROPERTIES):
        return result
    return _guard(result, info)


class ShardParameter(nn.Parameter):
    """A sharded parameter of a parallelized model: see the module's docstring."""

    __torch_function__ = classmethod(_torch_function)

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save, a checkpoint's optimizer state) as the plain tensor it holds, which
        # torch.load(weights_only=True) reads back: what it holds is this rank's piece.
        return nn.Parameter(local(self), self.requires_grad).__reduce_ex__(protocol)


class ShardValue(torch.Tensor):
    """A value computed from a shard outside autoshard, op by op (a shard's detached copy, its
    cast, an optimizer state shaped like it): guarded as the shard is."""

    __torch_function__ = classmethod(_torch_function)

    def __reduce_ex__(self, protocol):
        return local(self).__reduce_ex__(protocol)


def _describe(spec) -> str:
    return f"dim {spec.dim} of {spec.full_size} split over {spec.world_size} ranks, this is rank {spec.rank}'s"


def install(model: nn.Module, shards: Dict[int, Tuple[object, object]], plain: FrozenSet[str] = frozenset()) -> int:
    """Turns every sharded parameter of `model` (`shards`: id -> (ShardSpec, group)) but those
    named in `plain` into a ShardParameter in place (the same object: optimizers, ties and hooks
    keep it). Returns how many."""
    packages = frozenset(type(m).__module__.partition(".")[0] for m in model.modules()) - {"torch", "autoshard"}
    count = 0
    for name, param in model.named_parameters(remove_duplicate=True):
        found = shards.get(id(param))
        if found is None or type(param) is not nn.Parameter or name in plain:
            continue  # whole, or a parameter of another kind (FSDP's DTensors)
        param.__class__ = ShardParameter
        param.__dict__[_INFO] = (name, _describe(found[0]), packages)
        count += 1
    return count


def remove(model: nn.Module) -> None:
    """Makes `model`'s ShardParameters plain parameters again (for measuring the guard's cost)."""
    for param in model.parameters():
        if type(param) is ShardParameter:
            param.__class__ = nn.Parameter


def guard_value(tensor: torch.Tensor, name: str, split: str) -> "ShardValue":
    """`tensor`, one rank's piece of a value (logits over this rank's vocabulary), guarded as a
    shard is: an alias in the autograd graph. Left as it is while a compiler traces, where the guard steps aside."""
    if _unchecked():
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        value = tensor.as_subclass(ShardValue)
    value.__dict__[_INFO] = (name, split, frozenset())
    return value


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece as a plain tensor (an alias of `tensor`, in the autograd graph), for code
    that knows it holds a piece; any other tensor is returned as it is."""
    if not isinstance(tensor, (ShardParameter, ShardValue)):
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)
