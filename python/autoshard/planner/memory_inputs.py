"""The inputs of the forward whose memory is predicted: the caller's, or the plan's example
inputs rescaled to a batch and sequence length."""

from typing import Optional

import torch
from torch import nn

from .memory_plan_reads import input_spec, recorded_inputs
from ..inputs.hf_inputs import ordinary_token
from ..inputs.meta_inputs import split_inputs
import inspect
from ..inputs.meta_inputs import input_shapes


def _fill(name: str, token: int):
    return token if name.endswith("input_ids") or name == "labels" else 1 if name.endswith("mask") else 0


def scaled_inputs(plan, model: nn.Module, example_inputs, batch: Optional[int], seq: Optional[int]):
    """(args, kwargs) of real tensors for the forward whose memory is predicted: `example_inputs`
    as given; else the plan's own example inputs, their batch dim (dim 0) made `batch` and the
    token dims of id and mask tensors (integer tensors' dims of the example's sequence length)
    made `seq`. A language model whose inputs hold input_ids and no labels gets labels (the
    ids), so that the loss is part of the step."""
    if example_inputs is not None:
        if batch is not None or seq is not None:
            raise ValueError("ShardingPlan.memory: give example_inputs or batch/seq, not both")
        return split_inputs(example_inputs)
    spec = input_spec(plan)
    recorded = recorded_inputs(plan)
    if spec is None:
        raise ValueError("ShardingPlan.memory: this plan records no example inputs; pass example_inputs")
    token = ordinary_token(model.config) if hasattr(model, "config") else 1
    described = [("", s) for s in spec["args"]] + list(spec["kwargs"].items())
    shapes = [s["shape"] for _, s in described if s is not None]
    if not shapes or not shapes[0]:
        raise ValueError("ShardingPlan.memory: the plan's example inputs have no batch dim; pass example_inputs")
    batch0 = shapes[0][0]
    integer = [s["shape"] for _, s in described if s is not None and not s["dtype"].startswith(("float", "bfloat"))]
    seq0 = next((shape[1] for shape in integer if len(shape) >= 2), None)
    if seq is not None and seq0 is None:
        raise ValueError("ShardingPlan.memory: seq= given, but the model's example inputs hold no token ids")

    def make(s, name=""):
        if s is None:
            return None
        shape = list(s["shape"])
        floating = s["dtype"].startswith(("float", "bfloat"))
        if batch is not None and shape and shape[0] == batch0:
            shape[0] = batch
        if seq is not None and not floating:
            shape = [shape[0]] + [seq if d == seq0 else d for d in shape[1:]]
        return torch.full(shape, _fill(name, token), dtype=getattr(torch, s["dtype"]))

    if recorded is not None and batch is None and seq is None:
        args, kwargs = tuple(recorded[0]), dict(recorded[1])
    else:
        args = tuple(make(s) for s in spec["args"])
        kwargs = {k: make(s, k) for k, s in spec["kwargs"].items()}
    if "input_ids" in kwargs and "labels" not in kwargs and _takes_labels(model):
        kwargs["labels"] = kwargs["input_ids"].clone()
    return args, kwargs


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def describe_inputs(args, kwargs) -> str:
    return input_shapes(args, kwargs)
