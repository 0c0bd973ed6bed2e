"""The op-by-op trace of a (sharded) module's forward on meta: labels and output shapes, as
the capture records them, for the dry run's check against the plan's prediction."""

import contextlib
from typing import Optional, Sequence

import torch
from torch import nn

from .function_caches import fresh_caches
from .index_lists import ConsecutiveIndexLists
from .layers import is_linear_like, plain_linear_weight
from ..inputs.meta_autocast import meta_autocast
from ..inputs.meta_inputs import replay_inputs
from ..inputs.meta_values import KnownValues
from .module_calls import attention_calls, norm_calls
from .recorder import Recorder


aten = torch.ops.aten


def trace_text(module: nn.Module, args: tuple, kwargs: dict, values: Optional[KnownValues] = None) -> str:
    """The ATen-level graph of one module call, for comparing two variants of a module."""
    recorder = Recorder({})
    args, kwargs = replay_inputs((args, kwargs))
    # Each trace runs every op its call computes, and leaves no cache behind (function_caches).
    with fresh_caches(module), torch.no_grad(), meta_autocast(), values or contextlib.nullcontext(), recorder, \
            ConsecutiveIndexLists(), attention_calls(module, recorder, _as_layer(recorder)):
        module(*args, **kwargs)
    return repr((recorder.tensors, recorder.node_records))


def _as_layer(recorder: Recorder):
    """record_layer for attention_calls in a trace: the projection is one "layer" node."""
    return lambda name, module, x, out: recorder.nodes.append(("layer", (), (recorder.layer_output(out),)))


def trace_shapes(module: nn.Module, args: tuple, kwargs: dict, is_layer, values: Optional[KnownValues] = None,
                 layer_inputs: Sequence[int] = ()):
    """(op label, output shapes) of every node of one call of `module`, recorded as capture()
    records them: the modules for which `is_layer(module)` holds are one node each (labelled
    "layer"); and the error that stopped the call, or None. `values` answers reads of input values;
    `layer_inputs`, the flat positions of the inputs a layer gave in the capture (a norm taking
    one is one node, as capture recorded it)."""
    recorder = Recorder({})
    handles = []
    # Decided before the call: `is_layer` and `is_linear_like` read a module's weight, and a
    # weight computed on access (a weight-normed convolution's parametrization) read during the
    # call would be traced as ops of the model's own, outside its layer.
    layers = {id(sub) for sub in module.modules() if sub is not module and is_layer(sub)}
    linear_like = {id(sub): is_linear_like(sub) for sub in module.modules() if id(sub) in layers}
    for sub in module.modules():
        if id(sub) not in layers:
            continue
        # A layer's weight the model multiplies itself: one node, as the capture records it.
        weight = plain_linear_weight(sub)
        if weight is not None:
            recorder.linear_weights[id(weight)] = None

        def pre(mod, inputs):
            recorder.layer_depth += 1

        def post(mod, inputs, output):
            recorder.layer_depth -= 1
            # As capture records a layer: a call whose first input is a tensor, or an embedding's
            # (a position table called with a shape looks up the positions it makes).
            if (recorder.layer_depth == 0 and isinstance(output, torch.Tensor)
                    and (isinstance(mod, nn.Embedding) or (inputs and isinstance(inputs[0], torch.Tensor)))):
                recorder.nodes.append(("layer", (), (recorder.layer_output(output, linear_like[id(mod)]),)))

        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    handles += norm_calls(module, recorder, lambda name, mod, x, out: recorder.nodes.append(
        ("layer", (), (recorder.tensor_id(out),))), lambda m: m is module or id(m) in layers)
    error = None
    args, kwargs = replay_inputs((args, kwargs))
    leaves = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))[0]
    for position in layer_inputs:
        if position < len(leaves) and isinstance(leaves[position], torch.Tensor):
            recorder.layer_outputs.add(recorder.tensor_id(leaves[position]))
    try:  # each trace runs every op its call computes, and leaves no cache behind (function_caches)
        with fresh_caches(module), torch.no_grad(), meta_autocast(), values or contextlib.nullcontext(), recorder, \
                ConsecutiveIndexLists(), attention_calls(module, recorder, _as_layer(recorder)):
            module(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the caller reports where the trace stopped
        error = e
    finally:
        for h in handles:
            h.remove()
    return [(label, [recorder.shapes[i] for i in outputs]) for label, _, outputs in recorder.nodes], error
