"""Checks of a manifest read from disk, made before anything uses it.

A manifest is input like any other: a damaged or crafted one must be refused with the file and
the field named, never turned into an AttributeError deep inside a load, a read outside the
checkpoint directory (file names are plain names of files in it), or a load that fills only
part of a tensor (the pieces of each tensor must cover it exactly once).

The optimizer's hyperparameters and state it holds are checked before a load changes the model or
the optimizer. A manifest's ``lr`` becomes the optimizer's: a negative learning rate or betas
outside [0, 1) would train silently wrong, so they are refused like a damaged file, with the
field named. So are a key the optimizer's groups do not have (it would be copied into them
silently; but for the few that torch's and autoshard's optimizers of one kind do not share), a
value whose type is not the optimizer's own (where the optimizer's own is None, as autoshard's
``master_weights`` by default, only None, a bool or, but for ``master_weights``, a string), and,
for the optimizers whose state is known (AdamW, Adam, SGD), a state key they do not keep, a
``step`` that is not one whole number >= 0 (a stored ``step`` tensor is read and checked before
anything changes too, by load.py).
"""

import math
import os
from typing import Any, Dict, List

import torch

from ..tensor_io import CheckpointCorruptError
from ..tensor_io.json_input import JSONRefusal
from ..tensor_io.safetensors import DTYPE_NAMES

_TOP = {"world_size", "tensors", "files", "aliases", "tp_ranks", "versions", "plan", "optimizer", "extra",
        "metrics", "model_config", "format_version"}
_REQUIRED = {"world_size", "tensors", "files", "format_version"}
_LAYOUTS = ("param", "flat", "whole")


