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

from . import backward_overlap, forward_checks, mesh_fully_shard, partial_gradients, region_generators, shard_guard
from . import torch_optim_check
from . import loss_parallel as loss_parallelism
from .rank_agreement import check_ranks_agree, on_every_rank
from .data_parallel import GradientAverager
from .distributed import ProcessGroup, default_group, prepare_rings, resolve, set_default_group
from .dry_run import dry_run
from .input_copies import InputCopyPerCall, SharedInputCopy
from .parallel_state import ParallelState, state_of
from .constructs import Surgery, record_constructs
from .constructs.base import set_submodule
from .constructs.summed_output import keep_input
from .nn import sequence
from .optimizer_views import install_global_optimizer_hook
from .optimizer_partition import partition_replicated
from .replica_check import DEFAULT_EVERY
from .pending_gradients import check_no_pending_gradients
from .plan import LayerPlan, ShardingPlan, check_plain_parameters
from .plan.local_attributes import region_view_sizes, set_attribute
from .nn.view_sizes import ViewSizeHooks
from .plan import plan_json, sequence_choice
from .plan_until_it_runs import plan_until_it_runs
from .replaced_modules import check_no_hooks_lost
from .state_views import install_state_dict_views
from .styles import TokenRole


def _check_plan_fits(model: nn.Module, plan: ShardingPlan, world_size: int) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"parallelize: plan must be a ShardingPlan, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(f"parallelize: the plan was made for world_size={plan.world_size}, "
                         f"but the group has {world_size} ranks")
    params = dict(model.named_parameters(remove_duplicate=False))
    for layer in plan.layers:
        try:
            module = layer.construct.module_of(model, layer)
        except AttributeError:
            raise ValueError(f"parallelize: the plan names layer {layer.module!r}, which the model lacks") from None
        weight = layer.construct.weight_of(module, layer)
        if not isinstance(weight, torch.Tensor) or list(weight.shape) != list(layer.weight_shape):
            got = None if weight is None else list(weight.shape)
            raise ValueError(f"parallelize: layer {layer.module!r} has weight shape {got}, "
                             f"the plan expects {layer.weight_shape}")
        if hasattr(module, "shard_specs"):
            raise ValueError(f"parallelize: layer {layer.module!r} is already sharded")
        if layer.weight not in params:
            raise ValueError(f"parallelize: the plan names parameter {layer.weight!r}, which the model lacks")
    for construct in record_constructs():
        construct.check(model, plan, params)
    check_no_hooks_lost(model, plan)


def _input_copy(calls, copies, tokens, group_name: str):
    """A column layer's input copy, from the plan's records of its calls: its group's shared
    copy, its gather of the tokens, or None (a copy of its own); one of those per call where
    its calls read tensors of different copy groups."""
    def of(layer):
        if layer.copy_group in copies:
            return copies[layer.copy_group]
        if layer.sequence.gathers:
            return tokens.gathers[layer.copy_group]
        return None

    if len({layer.copy_group for layer in calls}) > 1:
        return InputCopyPerCall(group_name, [of(layer) for layer in calls])
    return of(calls[0])


