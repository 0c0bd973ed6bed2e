"""Example inputs for a plain nn.Module, inferred from its forward's signature and the first
layer its input reaches.

A forward with one required tensor argument gets one tensor, shaped for the first layer that
argument reaches:
- a Linear (or a LayerNorm / RMSNorm, a MultiheadAttention): floats (batch, sequence, features);
- an Embedding: integer ids (batch, sequence) within its table, none of them its padding index;
- a Conv1d/2d/3d (or transposed): floats (batch, channels, *spatial), the spatial size large
  enough for every convolution and pooling stride of the model;
- autoshard's EinsumDense: (batch, *its input_shape), a sequence where it leaves a size open.

The first layer reached is found by running the forward on meta copies of the inputs (the model
is already the meta copy the capture runs) and stopping at the first recognised layer called;
a guess made from the layers' registration order is corrected by that run. Where one tensor is
not enough (several required arguments, no recognised layer, an input that reaches its first
layer reshaped) MissingInputs names the argument(s) and says how to pass example_inputs.
"""

import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .missing import HOW_TO_PASS, MissingInputs
from .meta_autocast import meta_autocast
from .meta_values import KnownValues
from ..nn.einsum import EinsumDense

BATCH = 2
SEQUENCE = 8
# Spatial sizes of an inferred image or volume: at least this, at most the caps.
MIN_SPATIAL = 16
MAX_SPATIAL = {1: 4096, 2: 256, 3: 32}

_CONV = (nn.modules.conv._ConvNd,)
_NORMS = tuple(c for c in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if c is not None)
_POOLS = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)


@dataclass
class _Reached:
    name: str
    module: nn.Module
    received: Tuple


class Stop(BaseException):
    """Raised by a hook to end a probing forward with what it found (the first recognised layer
    called, the count at a placeholder check): BaseException, so that a model's own `except
    Exception` does not swallow it."""

    def __init__(self, found):
        super().__init__(found)
        self.found = found