def _expect(condition: bool, field: str, problem: str) -> None:
    if not condition:
        raise JSONRefusal(field, problem)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plain_file_name(name) -> bool:
    """A file name with no directory part, naming a file inside the directory it is joined to."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and (os.altsep is None or os.altsep not in name) and "\0" not in name)


def _dict(value, field: str) -> dict:
    _expect(isinstance(value, dict), field, f"must be a JSON object, got {type(value).__name__}")
    return value


def _list(value, field: str) -> list:
    _expect(isinstance(value, list), field, f"must be a JSON list, got {type(value).__name__}")
    return value


def _keys(value: dict, field: str, required: set, allowed: set) -> None:
    missing = sorted(required - set(value))
    unknown = sorted(set(value) - allowed)
    _expect(not missing, field, f"lacks {missing}")
    _expect(not unknown, field, f"has unknown fields {unknown}")


def _check_runs(runs, shape: List[int], field: str) -> None:
    _list(runs, field)
    _expect(len(runs) == len(shape), field, f"has runs for {len(runs)} dims, the tensor has {len(shape)}")
    for dim, (dim_runs, size) in enumerate(zip(runs, shape)):
        where = f"{field}[{dim}]"
        _list(dim_runs, where)
        ordered = []
        for run in dim_runs:
            _expect(isinstance(run, list) and len(run) == 2 and all(_is_int(x) for x in run), where,
                    f"must hold [start, length] pairs of ints, got {run!r}")
            start, length = run
            _expect(start >= 0 and length >= 0 and start + length <= size, where,
                    f"run {run} lies outside [0, {size})")
            if length:
                ordered.append((start, length))
        ordered.sort()
        for (start, length), (following, _) in zip(ordered, ordered[1:]):
            _expect(start + length <= following, where, f"runs overlap: {dim_runs}")


def _check_tensors(tensors, files: dict) -> None:
    for name, record in _dict(tensors, "tensors").items():
        field = f"tensors[{name!r}]"
        _keys(_dict(record, field), field, {"shape", "dtype", "pieces"}, {"shape", "dtype", "pieces"})
        shape = _list(record["shape"], field + ".shape")
        _expect(all(_is_int(n) and n >= 0 for n in shape), field + ".shape",
                f"must be a list of ints >= 0, got {shape!r}")
        dtype = getattr(torch, record["dtype"], None) if isinstance(record["dtype"], str) else None
        _expect(isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES, field + ".dtype",
                f"is not a dtype a checkpoint holds: {record['dtype']!r}")
        for i, piece in enumerate(_list(record["pieces"], field + ".pieces")):
            where = f"{field}.pieces[{i}]"
            _keys(_dict(piece, where), where, {"file", "runs"}, {"file", "runs"})
            _expect(plain_file_name(piece["file"]), where + ".file",
                    f"must be the plain name of a file in the checkpoint directory, got {piece['file']!r}")
            _expect(piece["file"] in files, where + ".file", f"names {piece['file']!r}, which 'files' does not list")
            _check_runs(piece["runs"], shape, where + ".runs")


def _check_optimizer(optimizer, tensors: dict) -> None:
    if optimizer is None:
        return
    _keys(_dict(optimizer, "optimizer"), "optimizer", {"type", "param_groups", "state"},
          {"type", "param_groups", "state"})
    _expect(isinstance(optimizer["type"], str), "optimizer.type", "must be a string")
    for g, group in enumerate(_list(optimizer["param_groups"], "optimizer.param_groups")):
        field = f"optimizer.param_groups[{g}]"
        _dict(group, field)
        params = _list(group.get("params"), field + ".params")
        _expect(all(isinstance(p, str) for p in params), field + ".params", "must be a list of parameter names")
    for name, entries in _dict(optimizer["state"], "optimizer.state").items():
        for key, entry in _dict(entries, f"optimizer.state[{name!r}]").items():
            field = f"optimizer.state[{name!r}][{key!r}]"
            _dict(entry, field)
            if "value" in entry:
                _keys(entry, field, {"value"}, {"value"})
                continue
            _keys(entry, field, {"tensor", "layout"}, {"tensor", "layout"})
            _expect(entry["tensor"] in tensors, field + ".tensor", f"names {entry['tensor']!r}, which 'tensors' lacks")
            _expect(entry["layout"] in _LAYOUTS, field + ".layout", f"must be one of {_LAYOUTS}, got {entry['layout']!r}")


def _check_structure(data: Any) -> None:
    _dict(data, "the manifest")
    _keys(data, "the manifest", _REQUIRED, _TOP)
    _expect(_is_int(data["world_size"]) and data["world_size"] >= 1, "world_size",
            f"must be an int >= 1, got {data['world_size']!r}")
    files = _dict(data["files"], "files")
    for name, entry in files.items():
        field = f"files[{name!r}]"
        _expect(plain_file_name(name), field, "must be the plain name of a file in the checkpoint directory")
        _keys(_dict(entry, field), field, {"size", "block_crc32"}, {"size", "block_crc32"})
        _expect(_is_int(entry["size"]) and entry["size"] >= 0, field + ".size", f"must be an int >= 0, got {entry['size']!r}")
        crcs = _list(entry["block_crc32"], field + ".block_crc32")
        _expect(all(_is_int(c) and 0 <= c < 2**32 for c in crcs), field + ".block_crc32", "must be a list of crc32 values")
    _check_tensors(data["tensors"], files)
    tensors = data["tensors"]
    for alias, stored in _dict(data.get("aliases", {}), "aliases").items():
        _expect(isinstance(stored, str) and stored in tensors, f"aliases[{alias!r}]",
                f"names {stored!r}, which 'tensors' lacks")
    tp_ranks = data.get("tp_ranks")
    _expect(tp_ranks is None or (isinstance(tp_ranks, list) and all(_is_int(r) and r >= 0 for r in tp_ranks)),
            "tp_ranks", f"must be a list of ranks or null, got {tp_ranks!r}")
    _dict(data.get("versions", {}), "versions")
    for key in ("plan", "model_config"):
        _expect(data.get(key) is None or isinstance(data[key], str), key, "must be a string or null")
    metrics = data.get("metrics")
    # NaN and infinite metrics are allowed: a diverged run's loss is still worth recording.
    _expect(metrics is None or (isinstance(metrics, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                   for v in metrics.values())),
            "metrics", f"must be an object of name -> number or null, got {metrics!r}")
    _check_optimizer(data.get("optimizer"), tensors)


def check_manifest_data(data: Any, manifest_path: str, function: str) -> None:
    """Refuses a parsed manifest.json whose structure is not what a save writes."""
    try:
        _check_structure(data)
    except JSONRefusal as refusal:
        raise CheckpointCorruptError(f"{function}: {manifest_path!r}: {refusal.field} {refusal.problem}") from None


# The most corner terms (see _corners) a manifest's coverage check may add up: a saved piece has a
# few runs per dim, so a real checkpoint stays far below; a crafted one is refused past it.
_MAX_CORNER_TERMS = 1 << 22


def _edges(dim_runs) -> List[tuple]:
    """The runs of one dim as +1 at each start and -1 at each end (adjacent runs cancel)."""
    edges: Dict[int, int] = {}
    for start, length in dim_runs:
        if length:
            edges[start] = edges.get(start, 0) + 1
            edges[start + length] = edges.get(start + length, 0) - 1
    return sorted((x, w) for x, w in edges.items() if w)


def _corners(runs, budget: List[int]):
    """The signed corners of a piece (a product of runs per dim): its indicator function is the
    sum, over these corners c with weight w, of w on the orthant {x >= c}. Two sets of pieces
    hold the same elements equally often exactly when their summed corners are equal."""
    per_dim = [_edges(dim_runs) for dim_runs in runs]
    corners = [((), 1)]
    for edges in per_dim:
        budget[0] -= len(corners) * len(edges)
        if budget[0] < 0:
            return None
        corners = [(c + (x,), w * v) for c, w in corners for x, v in edges]
    return corners


def _holds(runs, point) -> bool:
    return all(any(start <= x < start + length for start, length in dim_runs) for dim_runs, x in zip(runs, point))


def check_coverage(tensors: Dict[str, Any], manifest_path: str, function: str) -> None:
    """Each tensor's pieces are pairwise disjoint and together hold every element once.

    The pieces' summed signed corners must equal those of the whole tensor (which holds exactly
    when every element is in exactly one piece); that costs a few dict updates per piece, so a
    manifest of many pieces is checked in linear time. When they differ, the smallest corner
    where they do is an element held by no piece or by several, which the error names."""
    budget = [_MAX_CORNER_TERMS]
    for name, record in tensors.items():
        runs = [piece.runs for piece in record.pieces]
        volumes = [math.prod(sum(n for _, n in dim) for dim in r) for r in runs]
        covered, total = sum(volumes), math.prod(record.shape)
        if covered != total:
            raise CheckpointCorruptError(f"{function}: {manifest_path!r}: the pieces of {name!r} cover {covered} "
                                         f"of its {total} elements")
        sums: Dict[tuple, int] = {}
        whole = [[[0, n]] for n in record.shape]
        for i, piece_runs in [(-1, whole)] + list(enumerate(runs)):
            if not (volumes[i] if i >= 0 else total):
                continue
            corners = _corners(piece_runs, budget)
            if corners is None:
                raise CheckpointCorruptError(
                    f"{function}: {manifest_path!r}: tensors[{name!r}].pieces[{max(i, 0)}].runs: the pieces hold more runs "
                    f"than a checkpoint's coverage check accepts ({_MAX_CORNER_TERMS} corners in all)")
            sign = -1 if i < 0 else 1  # the whole tensor's corners are taken away
            for corner, weight in corners:
                sums[corner] = sums.get(corner, 0) + sign * weight
        wrong = [corner for corner, weight in sums.items() if weight]
        if wrong:
            point = min(wrong)
            holders = [i for i, (r, v) in enumerate(zip(runs, volumes)) if v and _holds(r, point)]
            where = (f"pieces {holders[0]} and {holders[1]} (in {record.pieces[holders[0]].file!r} and "
                     f"{record.pieces[holders[1]].file!r}) both hold element {list(point)}" if len(holders) > 1 else
                     f"element {list(point)} is in no piece although their sizes add up to the tensor's")
            raise CheckpointCorruptError(
                f"{function}: {manifest_path!r}: tensors[{name!r}] has pieces that overlap: {where}, "
                "so some elements would never be read")


# The optimizer's hyperparameters and state (see the module's docstring).
_AT_LEAST_ZERO = ("lr", "eps", "weight_decay", "momentum", "dampening")
_BOOL_OR_NONE = ("master_weights", "foreach", "fused", "capturable", "differentiable")
# Hyperparameters that torch's AdamW, Adam and SGD keep and autoshard's do not, or the reverse
# (with a value of the type they take): a checkpoint of one loads into the other (copied into its
# groups, as before, once checked); any other key the optimizer's groups lack is refused.
_ONE_FAMILY = {"master_weights": None, "amsgrad": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": False}
# State keys of the optimizers whose state is known (autoshard's and torch's of these names).
_MASTER = "master"
KNOWN_STATE = {
    "AdamW": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", _MASTER},
    "Adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", _MASTER},
    "SGD": {"momentum_buffer", _MASTER},
}


def step_problem(value):
    """What is wrong with a ``step`` count (None: nothing)."""
    if not _is_number(value) or value < 0 or value != int(value):
        return "must be a whole number >= 0"
    return None


def _problem(key: str, value, current):
    """What is wrong with ``value`` for hyperparameter ``key`` (None: nothing)."""
    if key in _BOOL_OR_NONE and not (value is None or isinstance(value, bool)):
        return "must be null, true or false"
    if current is None and not (value is None or isinstance(value, (bool, str))):
        return "must be null, a bool or a string (the optimizer's own value is None)"
    if isinstance(current, str) and not isinstance(value, str):
        return "must be a string"
    if isinstance(current, bool) and not isinstance(value, bool):
        return "must be a bool"
    if (isinstance(current, (int, float)) and not isinstance(current, bool)) or isinstance(current, torch.Tensor):
        if not _is_number(value):
            return "must be a finite number"
    if isinstance(current, (tuple, list)):
        if not (isinstance(value, list) and len(value) == len(current) and all(_is_number(v) for v in value)):
            return f"must be a list of {len(current)} finite numbers"
    if key in _AT_LEAST_ZERO and not (_is_number(value) and value >= 0):
        return "must be a finite number >= 0"
    if key == "betas" and not (isinstance(value, list) and len(value) == 2
                               and all(_is_number(b) and 0 <= b < 1 for b in value)):
        return "must be two numbers in [0, 1)"
    return None


def check_hyperparameters(saved_groups: List[dict], optimizer: torch.optim.Optimizer, manifest_path: str) -> None:
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for key, value in saved.items():
            if key == "params":
                continue
            if key not in group and key not in _ONE_FAMILY:
                raise CheckpointCorruptError(
                    f"load: {manifest_path!r}: optimizer.param_groups[{g}][{key!r}] is not a hyperparameter of "
                    f"this {type(optimizer).__name__}, whose groups hold {sorted(k for k in group if k != 'params')}")
            problem = _problem(key, value, group[key] if key in group else _ONE_FAMILY[key])
            if problem is not None:
                raise CheckpointCorruptError(f"load: {manifest_path!r}: optimizer.param_groups[{g}][{key!r}] {problem}, "
                                             f"got {value!r}")


def check_state(saved: Dict, optimizer: torch.optim.Optimizer, tensors: Dict, manifest_path: str) -> None:
    """The manifest's optimizer state (``saved["state"]``: name -> key -> entry), for the
    optimizers whose state is known; ``tensors`` are the manifest's tensor records."""
    known = KNOWN_STATE.get(type(optimizer).__name__)
    if known is None or saved.get("type") not in KNOWN_STATE:
        return
    for name, entries in saved["state"].items():
        for key, entry in entries.items():
            field = f"optimizer.state[{name!r}][{key!r}]"

            def refuse(problem: str, field=field):
                return CheckpointCorruptError(f"load: {manifest_path!r}: {field} {problem}")

            if key not in known:
                raise refuse(f"is not state that {type(optimizer).__name__} keeps (it keeps {sorted(known)})")
            if "value" in entry:
                value = entry["value"]
                if key == "step":
                    problem = step_problem(value)
                    if problem is not None:
                        raise refuse(f"{problem}, got {value!r}")
                elif not (key == "momentum_buffer" and value is None):
                    raise refuse(f"must be a tensor, got {value!r}")
                continue
            record = tensors[entry["tensor"]]
            if key == "step" and math.prod(record.shape) != 1:
                raise refuse(f"must be one number, got a tensor of shape {record.shape}")