def _apply(model: nn.Module, plan: ShardingPlan, group: ProcessGroup) -> sequence.PlanSteps:
    rank, world = group.rank(), group.size()
    users: Dict[int, int] = {}
    for layer in plan.layers:
        if layer.style.is_column:
            users[layer.copy_group] = users.get(layer.copy_group, 0) + 1
    tokens = sequence.steps(plan, group.group_name)
    copies = {g: SharedInputCopy(group.group_name, n, tokens.gathers.get(g)) for g, n in users.items() if n > 1}
    calls: Dict[str, list] = {}  # a column layer -> the plan's records of its calls, in order
    for layer in plan.layers:
        if layer.style.is_column:
            calls.setdefault(layer.module, []).append(layer)
    # Every place a parameter is registered, so that tied parameters (an embedding shared with
    # the output head, a head's bias also held by its parent) stay one parameter once sharded.
    registrations: Dict[int, list] = {}
    for owner in model.modules():
        for attr, param in owner._parameters.items():
            if param is not None:
                registrations.setdefault(id(param), []).append((owner, attr))
    replaced: Dict[int, nn.Parameter] = {}
    # An nn.MultiheadAttention is split by heads as one: its projection's plan shards its out_proj too.
    attentions = {layer.module for layer in plan.layers if layer.kind == "attention" and layer.style.is_split}
    inside_attention = {name.rpartition(".")[0] + ".out_proj" for name in attentions}
    experts: Dict[str, list] = {}
    first_calls: Dict[str, LayerPlan] = {}
    for layer in plan.layers:
        # A layer called more than once (ALBERT's shared layer) appears once per call, each
        # split alike (the planner sees to it): sharded once, at its first call.
        if layer.kind == "experts":  # two entries, its column side and its row side
            experts.setdefault(layer.module, []).append(layer)
            continue
        first = first_calls.setdefault(layer.module, layer)
        if first is not layer:
            _check_same_split(first, layer)
            continue
        if not layer.style.is_split or layer.module in inside_attention:
            continue
        if layer.module in attentions:
            attention = layer.construct.shard_attention(model, plan, layer, group, tokens)
            input_copy = _input_copy(calls[layer.module], copies, tokens, group.group_name)
            if input_copy is not None:
                attention.in_proj.input_copy = input_copy
            continue
        module = model.get_submodule(layer.module)
        originals = {name: getattr(module, name, None) for name in ("weight", "bias")}
        sharded = layer.construct.shard(layer, module, group)
        for name, original in originals.items():
            if original is None:
                continue
            if id(original) in replaced:
                setattr(sharded, name, replaced[id(original)])
            else:
                replaced[id(original)] = getattr(sharded, name)
        input_copy = _input_copy(calls[layer.module], copies, tokens, group.group_name) if layer.module in calls else None
        deferred = [call.deferred_copy for call in calls.get(layer.module, [])]
        if any(deferred) and not all(deferred):
            raise ValueError(f"parallelize: layer {layer.module!r} is called more than once and the plan sums its input's "
                             "gradient upstream in only some of its calls; every call must copy its input alike")
        if deferred and all(deferred):
            input_copy = keep_input  # its input's gradient is summed upstream (constructs/summed_output.py)
        if input_copy is not None:
            sharded.input_copy = input_copy
        if layer.sequence is TokenRole.REDUCE_SCATTER:
            sharded.output_tokens = tokens.reduce_scatter(layer)
        set_submodule(model, layer.module, sharded)
    for name, sides in experts.items():
        sides[0].construct.shard_sides(model.get_submodule(name), name, sides, group, copies.get(sides[0].copy_group))
    for key, new in replaced.items():
        for owner, attr in registrations.get(key, []):
            if not hasattr(owner, "shard_specs"):
                owner._parameters[attr] = new
    surgery = Surgery(group, rank, world, tokens, registrations)
    for construct in record_constructs():
        construct.apply(model, plan, surgery)
    for region in plan.regions.values():
        owner = model.get_submodule(region.module)
        for attr in region.attributes:
            set_attribute(owner, attr, region.local_attribute(attr, rank, world))
        if region.view_sizes:
            owner.autoshard_view_sizes = ViewSizeHooks(owner, region_view_sizes(region, rank, world))
    return tokens


def _training_flags(model: nn.Module) -> Dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def _keep_training_flags(model: nn.Module, flags: Dict[str, bool]) -> None:
    """Gives every module the training flag the model's module of its name had before the
    surgery, and a module new under that name (a sharded layer's own parts) its nearest
    predecessor's: a model parallelized in evaluation stays so, and its layers draw nothing."""
    for name, module in model.named_modules():
        owner = name
        while owner not in flags:
            owner = owner.rpartition(".")[0]
        module.training = flags[owner]


def _check_same_split(first: LayerPlan, again: LayerPlan) -> None:
    split = lambda l: (l.style, l.units, tuple(l.parts), tuple(l.whole_parts), l.summed_parts, l.repeat, l.letter,
                       l.sequence)
    if split(first) != split(again):
        raise ValueError(f"parallelize: layer {first.module!r} is called more than once and the plan splits its calls "
                         f"differently ({split(first)} and {split(again)}); every call must meet the same split")


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

    With `loss_parallel` (see loss_parallel.py), a language model called with labels computes
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
    if not isinstance(loss_parallel, bool):
        raise TypeError(f"parallelize: loss_parallel must be a bool, got {type(loss_parallel).__name__}")
    if not isinstance(partition_optimizer_state, bool):
        raise TypeError(f"parallelize: partition_optimizer_state must be a bool, "
                        f"got {type(partition_optimizer_state).__name__}")
    if not isinstance(overlap_backward, bool):
        raise TypeError(f"parallelize: overlap_backward must be a bool, got {type(overlap_backward).__name__}")
    if not isinstance(check_inputs, bool):
        raise TypeError(f"parallelize: check_inputs must be a bool, got {type(check_inputs).__name__}")
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
                _check_plan_fits(model, candidate, group.size())
                return dry_run(model, candidate, group, example_inputs, _apply)

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
        _check_plan_fits(model, plan, group.size())
        state_shapes = on_every_rank(lambda: dry_run(model, plan, group, example_inputs, _apply), group)
    flags = _training_flags(model)
    tokens = _apply(model, plan, group)
    if overlap_backward:
        backward_overlap.enable(model, tokens)
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
    if mesh is not None and group is not default_group():
        # What is given this model uses its state's group; a call with no model at hand (a
        # loss over vocabulary shards, a collective) and group=None must not span the
        # data-parallel replicas, where it would compute silently wrong values.
        set_default_group(group)
    return model
