"""The reason codes of parameters no layer of the plan holds, where the module holding them
says more than "not a layer": a convolution no construct recognises ("convolution"), and a
Linear the model never calls, its weight applied by the forward itself in a product the capture
does not take for the layer's call (`F.linear(x, self.qkv.weight, torch.cat((q_bias, k_bias,
v_bias)))`: "functional_layer"; `self.dt_proj.weight @ x` is such a call: recorder.py), and a
layer the traced forward never calls nor reads ("not_called": a decoder's cross-attention traced
without encoder_hidden_states).
The codes and their words are the planner's (csrc/plan/reasons.cpp); what is recorded here is
which modules they are, read from the model's modules. The notes naming idioms that keep a
planned layer whole (unbind, modulation, a loss of the model's own) are the planner's too
(csrc/plan/idioms.cpp)."""

from typing import Dict

from torch import nn

from ..capture.layers import describe_layer

CONVOLUTION = "convolution"
FUNCTIONAL_LAYER = "functional_layer"
NOT_CALLED = "not_called"


def whole_reasons(parameters: Dict[str, dict], graph) -> None:
    """Marks in the plan's parameter records (`whole_reason`) those of convolutions no construct
    recognises (autoshard.constructs), and of Linear layers the model never calls: whose weight its
    ops read, or that the traced forward does not reach at all."""
    called = {info.name for info in graph.layers.values()}
    read = {t["param"] for node in graph.document["nodes"] for i in node["inputs"]
            for t in [graph.document["tensors"][i]] if "param" in t}
    index = {name: i for i, name in enumerate(graph.param_names)}
    for name, module in graph.shadow.named_modules():
        reason = None
        if isinstance(module, nn.modules.conv._ConvNd) and describe_layer(name, module, {}) is None:
            reason = CONVOLUTION
        elif name not in called and describe_layer(name, module, {}) is not None:
            weight = getattr(module, "weight", None)
            names = [n for n, p in module.named_parameters(prefix=name) if p is weight]
            if names and index.get(names[0]) in read:
                reason = FUNCTIONAL_LAYER
            elif names:
                reason = NOT_CALLED
        if reason is None:
            continue
        for param, _ in module.named_parameters(prefix=name):
            if param in parameters:
                parameters[param].whole_reason = reason
