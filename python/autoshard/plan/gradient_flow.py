"""Which recorded tensors a backward pass reaches, and the backward collectives that never run
for lack of one.

The planner counts a backward collective for each tensor a column layer copies or gathers, and
for each tensor sequence parallelism cuts on entering a module, unless it is a model input.
Autograd runs none of them for a tensor that needs no gradient. A tensor needs one when two
things hold. It must require one: a parameter that requires one, or a tensor that requires
one, reaches it (not so the features a model is fed through a norm without weights, nor the
output of a frozen embedding); integer and bool tensors never do. And it must reach a model
output, where the backward pass starts: a layer whose output the model computes and drops (a
pooler under a language-model head, a projection for a branch that the inputs leave out) is
never reached by the backward pass, so the copy of its input is never summed. Ops are taken as
differentiable (detach included), so that a tensor is found to need no gradient only where
none can reach it: the counts drop only where nothing runs.
"""

from typing import Dict, List

from ..styles import Style


def needs_gradient(graph) -> List[bool]:
    """Per tensor id of the captured graph: whether a backward pass can reach it."""
    requires = _requires_gradient(graph)
    reaches = reaches_output(graph)
    return [r and o for r, o in zip(requires, reaches)]


# Node kinds (capture.py) whose outputs may share memory with their first input.
_ALIASING = {"view", "permute", "expand", "slice", "split"}


def reaches_output(graph) -> List[bool]:
    """Per tensor id: whether some model output is computed from it (backward starts there).
    Taken without regard to the order of the ops, and with a view and its base reaching alike:
    an in-place op on either changes what the other holds, which the recorded ops do not show."""
    tensors, nodes = graph.document["tensors"], graph.document["nodes"]
    producers: Dict[int, List[dict]] = {}
    aliases: Dict[int, List[int]] = {}
    for node in nodes:
        for out in node["outputs"]:
            producers.setdefault(out, []).append(node)
        if node["kind"] in _ALIASING and node["inputs"]:
            for out in node["outputs"]:
                aliases.setdefault(out, []).append(node["inputs"][0])
                aliases.setdefault(node["inputs"][0], []).append(out)
    reaches = [bool(t.get("output")) for t in tensors]
    pending = [t for t, reached in enumerate(reaches) if reached]
    while pending:
        tensor = pending.pop()
        found = aliases.get(tensor, []) + [i for node in producers.get(tensor, ()) for i in node["inputs"]]
        for other in found:
            if not reaches[other]:
                reaches[other] = True
                pending.append(other)
    return reaches


def _requires_gradient(graph) -> List[bool]:
    """Per tensor id: whether a trainable parameter, or a tensor that requires a gradient, reaches it."""
    tensors = graph.document["tensors"]
    trainable = [p.requires_grad for _, p in graph.shadow.named_parameters(remove_duplicate=True)]
    needs = [("param" in t and trainable[t["param"]]) for t in tensors]
    modules = dict(graph.shadow.named_modules())
    # A layer's output needs a gradient when any parameter of its module requires one (a LoRA
    # layer's factors beside a frozen base weight), not only its weight and bias.
    layer_trainable = {node: any(p.requires_grad for p in modules[info.name].parameters()) if info.name in modules
                       else True for node, info in graph.layers.items()}
    for index, node in enumerate(graph.document["nodes"]):
        reached = any(needs[i] for i in node["inputs"]) or layer_trainable.get(index, False)
        for out in node["outputs"]:
            needs[out] = needs[out] or (reached and graph.floating[out])
    return needs


def _numel(shape) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def drop_gradient_free_collectives(comm: List[Dict[str, object]], data: dict, graph, element_size: int) -> None:
    """Takes out of `comm` (the plan's collectives) the backward collectives of tensors that
    need no gradient: a column layer's copy (all-reduce) or gather (reduce-scatter) of its
    input, a sequence entry's cut (all-gather) and gather (reduce-scatter), an embedding's
    output cut to the ranks' heads (all-gather); and the all-reduce of a partial-gradient
    bucket whose parameters are all frozen."""
    requires = _requires_gradient(graph)
    reaches = reaches_output(graph)
    needs = [r and o for r, o in zip(requires, reaches)]
    nodes = graph.document["nodes"]
    produced = {t for node in nodes for t in node["outputs"]}
    shapes = [t["shape"] for t in graph.document["tensors"]]
    dropped: List[tuple] = []  # (kind, tensor)
    # One copy (or gather) per input tensor, shared by the column layers that read it: its
    # backward runs when the input requires a gradient and the output of one of those layers
    # reaches a model output (the input itself may reach one by another way, a residual).
    copies: Dict[int, dict] = {}  # input tensor -> its first column layer's record
    read_on: Dict[int, bool] = {}  # input tensor -> whether backward reaches one of its layers
    for record in data["layers"]:
        if not Style(record["style"]).is_column or record["sequence"] == "gathered":
            continue
        tensor = nodes[record["node"]]["inputs"][0]
        copies.setdefault(tensor, record)
        read_on[tensor] = read_on.get(tensor, False) or any(reaches[out] for out in nodes[record["node"]]["outputs"])
    for tensor, record in copies.items():
        if requires[tensor] and read_on[tensor]:
            continue
        if record["sequence"] == "gather":
            dropped.append(("reduce_scatter", tensor))
        elif tensor in produced:
            dropped.append(("all_reduce", tensor))
    dropped += [("all_gather", e["tensor"]) for e in data["sequence_entries"] if not needs[e["tensor"]]]
    dropped += [("reduce_scatter", e["tensor"]) for e in data["sequence_gathers"] if not needs[e["tensor"]]]
    dropped += [("all_gather", e["tensor"]) for e in data.get("head_outputs", []) if not needs[e["tensor"]]]
    elements = [(kind, _numel(shapes[tensor])) for kind, tensor in dropped]
    # A partial-gradient bucket of frozen parameters only: nothing to sum (see partial_gradients).
    trainable = [p.requires_grad for _, p in graph.shadow.named_parameters(remove_duplicate=True)]
    elements += [("all_reduce", bucket["elements"]) for bucket in data["partial_gradients"]
                 if not any(trainable[i] for i in bucket["params"])]
    for kind, count in elements:
        for c in comm:
            if c["phase"] == "backward" and c["kind"] == kind and c["count"] > 0:
                c["count"] -= 1
                c["bytes"] -= count * element_size
                break
    comm[:] = [c for c in comm if c["count"] > 0]
