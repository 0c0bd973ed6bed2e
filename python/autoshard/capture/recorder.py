"""The dispatch mode that turns a meta forward into the planner's graph: every ATen op passes
through it, and it decides where each one goes. Ops outside any layer are recorded
(op_recording.py); inside a layer's call, which the capture records as one node, only what that
node needs is followed (an experts module's use of its weights: expert_calls.py; the indices a
position embedding looks up). It also holds the state all of them share."""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..nn.gathered_parameters import gathering
from ..constructs.layer_info import LayerInfo
from .expert_calls import ExpertCalls
from .op_recording import OpRecording


class Recorder(OpRecording, ExpertCalls, TorchDispatchMode):
    def __init__(self, param_index: Dict[int, int]):
        super().__init__()
        self.param_index = param_index
        self.ids: Dict[int, int] = {}
        self.keep: List[torch.Tensor] = []  # holds every recorded tensor so ids stay unique
        self.tensors: List[Dict[str, Any]] = []  # the graph document's tensor records, by id
        self.node_records: List[Dict[str, Any]] = []  # and its node records
        self.shapes: List[Tuple[int, ...]] = []
        self.nodes: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = []
        self.node_count = 0
        self.layer_depth = 0
        # The model's own grad mode at each op (model_grad_mode.py), where the trace follows it.
        self.grad_mode = None
        # What was recorded, in order: ("tensor", id) and ("node", kind, label, inputs, outputs,
        # fields), so that a call of a block can be recorded again for an identical block.
        self.log: List[tuple] = []
        # Nodes a layer stands for without a traced op of their own (an experts module's inner
        # nodes), and nodes a trace sees as one layer call (its combining node); see Prediction.
        self.inner_nodes = set()
        self.layer_calls = set()
        # Within an experts module's call: (id -> its weights and their views, ops refused).
        self.experts_reads = None
        # Tensors a layer's call gave: an RMS norm called on one is one node (see norm_calls).
        self.layer_outputs = set()
        # Within the call of an embedding whose forward takes no index tensor (a learned position
        # table given the input's shape, making its positions itself): the id of its weight, and
        # the indices it looks up, the input of its node.
        self.lookup_weight: Optional[int] = None
        self.lookup_indices: Optional[torch.Tensor] = None
        # Linear layers by their weight's id, whose weight the model may multiply itself (Mamba's
        # `self.dt_proj.weight @ x`; None in a trace, which records such a product as a "layer"
        # node as it records a layer's call); the capture's layer of each recorded node; and
        # the transposes of such a weight not yet read by anything but that product (see
        # record_weight_product), recorded only once something else reads them.
        self.linear_weights: Dict[int, Optional[LayerInfo]] = {}
        self.layers: Dict[int, LayerInfo] = {}
        self.weight_transposes: Dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if gathering():
            pass  # a parameter gathered whole for a call: the plan traced it whole (nn/gathered_parameters.py)
        elif self.layer_depth == 0:
            self.record(func, args, kwargs, out)
        elif self.lookup_weight is not None and func is torch.ops.aten.embedding.default \
                and id(args[0]) == self.lookup_weight:
            self.lookup_indices = args[1]
        elif self.experts_reads is not None:
            self.follow_expert_weights(func, args, kwargs, out)
        return out
