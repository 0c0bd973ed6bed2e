"""Process groups: starting torch.distributed from torchrun's environment, and the group
that sharded layers use when they are given none.

A parallelized model keeps its tensor-parallel group (the world, the group given to
``parallelize``, or its mesh's "tp" dimension) on its ``ParallelState``
(``model.autoshard_state.group``), and what is given the model or its parameters uses that
group. ``group=None`` where no model is at hand (a sharded layer built by hand, the
collectives of ``autoshard.comm``, ``vocab_parallel_cross_entropy``) means the group
``set_default_group`` installed, else the world. ``parallelize`` sets nothing process-wide: where
a live parallelized model is tensor-parallel over fewer ranks than the world (a DeviceMesh's
"tp"), ``group=None`` is refused, since the world would span its data-parallel replicas; pass
``group=model.autoshard_state.group``.

Ops receive groups by name (``group.group_name``), which C++ resolves through torch's
process-group registry, the way torch's functional collectives do.
"""

import atexit
import gc
import os
from datetime import timedelta
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .parallel_state import live_states
from .stalls import DEFAULT_TIMEOUT, check_timeout

ProcessGroup = dist.ProcessGroup

# The tensor-parallel group used when a layer or collective is given `group=None` and no model
# is at hand; None here means the world. Only set_default_group changes it.
_default_group: Optional[ProcessGroup] = None


