"""Modules that may read the token count of an input that sequence parallelism splits.

Sequence parallelism hands a module the tokens of its inputs split over the ranks where the
module's own column layers gather them again. A module that does that inside its own call
(an attention called as `attn(x, memory)` that norms x and memory itself before its q and kv
layers) and reshapes a layer's output may have read an input's length first (`b, t, _ =
x.shape`, then `.view(b, t, heads, -1)` on the gathered q), which a capture on meta cannot
see: it is not an op. (A decoder layer holding its MLP's Linear layers, which it never
reshapes, keeps its split tokens.) The plan keeps such
inputs whole: each gets a reader the planner cannot follow the tokens through, and the plan is
made again; print(plan) says which module and why.
"""

from typing import Dict, List, Tuple

_MARK = "<tokens read by "
_PLANNER_SAYS = " mixes tokens, or autoshard cannot follow the token axis through it"


def _reshaped_inside(graph, node: int, module: str) -> bool:
    """Whether the output of layer `node` reaches a view or reshape within `module`'s first call
    before another layer: a shape the module's code spells, possibly with a length it read."""
    first, end = graph.module_nodes.get(module, (0, -1))
    nodes = graph.document["nodes"]
    readers: Dict[int, List[int]] = {}
    for index in range(max(first, node + 1), end):
        for tensor in nodes[index]["inputs"]:
            readers.setdefault(tensor, []).append(index)
    stack, seen = list(nodes[node]["outputs"]), set()
    while stack:
        tensor = stack.pop()
        for index in readers.get(tensor, ()):
            if index in seen or index in graph.layers:
                continue
            seen.add(index)
            if nodes[index]["kind"] == "view":
                return True
            stack.extend(nodes[index]["outputs"])
    return False


def split_inputs_gathered_inside(result, graph) -> List[Tuple[str, int]]:
    """(module, tensor) for each tensor a module receives split over the tokens while one of
    its own layers (a direct child) gathers tokens inside its call, not at a module entry, and
    the module reshapes that layer's output (with a length it may have read from the tensor)."""
    layouts = result._prediction.layouts
    gathering: Dict[str, List[str]] = {}
    inputs = {}
    for node, info in graph.layers.items():
        layer = result.layer(info.name)
        parent = info.name.rpartition(".")[0]
        if layer.sequence == "gather" and _reshaped_inside(graph, node, parent):
            gathering.setdefault(parent, []).append(info.name)
            inputs.setdefault(parent, set()).add(graph.nodes[node][1][0])
    found = []
    for entry in graph.document.get("entries", ()):
        module, tensor = entry["module"], entry["tensor"]
        if not module or module not in gathering or tensor in inputs[module]:
            continue
        if layouts.get(tensor, {}).get("sequence"):
            found.append((module, tensor))
    return found


def with_length_reads(document: dict, reads: List[Tuple[str, int]]) -> dict:
    """The planner's graph document with an opaque reader of each (module, tensor) in `reads`."""
    if not reads:
        return document
    tensors = list(document["tensors"])
    nodes = list(document["nodes"])
    for module, tensor in reads:
        tensors.append({"shape": [1]})
        nodes.append({"kind": "opaque", "label": f"{_MARK}{module}>", "inputs": [tensor], "outputs": [len(tensors) - 1]})
    return {**document, "tensors": tensors, "nodes": nodes}


def explain_length_reads(result) -> None:
    """Rewrites the planner's note on a sequence region refused for a length read in words."""
    for layer in result.layers:
        note = layer.sequence_note
        start = note.find(_MARK)
        if start < 0:
            continue
        end = note.find(">", start)
        module = note[start + len(_MARK):end]
        why = (f"module {module!r} receives tokens split over the ranks and gathers them only in its own layers: it may "
               "read their count first (as an attention called as attn(x, memory) does with x.shape), so its inputs "
               "stay whole")
        layer.sequence_note = note[:start] + why + note[end + 1:].replace(_PLANNER_SAYS, "", 1)
