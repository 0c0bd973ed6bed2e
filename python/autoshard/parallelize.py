"""parallelize(): applies a ShardingPlan to a model in place, from outside the model.

Layers are swapped for their sharded counterparts, integer attributes that hold a global
size become local (GPT-2's split_size), and column layers that read the same tensor (q, k
and v) share one input copy, so that backward all-reduces their summed gradient once. The
plan is first tried on a meta copy of the model; a plan that cannot work fails there, before
any weight is touched.
"""

from typing import Dict, Optional, Union

import torch
from torch import nn

from .apply import overlap
from .runtime import forward_checks, mesh_fully_shard, partial_gradients, shard_guard
from .core import region_generators
from .optim import torch_optim_check
from .runtime import loss_parallel as loss_parallelism
from .runtime.rank_agreement import check_ranks_agree, on_every_rank
from .runtime.data_parallel import GradientAverager
from .core.distributed import ProcessGroup, prepare_rings, resolve
from .planner.dry_run import dry_run
from .core.parallel_state import ParallelState, state_of
from .state.optimizer_views import install_global_optimizer_hook
from .runtime.optimizer_partition import partition_replicated
from .runtime.replica_check import DEFAULT_EVERY
from .runtime.pending_gradients import check_no_pending_gradients
from .planner.sharding_plan import ShardingPlan
from .planner.make_plan import check_plain_parameters
from .planner import plan_json, sequence_choice
from .planner.holdings import nothing_split_error
from .planner.plan_until_it_runs import plan_until_it_runs
from .apply.shard_model import apply_plan, check_plan_fits
from .state.state_views import install_state_dict_views


def _keep_training_flags(model: nn.Module, flags: Dict[str, bool]) -> None:
    """Gives every module the training flag the model's module of its name had before the
    surgery, and a module new under that name (a sharded layer's own parts) its nearest
    predecessor's: a model parallelized in evaluation stays so, and its layers draw nothing."""
    for name, module in model.named_modules():
        owner = name
        while owner not in flags:
            owner = owner.rpartition(".")[0]
        module.training = flags[owner]


