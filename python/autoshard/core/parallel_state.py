"""What autoshard decided for one model, in one object attached to it.

``parallelize`` attaches a ``ParallelState`` to the model it shards (``model.autoshard_state``):
the plan, the tensor-parallel group or mesh, the data-parallel group, the partitions of
replicated parameters' optimizer state, and the gradient averager. Every parameter of the
model points back at it (weakly), so that what is given a model (``full_state_dict``,
``checkpoint``, ``load_pretrained``) or only parameters (``clip_grad_norm_``, the
optimizers) finds it there; nothing is kept process-wide. In particular the model's
tensor-parallel group (a mesh's "tp" dimension) is ``state.group``: ``parallelize`` leaves the
process-wide default of ``distributed.default_group`` alone. A sharded layer built by hand is
its own model: its constructors attach a state of their own, which ``parallelize`` replaces.

The sharded modules describe themselves (``module.shard_specs``, ``module.group``), so the
state reads them from the model when asked, as they are at that moment.
"""

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .spec import ShardSpec, module_shards

# vocab_parallel_cross_entropy's forward: the rows' maxima, their sums of exponentials and their
# target logits (csrc/loss/cross_entropy_common.cpp).
LOSS_PARALLEL_ALL_REDUCES = 3

# The model's attribute, and each parameter's weak reference back to it.
STATE_ATTRIBUTE = "autoshard_state"
_PARAMETER_TAG = "_autoshard_state"


class ParallelState:
    """What parallelize decided for `model`: the plan, the tensor-parallel `group` (from
    `mesh` when one was given), the `data_parallel_group` (None without one), the
    `partitions` of parameters whose optimizer state is split over it, and the
    `gradient_averager` that averages gradients over it."""

    def __init__(self, model: nn.Module, plan=None, group=None, mesh=None, data_parallel_group=None):
        self._model = weakref.ref(model)
        self.plan = plan
        self.group = group
        self.mesh = mesh
        self.data_parallel_group = data_parallel_group
        self.partitions: Dict[int, object] = {}  # id(parameter) -> its Partition
        self.gradient_averager = None
        # Sums replicated parameters' partial gradients over the group (runtime/partial_gradients.py).
        self.partial_gradients = None
        # Whether the loss is computed over vocabulary shards, and why (loss_parallel.LossParallel).
        self.loss_parallel = None
        # What the model checks at each forward (forward_checks.ForwardChecks; None on one rank).
        self.forward_checks = None
        # With fully_shard over "dp" (fully_sharded.adopt): FSDP's ranks, and the sums over the
        # tensor-parallel group that replace partial_gradients on FSDP's parameters.
        self.fully_sharded_over = None
        self.fsdp_gradient_sums = None

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model()

    def collectives(self, phase: str, labels: bool = False, training: Optional[bool] = None) -> Dict[str, int]:
        """The plan's collectives per step in `phase` ("forward" or "backward"); with `labels`,
        those of a call with labels, which compute the loss over vocabulary shards where
        loss parallelism is on; with `training`, those of a forward in that mode, by default the
        model's (see ShardingPlan.collectives)."""
        if training is None:
            training = self.model.training if self.model is not None else True
        return self.plan.collectives(phase, loss_parallel=labels and self._loss_parallel_head() != "",
                                     training=training)

    def _loss_parallel_head(self) -> str:
        decision = self.loss_parallel
        return decision.head if decision is not None and decision.enabled else ""

    def __str__(self) -> str:
        """The plan's printout, and what a call with labels communicates under loss parallelism."""
        text = str(self.plan)
        head = self._loss_parallel_head()
        if head:
            text += (f"\ncalled with labels (loss parallelism): {head}'s all_gather of the logits gives way to "
                     f"all_reduce x{LOSS_PARALLEL_ALL_REDUCES} of a few values per token, so forward is "
                     f"{self.collectives('forward', labels=True)}")
        return text

    def sharded_modules(self) -> List[nn.Module]:
        model = self.model
        return [] if model is None else [m for m in model.modules() if hasattr(m, "shard_specs")]

    def shards(self) -> Dict[int, Tuple[ShardSpec, object]]:
        """id(parameter) -> (its ShardSpec, its module's group) for the model's sharded parameters."""
        return module_shards(self.sharded_modules())

    def partition_of(self, param: torch.Tensor):
        return self.partitions.get(id(param))

    def attach(self) -> "ParallelState":
        """Attaches this state to its model and points every parameter of the model at it."""
        model = self.model
        setattr(model, STATE_ATTRIBUTE, self)
        _LIVE_STATES.add(self)
        ref = weakref.ref(self)
        for param in model.parameters():
            param.__dict__[_PARAMETER_TAG] = ref
        for callback in _ON_ATTACH:
            callback(self)
        return self


def state_of(model: nn.Module) -> Optional[ParallelState]:
    """The state parallelize attached to `model` (a sharded layer's own), or None."""
    state = getattr(model, STATE_ATTRIBUTE, None)
    return state if isinstance(state, ParallelState) else None


# Every attached state while its model lives (torch_clip finds a gradient's parameter here).
_LIVE_STATES: "weakref.WeakSet[ParallelState]" = weakref.WeakSet()


# Called with each state as it is attached: runtime/torch_patches.py installs torch's reroutes
# (clipping, GradScaler) while a parallelized model lives, and removes them after the last.
_ON_ATTACH: List[Callable[["ParallelState"], None]] = []


def on_attach(callback: Callable[["ParallelState"], None]) -> None:
    """Calls `callback(state)` whenever a state is attached to its model (once per callback)."""
    if callback not in _ON_ATTACH:
        _ON_ATTACH.append(callback)


def live_states() -> List[ParallelState]:
    return list(_LIVE_STATES)


def parameter_state(param: torch.Tensor) -> Optional[ParallelState]:
    """The state of the model `param` belongs to, or None."""
    ref = param.__dict__.get(_PARAMETER_TAG) if hasattr(param, "__dict__") else None
    return None if ref is None else ref()


def parameters_states(params: Iterable[torch.Tensor]) -> List[ParallelState]:
    """The distinct states of the models `params` belong to, in order of first appearance."""
    return list({id(state): state for p in params if (state := parameter_state(p)) is not None}.values())


def shards_of(params: Iterable[torch.Tensor]) -> Dict[int, Tuple[ShardSpec, object]]:
    """ParallelState.shards() of every model `params` belong to, together."""
    return {key: found for state in parameters_states(params) for key, found in state.shards().items()}


def keep_state_across_swap(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Before torch.utils.swap_tensors(tensor, new), which swaps the objects' __dict__: gives
    `new` the reference to the state, so that `tensor` still holds it after the swap."""
    ref = tensor.__dict__.get(_PARAMETER_TAG)
    if ref is not None:
        new.__dict__[_PARAMETER_TAG] = ref


def attach_layer_state(layer: nn.Module) -> None:
    """A sharded layer built by hand is its own model: gives it the state of one."""
    ParallelState(layer, group=getattr(layer, "group", None)).attach()
