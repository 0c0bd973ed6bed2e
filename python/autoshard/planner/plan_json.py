"""The plan as a JSON document (ShardingPlan.to_json / from_json), versioned.

Version 1 holds, beside the plan's own fields (layers, regions, collectives, ...):
- "version": 1;
- "prediction": what parallelize's dry run compares the sharded model with, op by op (the
  captured graph's nodes and shapes, each module's first call, the layers' nodes, the folded
  blocks, and the planner's layouts and token and head cuts; see Prediction.to_dict), or null;
- "input_values": the example inputs the plan was made with, which the dry run replays:
  {"args": [...], "kwargs": {...}}, each tensor as {"dtype", "shape", "values"} (flat) and any
  other input a JSON number, string, bool or null; null where the inputs hold anything else or
  more than INPUT_ELEMENT_LIMIT elements (the dry run then makes inputs of the recorded shapes).

A document without "version" (written before versions existed) is read as version 1 with a
UserWarning: it carries no prediction, so the dry run checks the forward collectives and the
output shapes but not every op. Any other version is refused, naming it.
"""

import json
import warnings
import copy
from dataclasses import fields, is_dataclass
from typing import Any, Optional

import torch

from . import records
from .layer_plan import LayerPlan, RegionPlan
from .prediction import Prediction
from ..core.sealed import in_document

VERSION = 1
# The example inputs are kept up to this many elements in all (a batch of ids and its mask).
INPUT_ELEMENT_LIMIT = 1 << 16
_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                                                     torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                                     torch.float64)}
_SCALARS = (type(None), bool, int, float, str)
# Containers whose one-line form is longer than this are written one item per line.
_WIDTH = 100


def dumps(plan, input_values: bool = True, prediction: bool = True) -> str:
    """The version-1 document of `plan`; without `input_values`, with "input_values": null, and
    without `prediction`, with "prediction": null (what the ranks compare in parallelize: ranks
    planning on example inputs of the same shapes and other values hold the same plan, and the
    traced prediction numbers its tensors in the order the forward made them, which may differ
    between processes where a model iterates over a set of strings, as Gemma 4 computes its
    rotary tables per layer type)."""
    traced = plan.prediction if prediction else None
    document = {"version": VERSION, **_document_of(plan),
                "prediction": None if traced is None else traced.to_dict(),
                "input_values": encode_inputs(plan.input_values) if input_values else None}
    return _format(document, 0)


def loads(cls, text: str):
    """The ShardingPlan (`cls`) a document written by dumps (or before versions) holds."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"ShardingPlan.from_json: expected a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version is None:
        warnings.warn("ShardingPlan.from_json: the document has no \"version\" (it was written before plan documents "
                      f"were versioned); read as version {VERSION}, without the plan's shape prediction: "
                      "parallelize's dry run checks the forward collectives and output shapes, not every op. "
                      "Make the plan again with autoshard.plan and save its to_json() to keep the check",
                      UserWarning, stacklevel=3)
    elif version != VERSION:
        raise ValueError(f"ShardingPlan.from_json: plan document version {version!r} is not supported; this autoshard "
                         f"reads version {VERSION} (make the plan again with autoshard.plan)")
    documented = {f.name for f in fields(cls) if in_document(f)}
    fields_ = {name: data[name] for name in documented if name in data}
    fields_["layers"] = [LayerPlan(**layer) for layer in data["layers"]]
    fields_["regions"] = {int(k): RegionPlan(**v) for k, v in data["regions"].items()}
    for name, record in records.PLAN_FIELDS.items():
        if name in fields_:
            fields_[name] = [records.from_dict(record, item) for item in fields_[name]]
    if "parameters" in fields_:
        fields_["parameters"] = {k: records.from_dict(records.ParameterRecord, v) for k, v in fields_["parameters"].items()}
    plan = cls(**fields_)
    if data.get("prediction") is not None:
        plan.prediction = Prediction.from_dict(data["prediction"], plan)
    if data.get("input_values") is not None:
        plan.input_values = decode_inputs(data["input_values"])
    plan._seal()
    return plan


def _document_of(value):
    """A plan's part as JSON values, as dataclasses.asdict gives it, without the fields that stay
    out of the document (sealed.NOT_IN_DOCUMENT)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _document_of(getattr(value, f.name)) for f in fields(value) if in_document(f)}
    if isinstance(value, (list, tuple)):
        return [_document_of(item) for item in value]
    if isinstance(value, dict):
        return {key: _document_of(item) for key, item in value.items()}
    return copy.deepcopy(value)


def encode_inputs(values) -> Optional[dict]:
    """(args, kwargs) of example inputs as JSON values, or None where they cannot be (see above)."""
    if values is None:
        return None
    args, kwargs = values
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        return None
    leaves = list(args) + list(kwargs.values())
    if not all(isinstance(v, _SCALARS) or (isinstance(v, torch.Tensor) and _encodable(v)) for v in leaves):
        return None
    if sum(v.numel() for v in leaves if isinstance(v, torch.Tensor)) > INPUT_ELEMENT_LIMIT:
        return None
    encode = lambda v: v if isinstance(v, _SCALARS) else {
        "dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape), "values": v.flatten().tolist()}
    return {"args": [encode(v) for v in args], "kwargs": {k: encode(v) for k, v in kwargs.items()}}


def decode_inputs(data: dict):
    """The (args, kwargs) encode_inputs wrote, tensors on the CPU."""
    decode = lambda v: torch.tensor(v["values"], dtype=_DTYPES[v["dtype"]]).reshape(v["shape"]) \
        if isinstance(v, dict) else v
    return tuple(decode(v) for v in data["args"]), {k: decode(v) for k, v in data["kwargs"].items()}


def _encodable(tensor: torch.Tensor) -> bool:
    return (str(tensor.dtype).replace("torch.", "") in _DTYPES and tensor.device.type == "cpu"
            and type(tensor) is torch.Tensor)


def _format(value: Any, level: int) -> str:
    """JSON text with a container on one line where it fits, else one item per line."""
    text = json.dumps(value)
    if not isinstance(value, (dict, list)) or not value or len(text) + level <= _WIDTH:
        return text
    pad = " " * (level + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(str(k))}: {_format(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(pad + _format(v, level + 1) for v in value) + "\n" + " " * level + "]"
