"""Hooks that record whole modules as single nodes while the recorder runs: norms, attention
(nn.MultiheadAttention and scaled dot-product attention) and the attention weights it returns."""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.multihead_attention import (
    AttentionCalls,
    ParallelMultiheadAttention,
    average_over_heads,
    multihead_attention,
    unsupported,
)
from ..constructs.split_norm import BATCH_NORM, norm_form
from .recorder import Recorder


aten = torch.ops.aten


def norm_calls(root: nn.Module, recorder: "Recorder", record, is_layer) -> list:
    """Hooks on root's RMS norm and LayerNorm modules (norm_form) that are no layer: a call on a tensor a
    Linear-like layer's call gave (OLMo 2's q_norm over q_proj's output) is recorded by `record(name,
    module, x, out)` as one node instead of its ops, so that the planner can split it with the
    layer's features. A norm called on anything else (the residual stream) is left to be
    recorded op by op. A BatchNorm is recorded as one node on whatever it takes (its statistics
    are per channel, which the planner reads from the node alone; its ops, from none of them).
    Returns the hook handles."""
    handles = []
    for name, module in root.named_modules():
        form = None if is_layer(module) else norm_form(module)
        if form is None:
            continue
        calls = []

        def pre(mod, inputs, calls=calls, per_channel=form == BATCH_NORM):
            x = inputs[0] if len(inputs) == 1 else None
            ours = (recorder.layer_depth == 0 and isinstance(x, torch.Tensor)
                    and (x.dim() >= 2 if per_channel else recorder.ids.get(id(x), -1) in recorder.layer_outputs))
            calls.append(x if ours else None)
            if ours:
                recorder.layer_depth += 1

        def post(mod, inputs, output, calls=calls, name=name):
            x = calls.pop() if calls else None
            if x is None:
                return
            recorder.layer_depth -= 1
            if isinstance(output, torch.Tensor):
                record(name, mod, x, output)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def attention_calls(root: nn.Module, recorder: "Recorder", record_layer,
                    record_weights=None) -> contextlib.AbstractContextManager:
    """While active, the calls of root's nn.MultiheadAttention modules compute their attention
    with multihead_attention (the sharded module's own computation), their q/k/v projection
    recorded by `record_layer(module name, module, x, out)` as one layer, their out_proj
    called as the module it is and the weights they return with need_weights recorded by
    `record_weights(module name, weights, returned, average)` as one node (by default as a
    trace sees ReturnedWeights: one layer call). Calls it does not compute are left to torch."""
    record_weights = record_weights or (lambda name, weights, returned, average: recorder.nodes.append(
        ("layer", (), (recorder.tensor_id(returned),))))
    owners = {id(m.in_proj_weight): (name, m) for name, m in root.named_modules()
              if isinstance(m, nn.MultiheadAttention) and not isinstance(m, ParallelMultiheadAttention)
              and m.in_proj_weight is not None}
    if not owners:
        return contextlib.nullcontext()

    def attend(arguments):
        owner = owners.get(id(arguments["in_proj_weight"]))
        if owner is None or recorder.layer_depth != 0 or unsupported(arguments) is not None:
            return None
        name, module = owner

        def project(x):
            recorder.layer_depth += 1
            try:
                out = F.linear(x, arguments["in_proj_weight"], arguments["in_proj_bias"])
            finally:
                recorder.layer_depth -= 1
            record_layer(name, module, x, out)
            return out

        def returned_weights(weights, average):
            recorder.layer_depth += 1
            try:
                returned = average_over_heads(weights, average)
                if returned is weights:
                    returned = weights.view(weights.shape)  # a tensor of its own, the node's output
            finally:
                recorder.layer_depth -= 1
            record_weights(name, weights, returned, average)
            return returned

        return multihead_attention(arguments, project, module.out_proj, returned_weights)

    return AttentionCalls(attend)


def record_attention_weights(recorder: "Recorder", name: str, weights: torch.Tensor, returned: torch.Tensor,
                             average: bool) -> None:
    """The planner's node for the weights an nn.MultiheadAttention named `name` returns (heads
    on axis 1 of `weights`): a trace sees it as the call of ReturnedWeights."""
    recorder.node("attention_weights", name, [recorder.tensor_id(weights)], [recorder.tensor_id(returned)],
                  {"dim": 1, "average": bool(average)}, "call")