def forward_on_meta(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Runs the model (a meta copy) on meta copies of args and kwargs, without autograd, the
    values of their tensors known to the ops that read them (KnownValues) and autocast on meta."""
    values = KnownValues()
    args, kwargs = values.to_meta((args, kwargs))
    with torch.no_grad(), meta_autocast(), values:
        model(*args, **kwargs)


def _recognised(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding, nn.MultiheadAttention, EinsumDense) + _CONV + _NORMS)


def float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating-point parameter (float32 where it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def as_dtype(tensors: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """`tensors` with the floating-point ones cast to `dtype`, as a processor would give them."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def forward_arguments(module: nn.Module) -> set:
    """The names of the parameters the module's forward takes (none where it has no signature)."""
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _pair(value, dims: int) -> Tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def _spatial_size(model: nn.Module, dims: int) -> int:
    """A spatial size every convolution and pooling of the model can take: the product of their
    strides times the largest (dilated) kernel, within MIN_SPATIAL and the cap for `dims`."""
    strides, kernel = 1, 1
    for module in model.modules():
        if isinstance(module, _CONV):
            strides *= max(_pair(module.stride, dims)) if not module.transposed else 1
            extent = [d * (k - 1) + 1 for d, k in zip(_pair(module.dilation, dims), _pair(module.kernel_size, dims))]
            kernel = max(kernel, *extent)
        elif isinstance(module, _POOLS):
            strides *= max(_pair(module.stride or module.kernel_size, dims))
            kernel = max(kernel, *_pair(module.kernel_size, dims))
    return max(MIN_SPATIAL, min(strides * kernel, MAX_SPATIAL.get(dims, MAX_SPATIAL[3])))


def _ids(embedding: nn.Embedding) -> torch.Tensor:
    """(batch, sequence) ids counting through the table, the padding index left out."""
    count = embedding.num_embeddings
    ids = torch.arange(BATCH * SEQUENCE).reshape(BATCH, SEQUENCE) % count
    padding = embedding.padding_idx
    if padding is not None and count > 1:
        ids = torch.where(ids == padding % count, (padding + 1) % count, ids)
    return ids


def _tensor_for(layer: nn.Module, model: nn.Module) -> torch.Tensor:
    """An input of the shape `layer` takes, in the model's floating-point dtype."""
    generator = torch.Generator().manual_seed(0)
    dtype = float_dtype(layer)
    if isinstance(layer, nn.Embedding):
        return _ids(layer)
    if isinstance(layer, nn.Linear):
        shape = (BATCH, SEQUENCE, layer.in_features)
    elif isinstance(layer, _CONV):
        dims = len(layer.kernel_size)
        shape = (BATCH, layer.in_channels) + (_spatial_size(model, dims),) * dims
    elif isinstance(layer, _NORMS):
        shape = (BATCH, SEQUENCE) + tuple(layer.normalized_shape)
    elif isinstance(layer, nn.MultiheadAttention):
        shape = (BATCH, SEQUENCE, layer.embed_dim)
    else:  # EinsumDense
        shape = (BATCH,) + tuple(SEQUENCE if size is None else size for size in layer.input_shape)
    return torch.randn(shape, generator=generator, dtype=dtype)


def _fits(layer: nn.Module, received: Tuple) -> bool:
    """Whether the first input `layer` received is of the shape the layer takes."""
    x = received[0] if received else None
    if not isinstance(x, torch.Tensor):
        return False
    if isinstance(layer, nn.Embedding):
        return not x.is_floating_point() and not x.is_complex()
    if not x.is_floating_point():
        return False
    if isinstance(layer, nn.Linear):
        return x.dim() >= 1 and x.shape[-1] == layer.in_features
    if isinstance(layer, _CONV):
        dims = len(layer.kernel_size)
        return x.dim() == dims + 2 and x.shape[1] == layer.in_channels
    if isinstance(layer, _NORMS):
        trailing = tuple(layer.normalized_shape)
        return tuple(x.shape[x.dim() - len(trailing):]) == trailing
    if isinstance(layer, nn.MultiheadAttention):
        return x.dim() == 3 and x.shape[-1] == layer.embed_dim
    wanted = tuple(layer.input_shape)
    return x.dim() == len(wanted) + 1 and all(w is None or s == w for s, w in zip(x.shape[1:], wanted))


def required_parameters(model: nn.Module) -> Tuple[List[inspect.Parameter], bool]:
    """The forward's parameters without a default, and whether it takes *args."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return [], True
    required = [p for p in parameters
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return required, any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _call(parameter: inspect.Parameter, tensor, by_keyword: bool = False) -> Tuple[tuple, dict]:
    if by_keyword or parameter.kind is parameter.KEYWORD_ONLY:
        return (), {parameter.name: tensor}
    return (tensor,), {}


def _probe(model: nn.Module, parameter: inspect.Parameter, tensor: torch.Tensor,
           by_keyword: bool = False) -> Optional[_Reached]:
    """Runs the forward on a meta copy of `tensor` up to the first recognised layer called: that
    layer and what it received, or None if the forward ends without calling one."""
    handles = []
    for name, module in model.named_modules():
        if _recognised(module):
            def stop(mod, args, kwargs, name=name):
                raise Stop(_Reached(name, mod, tuple(args) + tuple(kwargs.values())))

            handles.append(module.register_forward_pre_hook(stop, with_kwargs=True))
    try:
        forward_on_meta(model, *_call(parameter, tensor, by_keyword))
    except Stop as stopped:
        return stopped.found
    finally:
        for handle in handles:
            handle.remove()
    return None


def _describe(layer: nn.Module, name: str) -> str:
    return f"{name or '<model>'} ({type(layer).__name__})"


def _refuse(model: nn.Module, why: str) -> MissingInputs:
    return MissingInputs(f"plan: cannot infer the example inputs of a {type(model).__name__}: {why}; {HOW_TO_PASS}", why)


def example_inputs_for_module(model: nn.Module, argument: Optional[str] = None) -> Tuple[tuple, Dict[str, torch.Tensor]]:
    """(args, kwargs) for one forward of a plain module: one tensor shaped for the first layer
    its one required argument reaches. Raises MissingInputs naming the argument(s) otherwise.
    With `argument` (a Hugging Face model's main input, which its forward leaves optional) that
    argument is the one inferred, passed by keyword."""
    if argument is not None:
        return _inferred(model, _parameter(model, argument), by_keyword=True)
    required, var_positional = required_parameters(model)
    if not required:
        if var_positional:
            raise _refuse(model, "its forward takes *args, whose tensors autoshard cannot infer")
        return (), {}
    names = ", ".join(repr(p.name) for p in required)
    if len(required) > 1:
        raise _refuse(model, f"its forward requires {len(required)} arguments ({names}); autoshard infers one "
                             "input tensor only")
    return _inferred(model, required[0])


def _parameter(model: nn.Module, argument: str) -> inspect.Parameter:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if argument not in parameters:
        raise _refuse(model, f"its forward takes no argument {argument!r}")
    return parameters[argument]


def _inferred(model: nn.Module, parameter: inspect.Parameter,
              by_keyword: bool = False) -> Tuple[tuple, Dict[str, torch.Tensor]]:
    """One tensor for `parameter`, shaped for the first layer it reaches."""
    names = repr(parameter.name)
    layers = [(name, module) for name, module in model.named_modules() if _recognised(module)]
    if not layers:
        raise _refuse(model, f"its forward requires {names}, and the model has no layer that says the shape of its "
                             "input (Linear, Embedding, Conv1d/2d/3d, LayerNorm, RMSNorm, MultiheadAttention, "
                             "EinsumDense)")
    # Registration order is a guess at call order; the probe says which layer comes first.
    name, layer = layers[0]
    seen = set()
    while True:
        tensor = _tensor_for(layer, model)
        try:
            reached = _probe(model, parameter, tensor, by_keyword)
        except Exception as error:  # noqa: BLE001 - the model's own error, told in the refusal
            raise _refuse(model, f"{names} was inferred as {tuple(tensor.shape)} {str(tensor.dtype)[6:]} from "
                                 f"{_describe(layer, name)}, and the forward failed before reaching a layer "
                                 f"({type(error).__name__}: {error})") from None
        if reached is None:
            raise _refuse(model, f"{names} reaches none of its layers that say the shape of an input")
        if reached.module is layer:
            break
        if id(reached.module) in seen:
            raise _refuse(model, f"the first layer {names} reaches is ambiguous ({_describe(layer, name)} or "
                                 f"{_describe(reached.module, reached.name)})")
        seen.add(id(layer))
        name, layer = reached.name, reached.module
    if not _fits(layer, reached.received):
        # A waveform of one channel given as (batch, samples) that the forward unsqueezes itself.
        single = tensor.squeeze(1) if isinstance(layer, _CONV) and layer.in_channels == 1 else None
        again = None if single is None else _reached_or_none(model, parameter, single, by_keyword)
        if again is None or again.module is not layer or not _fits(layer, again.received):
            raise _refuse(model, f"{names} reaches its first layer, {_describe(layer, name)}, changed (reshaped, "
                                 "sliced or combined), so the layer does not say its shape")
        tensor = single
    return _call(parameter, tensor, by_keyword)


def fits_first_layer(model: nn.Module, argument: str, tensor: torch.Tensor) -> bool:
    """Whether `tensor`, given as `argument`, reaches the first layer it reaches unchanged enough
    for that layer to take it (see _fits); False where the forward fails first or takes no such
    argument."""
    try:
        parameter = _parameter(model, argument)
    except MissingInputs:
        return False
    reached = _reached_or_none(model, parameter, tensor, by_keyword=True)
    return reached is not None and _fits(reached.module, reached.received)


def _reached_or_none(model: nn.Module, parameter: inspect.Parameter, tensor: torch.Tensor,
                     by_keyword: bool) -> Optional[_Reached]:
    """The first layer reached and what it received, or None where the forward fails first."""
    try:
        return _probe(model, parameter, tensor, by_keyword)
    except Exception:  # noqa: BLE001 - a layout that does not run: the caller refuses or tries another
        return None
