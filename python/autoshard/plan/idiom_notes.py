"""What the plan says about parts of a model it keeps whole because of how the model is
written, in words that name the idiom rather than the op the planner stopped at:

- a convolution (a patch stem, a positional or feature convolution): never split;
- a Linear the model never calls, its weight applied by the forward itself
  (`F.linear(x, self.qkv.weight, torch.cat((q_bias, k_bias, v_bias)))`);
- q, k and v taken from a fused projection with `unbind` (`qkv.reshape(...).permute(...).unbind(0)`);
- adaptive-norm modulation: a Linear's output chunked into shift, scale and gate that multiply
  and shift the hidden stream;
- a loss computed by the model's own forward from the head's logits, where loss parallelism
  (Hugging Face's loss functions only) does not apply.
"""

from typing import Dict, List

from torch import nn

from ..styles import Style
from .layers import describe_layer

CONVOLUTION = "convolution"
FUNCTIONAL_LAYER = "functional_layer"

UNBIND = ("a fused q/k/v split with unbind (qkv.reshape(...).permute(...).unbind(0)); split it with chunk, split or "
          "slices to have it split by heads")
MODULATION = ("it is adaptive-norm modulation: its output is chunked into shift, scale and gate pieces that multiply "
              "and shift the whole hidden stream, so every rank needs all of it")
OWN_LOSS = ("the model computes a loss from these logits in its own forward (a cross-entropy over the whole "
            "vocabulary): the head is kept whole and every rank holds the whole logits; loss parallelism, which keeps "
            "them split, applies only to Hugging Face's loss functions, with a plan made without labels")
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy")


def whole_reasons(parameters: Dict[str, dict], graph) -> None:
    """Marks in the plan's parameter records (`whole_reason`) those of convolutions no construct
    recognises (autoshard.constructs), and of Linear layers the model never calls but whose
    weight its ops read."""
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
        if reason is None:
            continue
        for param, _ in module.named_parameters(prefix=name):
            if param in parameters:
                parameters[param].whole_reason = reason


def _readers(graph) -> Dict[int, List[int]]:
    found: Dict[int, List[int]] = {}
    for index, node in enumerate(graph.document["nodes"]):
        for tensor in node["inputs"]:
            found.setdefault(tensor, []).append(index)
    return found


def _reached(graph, readers, start: List[int], through=("view", "permute", "pointwise"), limit: int = 64) -> List[int]:
    """The nodes reading `start`'s tensors, followed through views, permutes and pointwise ops."""
    nodes = graph.document["nodes"]
    found, stack, seen = [], list(start), set()
    while stack and len(found) < limit:
        tensor = stack.pop()
        for index in readers.get(tensor, ()):
            if index in seen:
                continue
            seen.add(index)
            found.append(index)
            if nodes[index]["kind"] in through and index not in graph.layers:
                stack.extend(nodes[index]["outputs"])
    return found


def explain_idioms(result, graph) -> None:
    """Adds to the notes of layers kept whole for an idiom the idiom's name."""
    nodes = graph.document["nodes"]
    readers = _readers(graph)
    for node, info in graph.layers.items():
        layer = result.layer(info.name)
        if layer.style not in (Style.REPLICATE, Style.COLUMN_GATHER) or not nodes[node]["outputs"]:
            continue
        reached = _reached(graph, readers, list(nodes[node]["outputs"]), ("view", "permute", "pointwise", "slice"))
        labels = [nodes[i]["label"] for i in reached]
        why = None
        if any("unbind" in label for label in labels):
            why = UNBIND
        elif any(op in label for label in labels for op in _LOSS_OPS):
            why = OWN_LOSS
        elif layer.style is Style.REPLICATE and _modulates(graph, readers, reached):
            why = MODULATION
        if why and why not in layer.note:
            layer.note = f"{layer.note} ({why})" if layer.note else f"replicated: {why}"


def _modulates(graph, readers, reached: List[int]) -> bool:
    """A split of the layer's output into pieces, two or more of which multiply or add into
    other tensors (shift, scale, gate)."""
    nodes = graph.document["nodes"]
    for index in reached:
        if nodes[index]["kind"] != "split" or len(nodes[index]["outputs"]) < 2:
            continue
        used = 0
        for piece in nodes[index]["outputs"]:
            after = _reached(graph, readers, [piece], through=("view",))
            used += any(nodes[i]["kind"] == "pointwise" and len(nodes[i]["inputs"]) > 1 for i in after)
        if used >= 2:
            return True
    return False
