"""The check that every tensor-parallel rank is given the same inputs in one forward.

Tensor parallelism splits the work of one batch over the ranks: each computes its share of
every layer from the same activations, and the collectives put the shares together. A rank
given a batch of its own (a data loader that shards the data over every process, the usual
data-parallel habit) still takes part in the same collectives with tensors of the same
shapes, so nothing fails: the result is a mix of the batches, silently wrong.

Each forward of a parallelized model, every rank reduces its tensor inputs to a small
fingerprint on their device (a hash of the bits of every element, so that any difference,
a reordering included, shows), and the ranks all-gather the fingerprints: one collective of
a few integers. Only when they differ are the inputs' descriptions gathered, to name the
input that differs; every rank sees the same gathered fingerprints, so all of them raise.
It runs at every forward, not only the first steps: an evaluation loop, or a later epoch whose
loader splits the data otherwise, is caught too. It costs a few elementwise ops over the
inputs, one host sync and one small all-gather (benchmarks/bench_input_check.py).

The all-gather goes through torch.distributed itself, not autoshard's ops: it checks the
model's inputs and is no part of its computation, so CommCounter leaves it out and the
plan's count of collectives stays that of the model.
"""

import pickle
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core.stalls import RankStallError, named

# Odd multipliers of a 64-bit mix (splitmix64's), written as signed int64.
_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_K3 = -7723592293110705685  # 0x94D049BB133111EB

# The integer dtype of each element size: the bits of any tensor, viewed as integers.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_ADVICE = ("every tensor-parallel rank must get the same batch. To give ranks batches of their own, shard the "
           "data over a data-parallel dimension instead: build a ('dp', 'tp') DeviceMesh, call "
           "parallelize(model, mesh=mesh) and give each dp rank its own batch (for example "
           "DistributedSampler(dataset, num_replicas=mesh['dp'].size(), rank=mesh.get_local_rank('dp'))), "
           "the ranks of one tp group the same one. parallelize(..., check_inputs=False) turns this check off")


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ (x >> 31)) * _K2
    return x ^ (x >> 29)


# The module's one cache, shared by every model's checks (and warmed by the memory prediction,
# planner/memory_activations.py): (length, device) -> (a pseudo-random int64 per position, an odd
# weight per position), made once for the lengths a training run sees, so that hashing costs a
# few elementwise ops.
_positions: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_CACHED_LENGTH = 1 << 20


