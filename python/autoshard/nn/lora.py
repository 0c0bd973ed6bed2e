"""PEFT's LoRA on a Linear, split together with its base layer.

A LoRA layer computes ``base(x) + B(A(dropout(x))) * scaling`` per active adapter. Split as
its base layer is, with one collective for both:

- a column base layer (output features split): B's rows are split like the base's, A is
  held whole and reads the base's input copy. The sum of both paths' input gradients is
  all-reduced once, by that copy; A's weight gradient is partial on each rank (it meets
  only this rank's rows of B) and is summed over the group in backward as a partial
  gradient (the plan lists it, see csrc/plan/constructs/adapters.cpp).
- a row base layer (input features split): A's columns are split like the base's, so A's
  output is a partial sum; B, held whole, is linear, so B applied to it is a partial sum of
  B's output, added to the base's partial sum before the layer's one all-reduce. B's weight
  gradient (its output gradient times the partial A output) is partial, summed likewise.

The module stays PEFT's own (its class gains this forward): merging, unmerging, enabling and
disabling adapters and ``merge_and_unload`` work on the local shards, which line up
(``B @ A`` of the local factors is exactly the local slice of the base weight's update).
"""

import sys
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ..core.distributed import ProcessGroup
from ..core.styles import Style
from .linear import ColumnParallelLinear, RowParallelLinear
from .linear_probe import computes_linear


def _peft_lora_linear() -> Optional[type]:
    """peft's LoRA Linear class, if peft is imported (a LoRA layer implies it; never imports it)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    cls = getattr(layer, "Linear", None)
    return cls if isinstance(cls, type) else None


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is PEFT's LoRA on an nn.Linear computing exactly base(x) + B(A(dropout(x)))
    * scaling per adapter: PEFT's own forward, plain Linear factors without bias, no variant
    (DoRA and the like), no fan_in_fan_out. Anything else is followed op by op, whole."""
    cls = _peft_lora_linear()
    if cls is None or not isinstance(module, cls) or type(module).forward is not cls.forward:
        return False
    base = getattr(module, "base_layer", None)
    if not isinstance(base, nn.Linear) or not computes_linear(type(base)) or getattr(module, "fan_in_fan_out", False):
        return False
    if getattr(module, "lora_variant", None) or len(getattr(module, "lora_embedding_A", ())) \
            or len(getattr(module, "lora_magnitude_vector", ())):
        return False
    keys = list(module.lora_A.keys())
    if not keys or set(keys) != set(module.lora_B.keys()):
        return False
    for key in keys:
        a, b = module.lora_A[key], module.lora_B[key]
        if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
            return False
        if a.in_features != base.in_features or b.out_features != base.out_features or b.in_features != a.out_features:
            return False
        if key not in module.scaling or module.lora_bias.get(key, False):
            return False
    return True


def adapter_factors(module: nn.Module) -> Dict[str, tuple]:
    """Adapter name -> (A's weight, B's weight) of a LoRA layer."""
    return {key: (module.lora_A[key].weight, module.lora_B[key].weight) for key in module.lora_A.keys()}