def _env_int(name: str, default: Optional[int]) -> int:
    """The integer in environment variable ``name``; a missing one is an error when
    ``default`` is None."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"init_distributed: environment variable {name} must be set (torchrun sets it)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"init_distributed: environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(backend: Optional[str] = None,
                     timeout: Union[timedelta, float] = DEFAULT_TIMEOUT) -> Tuple[int, int]:
    """Starts torch.distributed from torchrun's environment and returns ``(rank, world_size)``.

    Idempotent: when a default process group exists already, returns its rank and size.
    With CUDA available, uses NCCL for CUDA tensors (gloo for CPU tensors) and makes
    ``LOCAL_RANK``'s GPU the current device; otherwise gloo. Without ``WORLD_SIZE`` in the
    environment (a plain ``python script.py``), starts a one-rank group in this process.
    ``backend`` overrides the choice (any string ``torch.distributed.init_process_group``
    accepts).

    ``timeout`` (a ``datetime.timedelta`` or a number of seconds; default 10 minutes) bounds how
    long a rank waits in a collective for a peer that does not arrive (a rank stuck, or one
    that skipped a collective): the waiting ranks then raise instead of hanging for torch's
    default 30 minutes. Ten minutes is longer than what a healthy rank does while the others
    wait (a first step under torch.compile, rank 0 writing ``save_pretrained`` or evaluating
    alone, loading a checkpoint), so it fails only a job that is stuck; raise it if your
    training loop lets one rank work alone for longer. When a default group exists already,
    its own timeout stays (the value is still checked).
    """
    timeout = check_timeout("init_distributed", timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    standalone = "WORLD_SIZE" not in os.environ
    if standalone:
        rank, world_size = 0, 1
    else:
        rank, world_size = _env_int("RANK", None), _env_int("WORLD_SIZE", None)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if use_cuda and "nccl" in backend:
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(
                f"init_distributed: LOCAL_RANK {local_rank} has no GPU of its own ({count} visible); "
                "start at most one rank per GPU, or pass backend='gloo'"
            )
        torch.cuda.set_device(local_rank)
    if standalone:  # no torchrun: a group of one needs no rendezvous address
        store = dist.HashStore()
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ValueError(f"init_distributed: environment variable {name} must be set (torchrun sets it)")
        store = _restart_store(timeout)
    rendezvous = {"init_method": "env://"} if store is None else {"store": store}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **rendezvous)
    return dist.get_rank(), dist.get_world_size()


def _restart_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun with a rendezvous that shares its agent's TCPStore with the workers (the
    c10d rendezvous, ``--standalone`` included, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
    a store whose keys belong to this attempt only; None elsewhere (``env://`` as usual).

    That store outlives the workers, and torch gives the workers it restarts
    (``--max-restarts``) no prefix of their own, so a restarted group read the keys the dead
    attempt left there: gloo's connect then went to the dead ranks' addresses and failed
    ("Connection refused"). The prefix is ``TORCHELASTIC_RESTART_COUNT``, the same for all
    ranks of one torchrun; agents on several nodes can count restarts differently, so a
    multi-node job that restarts should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun
    (each attempt then gets a fresh store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", None)
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", None), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"autoshard/attempt-{attempt}", shared)


def _require_initialized(function: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{function}: torch.distributed is not initialised; call autoshard.init_distributed() "
            "(under torchrun) or torch.distributed.init_process_group first"
        )


def _narrower_model_groups() -> List[int]:
    """The sizes of the tensor-parallel groups of live parallelized models narrower than the world
    (a ("dp", "tp") mesh's "tp"); models no longer referenced are collected first."""
    world = dist.get_world_size()
    sizes = lambda: sorted({state.group.size() for state in live_states()
                            if state.plan is not None and state.group is not None and state.group.size() != world})
    if sizes():
        gc.collect()  # a model freed but still in a reference cycle is not alive
    return sizes()


def default_group() -> ProcessGroup:
    """The group used for ``group=None`` where no model is at hand: the one set_default_group
    installed, else the world. parallelize sets nothing process-wide; where a live parallelized
    model's tensor-parallel group is narrower than the world (a mesh's "tp"), the world would
    span its data-parallel replicas and compute silently wrong values, so ``group=None`` is
    refused there and the group must be named."""
    _require_initialized("default_group")
    if _default_group is not None:
        return _default_group
    narrower = _narrower_model_groups()
    if narrower:
        raise ValueError(
            f"autoshard: group=None means the world ({dist.get_world_size()} ranks), but a parallelized model here "
            f"is tensor-parallel over {narrower[0]} ranks (a ('dp', 'tp') mesh): over the world the call would mix "
            "its data-parallel replicas. Pass group=model.autoshard_state.group (or the world's group, "
            "torch.distributed.group.WORLD, if that is meant)")
    return dist.distributed_c10d._get_default_group()


def set_default_group(group: Optional[ProcessGroup]) -> None:
    """Makes ``group`` the process-wide tensor-parallel group for ``group=None`` where no model
    is at hand (None: the world again). A parallelized model's own group is
    ``model.autoshard_state.group``, which this does not change."""
    global _default_group
    _default_group = _checked_group(group, "set_default_group")


def resolve(group: Optional[ProcessGroup], function: str = "autoshard") -> ProcessGroup:
    """``group``, or the default group when it is None, checked to be a process group. A group
    given needs no initialised world: a plan's dry run shards a meta copy for each rank over a
    group that only answers its rank and size (planner/dry_run.py)."""
    if group is not None:
        return _checked_group(group, function)
    _require_initialized(function)
    return default_group()


def _checked_group(group: Optional[ProcessGroup], function: str) -> Optional[ProcessGroup]:
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{function}: group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    return group


def group_name(group: Optional[ProcessGroup] = None) -> str:
    """The name C++ ops resolve ``group`` (default: the default group) by."""
    return resolve(group, "group_name").group_name


def _cpu_backend(group: ProcessGroup) -> str:
    """The name of ``group``'s backend for CPU tensors ("gloo", "fake", ...), or "" where it has none."""
    try:
        return group._get_backend(torch.device("cpu")).name()
    except (RuntimeError, AttributeError):
        return ""


# By group name: (the group, the second group over its two ranks that its rings use, or None).
# A group made again under the same name (torch.distributed started again) is prepared again.
_ring_return_groups: dict = {}


@atexit.register
def _destroy_ring_return_groups() -> None:
    """Destroys the return groups while their world still exists, so that their threads are
    joined now, not during the interpreter's teardown, where they could outlive what they use
    (and abort the process); rings on their groups go over one connection from then on."""
    prepared = list(_ring_return_groups.items())
    _ring_return_groups.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return  # the world was destroyed, and the return groups with it
    for name, (_, returning) in prepared:
        if returning is None:
            continue
        torch.ops.autoshard.set_ring_return_group(name, "")
        try:
            dist.destroy_process_group(returning)
        except Exception:  # noqa: BLE001 - gone already: destroying the world destroys its subgroups
            pass


def prepare_rings(group: Optional[ProcessGroup] = None) -> None:
    """Collective over ``group``: gives a two-rank gloo group the second connection its rings
    want. A ring at two ranks sends to and receives from the same rank, and gloo's connection
    handles one direction at a time (a message being read holds it), so each rank's sends
    would wait on its receives; a second group over the same two ranks carries the data from
    the higher rank to the lower (csrc/comm/ring.h). Other groups, and a job that turns rings
    off (AUTOSHARD_GLOO_RINGS=0), are left as they are. Idempotent; parallelize and the
    collectives of ``autoshard.comm`` call it."""
    group = resolve(group, "prepare_rings")
    name = group.group_name
    if name in _ring_return_groups and _ring_return_groups[name][0] is group:
        return
    # Only a group of torch's own: a memory prediction's fake group on meta has no connections.
    if group not in dist.distributed_c10d._world.pg_map:
        return
    returning = None
    if group.size() == 2 and os.environ.get("AUTOSHARD_GLOO_RINGS") != "0" and _cpu_backend(group) == "gloo":
        returning = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                   use_local_synchronization=True)
    torch.ops.autoshard.set_ring_return_group(name, "" if returning is None else returning.group_name)
    _ring_return_groups[name] = (group, returning)
