"""Ops that index the token axis after a sequence region: the tokens are gathered before them.

A causal LM's head reads the last tokens of the final hidden states (transformers'
``hidden_states[:, slice_indices, :]``, ``logits_to_keep``). Planned with every token kept,
that indexing is recorded as an alias (or a slice covering the whole axis), which the planner
lets a sequence region through. Called with ``logits_to_keep=1`` (as ``generate`` calls it),
the same line picks the last token of this rank's piece instead of the sequence's, and the
column layer's gather meets a piece of the wrong length, or the wrong tokens. An op indexing
the token axis may select other tokens in another call, so it must see every token: the column
layers reading tokens through such ops get them gathered where the module computing them
returns them (a forward hook on its output, e.g. the final norm's), and the ops in between run
on whole tokens. That gather is the one the column layers made, of the same tensor (the ops
keep every token on the planned inputs), so the collectives stay as the planner counted them;
its backward is the same reduce-scatter, summing the column layers' partial input gradients.

Where no module returns that tensor, or something else reads it, there is no such place, and
`plan` makes the plan again without sequence parallelism (exact, and said in the plan).
"""

from typing import Dict, List, Optional

from .capture import CapturedGraph


def _indexes_tokens(node: dict, layout: Optional[dict]) -> bool:
    """Whether `node`, reading a tensor split on its tokens (`layout`), indexes the token axis:
    an alias is what Python indexing that kept everything records (``x[:, 0:, :]``)."""
    if layout is None or not layout.get("sequence"):
        return False
    if node["kind"] == "view" and node["label"].split(".")[:2] == ["aten", "alias"]:
        return True
    return node["kind"] == "slice" and node["dim"] == layout["axis"]


def _innermost_exit(graph: CapturedGraph, tensor: int, before: int):
    """(module, leaf) of the smallest module call returning `tensor` that ends by node `before`."""
    best = None
    for name, leaves in graph.module_exits.items():
        first, end = graph.module_nodes.get(name, (0, -1))
        if end < first or end > before:
            continue
        for leaf, t in leaves:
            if t == tensor and (best is None or end - first < best[2]):
                best = (name, leaf, end - first)
    return None if best is None else best[:2]


def gather_before_token_indexing(data: dict, graph: CapturedGraph) -> Optional[str]:
    """Rewrites the planner's answer `data` in place so that column layers reading tokens
    through ops indexing them take them gathered at a module's output (their role becomes
    "gathered", the gather a "sequence_exits" record, the tensors in between whole). Returns
    None, or why no such place exists (nothing is changed then)."""
    nodes = graph.document["nodes"]
    tensors = graph.document["tensors"]
    layouts = {t["tensor"]: t for t in data["tensors"]}
    producer: Dict[int, int] = {}
    readers: Dict[int, List[int]] = {}
    for n, node in enumerate(nodes):
        for t in node["outputs"]:
            producer[t] = n
        for t in node["inputs"]:
            readers.setdefault(t, []).append(n)
    gathering = {r["node"]: r for r in data["layers"] if r["sequence"] == "gather"}
    # The tensor of the region each indexing chain starts from -> the chains' ops.
    chains: Dict[int, List[int]] = {}
    for n in gathering:
        t, chain = nodes[n]["inputs"][0], []
        while t in producer and _indexes_tokens(nodes[producer[t]], layouts.get(nodes[producer[t]]["inputs"][0])):
            chain.append(producer[t])
            t = nodes[producer[t]]["inputs"][0]
        if chain:
            chains.setdefault(t, []).extend(chain)
    exits, whole, gathered = [], set(), set()
    for source, ops in chains.items():
        where = _innermost_exit(graph, source, min(ops))
        if where is None:
            return (f"{nodes[min(ops)]['label']} indexes the token axis (another call may select other tokens) and no "
                    "module returns the tokens it reads, where they could be gathered first")
        # After the gather the tokens are whole: every reader must be one of these ops or a
        # column layer that would have gathered them.
        held = [source] + [nodes[op]["outputs"][0] for op in ops]
        layers = set()
        for t in held:
            if tensors[t].get("output"):
                return f"tokens that {nodes[min(ops)]['label']} indexes reach a model output"
            for reader in readers.get(t, ()):
                if reader not in ops and reader not in gathering:
                    return (f"{where[0]} returns tokens that {nodes[reader]['label']} reads besides the column layers "
                            f"reading them through {nodes[min(ops)]['label']}, which indexes the token axis")
                if reader in gathering:
                    layers.add(reader)
        whole.update(held[1:])
        gathered |= layers
        exits.append({"tensor": source, "module": where[0], "leaf": where[1], "dim": layouts[source]["axis"],
                      "region": gathering[min(layers)]["sequence_region"]})
    for n in gathered:
        gathering[n]["sequence"] = "gathered"
    data["tensors"] = [t for t in data["tensors"] if t["tensor"] not in whole]
    data["sequence_exits"] = exits
    return None