def _position_weights(n: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    found = _positions.get((n, device))
    if found is None:
        position = torch.arange(1, n + 1, device=device, dtype=torch.int64)
        found = (_mix(_mix(position * _K3)), position * 2 + 1)
        if n <= _CACHED_LENGTH:
            if len(_positions) >= 16:
                _positions.clear()
            _positions[(n, device)] = found
    return found


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Every element's bits as an int64, flattened."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    flat = x.reshape(-1)
    if flat.dtype == torch.bool or flat.dtype.is_floating_point:
        flat = flat.view(_BITS[flat.element_size()])
    return flat.to(torch.int64)


def _value_hash(values: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of 1-d int64 `values` and of each one's position."""
    salt, odd = _position_weights(values.numel(), values.device)
    return torch.stack([_mix(values * _K1 + salt).sum(), (values * odd).sum()])


def _layout_hash(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
    """The inputs' names, shapes and dtypes, as an int64 the same in every process."""
    text = repr([(n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)])
    return zlib.crc32(text.encode())


def fingerprint(names: Sequence[str], tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[number of inputs, layout hash, value hash, value hash], int64 on `device`: the inputs'
    bits hashed back to back, on the device of the first."""
    head = torch.tensor([len(tensors), _layout_hash(names, tensors)], dtype=torch.int64)
    if not tensors:
        return torch.cat([head, torch.zeros(2, dtype=torch.int64)]).to(device)
    home = tensors[0].device
    values = torch.cat([_bits(t).to(home) for t in tensors]) if len(tensors) > 1 else _bits(tensors[0])
    return torch.cat([head.to(device), _value_hash(values).to(device)])


def _wire_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where the fingerprints travel: the inputs' device when the group's backend serves it."""
    backend = str(dist.get_backend(group))  # a lookup in torch's registry of groups
    if device.type == "cuda" and "nccl" in backend:
        return device
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `tensor` (1-d, of one length on every rank): one row per rank."""
    out = torch.empty(group.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, tensor, group=group)
    return out.view(group.size(), tensor.numel())


def _gather_objects(obj, group: dist.ProcessGroup, device: torch.device) -> list:
    """Every rank's picklable `obj` (only on the way to an error)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    lengths = _gather(torch.tensor([data.numel()], device=device), group).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    rows = _gather(padded, group).cpu()
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def _describe(names: Sequence[str], tensors: Sequence[torch.Tensor], values: bool = True) -> List[Tuple]:
    return [(n, list(t.shape), str(t.dtype), tuple(_value_hash(_bits(t)).tolist()) if values else None)
            for n, t in zip(names, tensors)]


def _first_difference(described: List[List[Tuple]], ranks: List[int]) -> str:
    reference = {name: rest for name, *rest in described[0]}
    for r, items in enumerate(described[1:], start=1):
        mine = {name: rest for name, *rest in items}
        for name in list(reference) + [n for n in mine if n not in reference]:
            ours, theirs = mine.get(name), reference.get(name)
            if ours == theirs:
                continue
            where = f"rank {ranks[0]} and rank {ranks[r]}"
            if ours is None or theirs is None:
                holder = ranks[0] if ours is None else ranks[r]
                return f"input {name!r} is given on rank {holder} only (of {where})"
            if ours[:2] != theirs[:2]:
                return (f"input {name!r} has shape {ours[0]} and dtype {ours[1]} on rank {ranks[r]}, shape "
                        f"{theirs[0]} and dtype {theirs[1]} on rank {ranks[0]}")
            return f"input {name!r} (shape {ours[0]}) holds different values on {where}"
    return "their inputs hash differently"


def check_same_inputs(names: Sequence[str], tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                      forward: Optional[int] = None, values: bool = True) -> None:
    """Raises ValueError on every rank of `group` if the ranks' tensor inputs differ. A
    collective: every rank of `group` calls it, in the same forward.

    The inputs' names, shapes and dtypes are always compared (and `forward`, the model's count
    of forwards, when given): ranks whose shapes differ would otherwise meet in the model's
    first collective with tensors of different sizes, where gloo aborts the process and NCCL
    hangs. `values` (parallelize's check_inputs) also compares the inputs' values."""
    device = tensors[0].device if tensors else torch.device("cpu")
    wire = _wire_device(group, device)
    if values:
        mine = fingerprint(names, tensors, wire)
    else:  # names, shapes and dtypes alone: no pass over the inputs' values
        mine = torch.tensor([len(tensors), _layout_hash(names, tensors)], dtype=torch.int64, device=wire)
    mine = torch.cat([torch.tensor([-1 if forward is None else forward], dtype=torch.int64, device=wire), mine])
    with named("the input check's all-gather", group, forward):
        everyone = _gather(mine, group)
    if bool((everyone == everyone[0]).all()):
        return
    ranks = dist.get_process_group_ranks(group)
    counts = everyone[:, 0].tolist()
    if len(set(counts)) > 1:
        where = ", ".join(f"rank {r} at forward {c}" for r, c in zip(ranks, counts))
        raise RankStallError(f"autoshard: the tensor-parallel ranks {ranks} are out of step ({where}): a rank "
                             "skipped a forward of the parallelized model (an exception caught and the step "
                             "skipped on one rank?) or ran one more; every rank must run every forward")
    with named("the input check's all-gather of input descriptions", group, forward):
        described = _gather_objects(_describe(names, tensors, values), group, wire)
    difference = _first_difference(described, ranks)
    advice = _ADVICE if values else _ADVICE.replace(
        "parallelize(..., check_inputs=False) turns this check off",
        "shapes are compared even with check_inputs=False, since ranks with different shapes would abort or hang "
        "in the model's first collective")
    raise ValueError(f"autoshard: the tensor-parallel ranks {ranks} were given different inputs in one forward of a "
                     f"parallelized model ({difference}): {advice}")
