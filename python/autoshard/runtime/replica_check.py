"""The periodic check that the parameters tensor parallelism replicates are still equal.

A norm's weight, a row layer's bias and every other parameter the plan keeps whole is held by
every tensor-parallel rank, and every rank steps it alike. A rank that skips ``opt.step()``
(or steps with another learning rate, or loads other weights) leaves its copy behind, and
nothing else notices: the collectives see tensors of the right shapes, and training goes on
with ranks that compute different models.

Every `every` forwards of a parallelized model (and at its first), each rank hashes the bits
of its replicated parameters (two int64 per parameter, as the input check hashes inputs:
any difference shows, however small) and the ranks all-gather them: one collective of a few
integers per parameter. The copies are bitwise equal on healthy ranks (their updates are the
same computation on the same values, or the result of one all-reduce), so equality is exact.
A difference raises on every rank, naming the first parameter that differs and by how much.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .fully_sharded import local_tensor
from .input_check import _bits, _gather, _value_hash, _wire_device
from ..core.parallel_state import state_of
from ..core.stalls import named

# Forwards between two checks: a copy left behind is found within this many steps, for about
# 1/DEFAULT_EVERY of the check's cost per step (benchmarks/bench_replica_check.py).
DEFAULT_EVERY = 100


def replicated_parameters(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The model's parameters that no sharded layer splits, by name (each tensor once)."""
    state = state_of(model)
    sharded = set(state.shards()) if state is not None else set()
    return [(name, p) for name, p in model.named_parameters() if id(p) not in sharded]


def _hashes(params: List[Tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    if not params:
        return torch.zeros(0, dtype=torch.int64, device=device)
    rows = [_value_hash(_bits(local_tensor(p.detach()))) for _, p in params]
    return torch.cat([r.to(device) for r in rows])


def check_replicas(model: nn.Module, group: dist.ProcessGroup, forward: Optional[int] = None) -> None:
    """Raises RuntimeError on every rank of `group` if a replicated parameter of `model` differs
    across its ranks. A collective: every rank of `group` calls it."""
    params = replicated_parameters(model)
    home = params[0][1].device if params else torch.device("cpu")
    wire = _wire_device(group, home)
    with torch.no_grad():
        mine = _hashes(params, wire)
    with named("the replica fingerprint's all-gather", group, forward):
        everyone = _gather(torch.cat([torch.tensor([len(params)], dtype=torch.int64, device=wire), mine]), group)
    if bool((everyone == everyone[0]).all()):
        return
    ranks = dist.get_process_group_ranks(group)
    step = f" at forward {forward}" if forward is not None else ""
    if len(set(everyone[:, 0].tolist())) > 1:
        raise RuntimeError(f"autoshard: the tensor-parallel ranks {ranks} hold different numbers of replicated "
                           f"parameters{step} ({everyone[:, 0].tolist()}): they built different models")
    differs = (everyone[:, 1:] != everyone[0, 1:]).any(dim=0).view(-1, 2).any(dim=1)
    index = int(differs.nonzero()[0])
    name, p = params[index]
    with named("the replica fingerprint's gather of the differing parameter", group, forward):
        values = local_tensor(p.detach()).to(wire).reshape(-1)
        copies = _gather(values, group).to(torch.float64)
    gap = (copies - copies[0]).abs().max(dim=1).values
    worst = int(gap.argmax())
    raise RuntimeError(
        f"autoshard: the replicated parameter {name!r} differs across the tensor-parallel ranks {ranks}{step} "
        f"(largest difference {float(gap[worst]):.3g}, between rank {ranks[0]} and rank {ranks[worst]}; "
        f"{int(differs.sum())} replicated parameter(s) differ). Every rank must run the same optimizer step on "
        "the same gradients: a rank that skipped opt.step() or zero_grad(), stepped with other settings, or "
        "loaded other weights has left its copy behind. parallelize(..., check_replicas_every=0) turns this "
        "check off")