class ParallelLoraLinear:
    """The forward of a LoRA layer whose base layer and factors are split (see the module's
    docstring); mixed into the PEFT class of the module it is given to by shard_lora."""

    # A trace records its call as one layer, as the capture recorded the LoRA layer.
    autoshard_layer = True
    autoshard_linear_like = True

    # parallelize sets the input copy (column) and the token reduce-scatter (row) of the layer;
    # they are the base layer's, which keeps them if merge_and_unload leaves it alone.
    input_copy = property(lambda self: self.base_layer.input_copy,
                          lambda self, value: setattr(self.base_layer, "input_copy", value))
    output_tokens = property(lambda self: self.base_layer.output_tokens,
                             lambda self, value: setattr(self.base_layer, "output_tokens", value))

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        base = self.base_layer
        if base._world == 1:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        name = type(self).__name__
        # A batch mixing adapters (PEFT's adapter_names): sample i goes through adapter_names[i].
        per_sample = kwargs.pop("adapter_names", None)
        extra = [k for k, v in kwargs.items() if v is not None]
        if args or extra:
            raise TypeError(f"{name}: a LoRA layer split by autoshard takes only its input, got "
                            f"{len(args)} more positional and keyword arguments {extra}")
        if self.disable_adapters and self.merged:
            self.unmerge()
        if self.disable_adapters or (self.merged and per_sample is None):
            adapters = []
        else:
            wanted = self.active_adapters if per_sample is None else dict.fromkeys(per_sample)
            adapters = [key for key in wanted if key in self.lora_A.keys()]
        unsplit = [key for key in adapters if key not in self.autoshard_adapters]
        if unsplit:
            raise ValueError(f"{name}: adapter(s) {unsplit} were added after parallelize and are not split with the "
                             "layer; add every adapter before autoshard.parallelize")
        column = isinstance(base, ColumnParallelLinear)
        if column:
            base._check_input(x, base.in_features, "in_features")
        entered = base.enter(x)
        y = base.local_product(entered) if column else base.partial(entered)
        dtype = y.dtype
        for key in adapters:
            a, b = self.lora_A[key], self.lora_B[key]
            # Every tensor here holds every sample (and, with sequence parallelism, every token).
            rows = None if per_sample is None else [i for i, n in enumerate(per_sample) if n == key]
            x_in = entered if rows is None else entered[rows]
            h = self.lora_dropout[key](self._cast_input_dtype(x_in, a.weight.dtype))
            delta = (b.local_product(a(h)) if column else b(a.partial(h))) * self.scaling[key]
            if rows is None:
                y = y + delta
            else:
                y = y.index_add(0, torch.tensor(rows, device=y.device), delta.to(y.dtype))
        return base.finish(y.to(dtype))


_CLASSES: Dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ParallelLora{cls.__name__}", (ParallelLoraLinear, cls), {"__module__": __name__})
    return _CLASSES[cls]


def shard_lora(module: nn.Module, style: str, group: ProcessGroup, *, units: Optional[int] = None,
               parts: Optional[Sequence[int]] = None, repeat: Optional[int] = None,
               whole_parts: Optional[Sequence[int]] = None, sum_whole_parts: bool = False) -> nn.Module:
    """Splits the LoRA layer `module` in place as its base layer is split in `style` ("column",
    "column_gather" or "row", with the split's units, parts, repeat and whole parts); returns it."""
    if not is_lora_linear(module):
        raise TypeError(f"shard_lora: {type(module).__name__} is not a LoRA layer on an nn.Linear autoshard can split")
    keys = list(module.lora_A.keys())
    style = Style(style)
    if style.is_column:
        split = dict(units=units, parts=parts, repeat=repeat, whole_parts=whole_parts, sum_whole_parts=sum_whole_parts)
        base = ColumnParallelLinear.from_linear(module.base_layer, group, gather_output=style == Style.COLUMN_GATHER, **split)
        factors = {key: ColumnParallelLinear.from_linear(module.lora_B[key], group, **split) for key in keys}
        side = module.lora_B
    elif style == Style.ROW:
        base = RowParallelLinear.from_linear(module.base_layer, group, input_is_parallel=True, units=units, parts=parts)
        factors = {key: RowParallelLinear.from_linear(module.lora_A[key], group, input_is_parallel=True, units=units,
                                                      parts=parts) for key in keys}
        side = module.lora_A
    else:
        raise ValueError(f"shard_lora: style must be 'column', 'column_gather' or 'row', got {style!r}")
    module.base_layer = base
    for key, factor in factors.items():
        side[key] = factor
    module.__class__ = _parallel_class(type(module))
    module.autoshard_adapters = tuple(keys)
    return module