def parallelize(model: nn.Module, plan: Optional[ShardingPlan] = None, group: Optional[ProcessGroup] = None,
                mesh=None, *, example_inputs=None, sequence_parallel: Union[bool, str] = True, loss_parallel: bool = True,
                partition_optimizer_state: bool = True, check_inputs: bool = True,
                check_replicas_every: int = DEFAULT_EVERY, reduce_dtype: Optional[torch.dtype] = None, fully_shard: bool = False,
                memory_budget: Optional[int] = None, overlap_backward: bool = True) -> nn.Module:
    """Shards `model` in place over `group` (None: the "tp" dimension of `mesh`, else the
    process-wide default group, see distributed.default_group; kept as
    model.autoshard_state.group) following `plan` (None: autoshard.plan(model, example_inputs=...));
    returns it. `example_inputs` (as autoshard.plan takes them: a tuple of positional arguments
    or a dict of keyword arguments; None makes them for a Hugging Face model) also feed the
    dry run of the plan on a meta copy.

    With a ("dp", "tp") DeviceMesh, each data-parallel replica is tensor-parallel over its
    "tp" group, and gradients are averaged over "dp" in buckets started during backward.
    With more than one dp replica and `partition_optimizer_state`, the parameters that tp
    replicates have their optimizer state partitioned over "dp" (see optimizer_partition):
    their gradients are reduce-scattered, autoshard.optim steps each rank's piece, and the
    pieces are all-gathered after the step. torch.optim's optimizers know nothing of pieces:
    a step of one over such parameters raises; use them with partition_optimizer_state=False.
    With `fully_shard`, torch's FSDP2 shards every parameter, its gradient and optimizer state
    over "dp" instead (each block and the root, see mesh_fully_shard): 1/(dp*tp) of the model
    per rank, against 1/tp; the parameters become FSDP's DTensors.

    Each forward first checks (see forward_checks) that no DDP or FSDP wrapper spans two of
    the tensor-parallel ranks, and, with `check_inputs`, that every tensor-parallel rank was
    given the same tensor inputs: a rank with a batch of its own would be silently wrong. The
    inputs' shapes and the ranks' count of forwards are compared even without it (ranks with
    different shapes would abort in the first collective). Every `check_replicas_every` forwards
    (100 by default; 0 turns it off) the parameters the ranks replicate are compared by a
    fingerprint (see replica_check): a rank that skipped an optimizer step is refused.

    `reduce_dtype` is the dtype in which parameter gradients are summed: over "dp" (the
    averaging buckets) and over "tp" (replicated parameters whose gradients are partial sums,
    such as KV heads held by several ranks). None reduces them in the parameters' own dtype;
    torch.float32 for a bf16 model sums in fp32 and rounds the result once, as torch's
    MixedPrecisionPolicy(reduce_dtype=torch.float32) does.

    `sequence_parallel` lets the plan split the tokens over the ranks between a row layer and
    the next column layers where every op there is per token (norms, residual adds, dropout):
    reduce-scatter and all-gather in place of the all-reduce, those activations 1/N the size.
    Dropout there draws each rank's mask for its own tokens. `sequence_parallel="auto"` splits
    them where it pays: on NCCL, or on gloo where the step's predicted peak without it exceeds
    `memory_budget` (bytes per rank); print(plan) says why. A given `plan` decides alone.

    With `loss_parallel` (see runtime/loss_parallel.py), a language model called with labels computes
    its loss over vocabulary shards: the output head keeps its shard and the logits returned
    beside the loss are this rank's shard (autoshard.gather_logits makes them whole); called
    without labels it returns whole logits. Models whose loss autoshard cannot prove equal keep
    whole logits; model.autoshard_state.loss_parallel says which applies and why.

    With `overlap_backward` (the default), the all-reduce of a column layer's input gradient (the
    reduce-scatter, with sequence parallelism) runs while the weight gradients of the column
    layers reading that input are computed (see backward_overlap): the same collectives and
    bit-identical results. Outside autocast and torch.compile; double backward through such a
    layer raises, so a model that needs it is parallelized with overlap_backward=False."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"parallelize: reduce_dtype must be None or a floating-point torch.dtype, got {reduce_dtype!r}")
    sequence_choice.check_arguments("parallelize", sequence_parallel, memory_budget)
    for name, value in (("loss_parallel", loss_parallel), ("partition_optimizer_state", partition_optimizer_state),
                        ("overlap_backward", overlap_backward), ("check_inputs", check_inputs)):
        if not isinstance(value, bool):
            raise TypeError(f"parallelize: {name} must be a bool, got {type(value).__name__}")
    if isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) \
            or check_replicas_every < 0:
        raise TypeError(f"parallelize: check_replicas_every must be an int >= 0 (0 turns the check off), "
                        f"got {check_replicas_every!r}")
    if state_of(model) is not None or any(hasattr(m, "shard_specs") for m in model.modules()):
        raise ValueError("parallelize: the model is already parallelized (it holds sharded layers); parallelize "
                         "a freshly built model instead")
    check_no_pending_gradients(model)
    check_plain_parameters(model, "parallelize")
    data_parallel = fully_shard_over = None
    if mesh is not None:
        if group is not None:
            raise ValueError("parallelize: give group or mesh, not both")
        names = tuple(mesh.mesh_dim_names or ())
        if "tp" not in names or not set(names) <= {"dp", "tp"}:
            raise ValueError(f"parallelize: mesh dimensions must be ('dp', 'tp') or ('tp',), got {names}")
        group = mesh.get_group("tp")
        if "dp" in names and mesh.size(names.index("dp")) > 1:
            if fully_shard:
                fully_shard_over = mesh["dp"]
            else:
                data_parallel = mesh.get_group("dp")
    mesh_fully_shard.check_keyword(fully_shard, mesh, tuple(getattr(mesh, "mesh_dim_names", None) or ()))
    group = resolve(group, "parallelize")
    # Before anything that could fail on some ranks only (and leave the others waiting).
    check_ranks_agree(model, plan_json.dumps(plan, input_values=False, prediction=False)
                      if isinstance(plan, ShardingPlan) else None, group)
    if any(p.device.type == "cpu" for p in model.parameters()):
        prepare_rings(group)  # the model's collectives run on CPU tensors: rings on gloo
    if plan is None:
        def checked_dry_run(candidate):
            def run():
                check_plan_fits(model, candidate, group.size())
                return dry_run(model, candidate, group, example_inputs, apply_plan)

            return on_every_rank(run, group)

        choice = ""
        if sequence_parallel == "auto":
            sequence_parallel, choice = sequence_choice.choose(model, group.size(), example_inputs, None,
                                                               memory_budget, sequence_choice.backend_of(model, group))
        plan, state_shapes = plan_until_it_runs(model, group.size(), example_inputs, sequence_parallel,
                                                checked_dry_run, choice)
        # Every rank made its plan alone: they must have made the same one.
        check_ranks_agree(model, plan_json.dumps(plan, input_values=False, prediction=False), group)
    else:
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"parallelize: plan must be a ShardingPlan, got {type(plan).__name__}")
        check_plan_fits(model, plan, group.size())
        state_shapes = on_every_rank(lambda: dry_run(model, plan, group, example_inputs, apply_plan), group)
    # Tensor parallelism that splits nothing would train the whole model on every rank, silently.
    refusal = nothing_split_error(plan)
    if refusal:
        raise ValueError(refusal)
    flags = {name: module.training for name, module in model.named_modules()}
    tokens = apply_plan(model, plan, group)
    if overlap_backward:
        overlap.enable(model, tokens)
    for module in model.modules():
        if hasattr(type(module), "reduce_dtype"):
            module.reduce_dtype = reduce_dtype
    state = ParallelState(model, plan, group, mesh, data_parallel).attach()
    state.unsharded_state_shapes = state_shapes  # what full_state_dict checks hooks' entries against
    # Tools that read state_dict() by name (torch's DCP) see the global tensors, not one shard.
    install_state_dict_views(model, state.shards())
    install_global_optimizer_hook()
    state.loss_parallel = loss_parallelism.install(model, plan, group, loss_parallel)
    # Replicated parameters read inside sharded regions: their gradients are summed over the
    # group (and averaged over "dp" with them, so the data-parallel averager leaves them out).
    if group.size() > 1:
        state.partial_gradients = partial_gradients.install(model, plan.partial_gradients, group.group_name,
                                                            data_parallel, reduce_dtype)
    if data_parallel is not None:
        reducer = state.partial_gradients
        summed = {id(p) for bucket in (reducer.buckets if reducer else ()) for p in bucket.params}
        partitioned = (partition_replicated(state, data_parallel, exclude=summed)
                       if partition_optimizer_state else ())
        params = [p for p in model.parameters() if id(p) not in summed]
        state.gradient_averager = GradientAverager(params, data_parallel, partitioned=partitioned,
                                                   reduce_dtype=reduce_dtype)
        if partitioned:
            torch_optim_check.install()
    if group.size() > 1:
        state.forward_checks = forward_checks.install(model, group, check_inputs, check_replicas_every)
        # A region the model's last layers leave open (a head feeding a vocabulary-parallel
        # loss) ends with the forward, so that the generators are synchronised between forwards.
        region_generators.install(model)
    # Last, so that nothing above reads a shard through the guard: from here on, an op on a
    # sharded parameter outside autoshard computes with the whole tensor or raises.
    # LoRA factors split with their base layer stay plain: PEFT reads them itself to merge them
    # (B's rows times A, or B times A's columns: this rank's piece of the product, as it must be).
    shard_guard.install(model, state.shards(), frozenset(name for record in plan.adapters for name in record.split))
    if fully_shard_over is not None:
        mesh_fully_shard.apply(model, fully_shard_over, reduce_dtype)
    _keep_training_flags(model, flags)
    return model
