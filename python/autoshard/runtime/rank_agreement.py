"""The check, made once by parallelize, that every rank is about to shard the same model the
same way.

Ranks that built different models (another config, another dtype) or hold different plans
would pass every local check and then exchange tensors of different sizes at the first
forward, where gloo aborts the process and NCCL hangs. A digest of the model's parameters
and buffers (names, shapes, dtypes) and of the plan is all-gathered instead; only when the
digests differ are the full descriptions gathered, to name the first difference on every rank.

The dry run of a plan (planner/dry_run.py) shards a meta copy for this rank alone, and a plan may compute
other shapes on one rank than on another (at 3 ranks one rank's heads divide otherwise). Its
outcome is therefore exchanged (`on_every_rank`): a refusal on any rank is raised on every rank,
so that all of them plan again alike.
"""

import hashlib
import itertools
import pickle
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..core.comm import all_gather_uneven


def fingerprint(model: nn.Module, plan_json: Optional[str]) -> List[Tuple]:
    items: List[Tuple] = [("model class", type(model).__qualname__)]
    items += [("parameter", name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    items += [("buffer", name, list(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    if plan_json is not None:
        items.append(("plan (sha256 of its JSON)", hashlib.sha256(plan_json.encode()).hexdigest()))
    return items


def _describe(item: Optional[Tuple]) -> str:
    if item is None:
        return "nothing"
    kind, name, *rest = item
    if not rest:
        return f"{kind} {name}"
    return f"{kind} {name!r} with shape {rest[0]} and dtype {rest[1]}"


def first_difference(described: List[List[Tuple]]) -> Optional[str]:
    """Where the first rank that differs from rank 0 differs first, or None when all agree."""
    reference = described[0]
    for rank, items in enumerate(described[1:], start=1):
        if items == reference:
            continue
        for i, (ours, theirs) in enumerate(itertools.zip_longest(items, reference)):
            if ours != theirs:
                return f"rank {rank} has {_describe(ours)} where rank 0 has {_describe(theirs)} (entry {i})"
    return None


def _all_gather_bytes(obj: Any, group: dist.ProcessGroup) -> List[Any]:
    """Every rank's ``obj`` (pickled for transport only), through autoshard's collective op, so
    that CommCounter sees it; on NCCL the bytes travel in a CUDA tensor."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = group.size()
    lengths = all_gather_uneven(torch.tensor([data.numel()], device=device), 0, [1] * size, group).tolist()
    gathered = all_gather_uneven(data, 0, lengths, group).cpu()
    return [pickle.loads(piece.numpy().tobytes()) for piece in gathered.split(lengths)]


def check_ranks_agree(model: nn.Module, plan_json: Optional[str], group: dist.ProcessGroup) -> None:
    """Raises ValueError on every rank of ``group`` if the ranks' models or plans differ."""
    if group.size() == 1:
        return
    items = fingerprint(model, plan_json)
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    if len(set(_all_gather_bytes(digest, group))) == 1:
        return
    described = _all_gather_bytes(items, group)
    difference = first_difference(described) or "their descriptions hash differently"
    raise ValueError(f"parallelize: the ranks did not build the same model and plan: {difference}; every rank "
                     "must build the same model (same config and dtype) and pass the same plan. The model was "
                     "left unchanged")


_T = TypeVar("_T")
_PLAIN = (str, bool, int, float, list, tuple, type(None))


def _transportable(error: BaseException) -> dict:
    """An exception as plain values: its kind, message, and the attributes that say what to hold
    whole (plan_until_it_runs reads them)."""
    return {"value_error": isinstance(error, ValueError), "type": type(error).__name__, "message": str(error),
            "attributes": {k: v for k, v in vars(error).items() if isinstance(v, _PLAIN)}}


def _rebuilt(record: dict, rank: int) -> Exception:
    message = record["message"] if record["value_error"] else f"on rank {rank}: {record['type']}: {record['message']}"
    error = (ValueError if record["value_error"] else RuntimeError)(message)
    for key, value in record["attributes"].items():
        setattr(error, key, value)
    return error


def on_every_rank(run: Callable[[], _T], group: dist.ProcessGroup) -> _T:
    """run() on this rank; then, if it raised on any rank of `group`, the lowest such rank's
    exception on every rank (this rank's own where it is that rank), so that no rank goes on
    while another stops."""
    try:
        result, failure = run(), None
    except Exception as error:  # noqa: BLE001 - every failure is exchanged, then raised
        result, failure = None, error
    if group.size() == 1:
        if failure is not None:
            raise failure
        return result
    outcomes = _all_gather_bytes(None if failure is None else _transportable(failure), group)
    for rank, record in enumerate(outcomes):
        if record is not None:
            if rank == group.rank():
                raise failure
            raise _rebuilt(record, rank)
    return result
