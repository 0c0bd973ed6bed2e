"""The records a capture writes, and the graph document the planner reads from them. Every
other part of the recorder (the ATen ops followed, an experts module's call, a block folded from
an earlier one) builds the graph through these few primitives, so that a tensor gets one id
however it is reached, every node lands in the replayable log, and the document stays the one
format csrc/plan/graph.h parses."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


class GraphRecords:
    """Tensor ids, tensor and node records, and the document made of them. The state they read
    and write is set up by Recorder.__init__ (recorder.py)."""

    def layer_output(self, t: torch.Tensor, linear: bool = True) -> int:
        """t's id, remembered as a Linear-like layer's output where `linear` (not an embedding's)."""
        index = self.tensor_id(t)
        if linear:
            self.layer_outputs.add(index)
        return index

    def layer_node(self, info, x: torch.Tensor, out: torch.Tensor, linear: bool = True, **fields) -> None:
        """A layer's call reading `x` and giving `out`, as one node of its construct's kind."""
        node = self.node(info.construct.planner_kind, info.name or "<model>", [self.tensor_id(x)],
                         [self.layer_output(out, linear)], {**info.planner_fields(x, out), **fields})
        self.layers[node] = info.record_call(x, out)

    def tensor_id(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self.ids and key in self.weight_transposes:
            func, weight, label, _ = self.weight_transposes.pop(key)
            self.node("permute", label, [self.tensor_id(weight)], [self.tensor_id(t)], {"permutation": [1, 0]})
        if key not in self.ids:
            self.ids[key] = self.declare(t.shape)
            self.keep[-1] = t
            if key in self.param_index:
                self.tensors[-1]["param"] = self.param_index[key]
        return self.ids[key]

    def declare(self, shape) -> int:
        """A new tensor id of the given shape (a tensor of a block that is not run)."""
        index = len(self.keep)
        self.keep.append(None)
        self.shapes.append(tuple(int(s) for s in shape))
        self.tensors.append({"shape": list(self.shapes[-1])})
        self.log.append(("tensor", index))
        return index

    def fresh(self, like: torch.Tensor) -> int:
        stand_in = torch.empty(like.shape, device="meta")
        return self.tensor_id(stand_in)

    def node(self, kind: str, label: str, inputs: Sequence[int], outputs: Sequence[int],
             fields: Optional[Dict[str, Any]] = None, traced: str = "") -> int:
        """traced: "" for an op a trace sees, "inner" for a node inside a layer, "call" for the
        node a trace sees as the layer's call."""
        fields = dict(fields or {})
        if self.grad_mode is not None and not self.grad_mode.enabled:
            fields["no_grad"] = True
        self.node_records.append({"kind": kind, "label": label, "inputs": list(inputs), "outputs": list(outputs),
                                  **fields})
        self.nodes.append((label, tuple(inputs), tuple(outputs)))
        self.log.append(("node", kind, label, tuple(inputs), tuple(outputs), fields, traced))
        if traced == "inner":
            self.inner_nodes.add(self.node_count)
        elif traced == "call":
            self.layer_calls.add(self.node_count)
        self.node_count += 1
        return self.node_count - 1

    def document(self, outputs: Sequence[int] = ()) -> Dict[str, Any]:
        """The planner's graph document, version 1 (csrc/plan/graph.h)."""
        tensors = [dict(t) for t in self.tensors]
        for t in outputs:
            tensors[t]["output"] = True
        return {"version": 1, "tensors": tensors, "nodes": _mark_partitions(self.node_records, tensors)}


def _mark_partitions(nodes: List[Dict[str, Any]], tensors: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The nodes, with each group of slices of one tensor along one axis that cover the axis in
    order without overlap (q, k and v sliced from a fused projection) given its "partition"
    (the slices' sizes by position) and each slice its "part": the planner takes them for a
    split."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for index, node in enumerate(nodes):
        if node["kind"] == "slice" and not node["drop_dim"] and node["stop"] > node["start"]:
            groups.setdefault((node["inputs"][0], node["dim"]), []).append(index)
    marked = list(nodes)
    for (tensor, dim), members in groups.items():
        ranges = sorted({(nodes[i]["start"], nodes[i]["stop"]) for i in members})
        length = tensors[tensor]["shape"][dim]
        covers = len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == length and all(
            a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if not covers:
            continue
        sizes = [stop - start for start, stop in ranges]
        for i in members:
            part = ranges.index((nodes[i]["start"], nodes[i]["stop"]))
            marked[i] = {**nodes[i], "partition": sizes, "part": part}
    return marked
