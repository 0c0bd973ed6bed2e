"""The dry run of a plan: the model sharded on a meta copy, traced op by op against the
plan's predicted shapes, its forward collectives counted against the plan's, before parallelize
changes anything. What differs is refused (or, for a plan parallelize made itself, planned
again: plan_until_it_runs).

autoshard.plan() runs it too, for every rank in turn, over groups of its own that only answer a
rank and a size (paper_group): the plan it returns is the one parallelize would run, made with no
process group and no collective, on one rank or offline."""

import contextlib
from typing import Dict, Iterator, Optional

import torch
from torch import nn
from torch._C._distributed_c10d import FakeProcessGroup, _register_process_group, _unregister_process_group

from ..core.distributed import ProcessGroup
from ..nn.embedding_subclass import LookupRefusal
from .sharding_plan import ShardingPlan
from ..inputs.meta_inputs import input_shapes, inputs_on_meta
from ..inputs.meta_shadow import meta_shadow
from ..capture.shape_trace import trace_shapes
from .dry_run_collectives import ForwardCollectives, forward_mismatch, silent_layers, watched_layers
from ..capture.function_caches import fresh_caches
from ..inputs.hf_inputs import ordinary_token
from ..capture.layers import is_layer_module
from ..inputs.meta_autocast import meta_autocast
from ..inputs.meta_values import KnownValues
from .prediction import FoldedBlockMismatch, ShapeMismatch, check_model_trace
from ..state.unsharded import has_state_dict_hooks


def _example_inputs(model: nn.Module, plan: ShardingPlan, example_inputs, values: KnownValues):
    """The dry run's inputs on meta: the caller's, else those the plan was made with (tensors of
    their shapes for a plan read from JSON), else made from the model's config."""
    if example_inputs is not None:
        return inputs_on_meta(model, example_inputs, values)
    recorded = plan.input_values
    if recorded is not None:
        return values.to_meta(recorded[0]), values.to_meta(recorded[1])
    spec = plan.example.get("inputs")
    if spec is not None:
        # Ids hold a token that is no special one (1 without a config: 0 is the usual padding)
        # and masks ones, so that a padding check finds no padding; the rest zeros.
        token = ordinary_token(model.config) if hasattr(model, "config") else 1

        def make(s, name=""):
            fill = token if name.endswith("input_ids") else 1 if name.endswith("mask") else 0
            return torch.full(s["shape"], fill, dtype=getattr(torch, s["dtype"]))
        args, kwargs = tuple(make(s) for s in spec["args"]), {k: make(s, k) for k, s in spec["kwargs"].items()}
        return values.to_meta(args), values.to_meta(kwargs)
    return inputs_on_meta(model, None, values)


def _is_layer(module: nn.Module) -> bool:
    return is_layer_module(module)


def _state_shapes(shadow: nn.Module) -> Optional[Dict[str, list]]:
    """The unsharded model's state_dict entries' shapes where state_dict hooks make them (see
    state.full_state_dict), from its meta copy; None without hooks or where they fail on meta."""
    if not has_state_dict_hooks(shadow):
        return None
    try:
        return {k: list(v.shape) for k, v in shadow.state_dict().items() if isinstance(v, torch.Tensor)}
    except Exception:  # noqa: BLE001 - a hook that needs values: full_state_dict checks nothing then
        return None


def dry_run(model: nn.Module, plan: ShardingPlan, group: ProcessGroup, example_inputs, apply) -> Optional[dict]:
    """Tries `plan` on a meta copy of `model`, sharded by `apply(copy, plan, group)`; returns
    _state_shapes of that copy."""
    shadow = meta_shadow(model, always_copy=True)
    state_shapes = _state_shapes(shadow)
    prediction = plan.prediction
    values = KnownValues()
    try:
        apply(shadow, plan, group)
        args, kwargs = _example_inputs(shadow, plan, example_inputs, values)
        # The plan's predicted shapes hold for the inputs it was made with.
        planned_shapes = example_inputs is None or input_shapes(args, kwargs) == plan.example.get("description")
        if prediction is not None and planned_shapes:
            # Every intermediate shape against the plan's prediction for this rank.
            traced, error = trace_shapes(shadow, args, kwargs, _is_layer, values)
            if isinstance(error, LookupRefusal):
                raise error
            check_model_trace(prediction, traced, group.rank())
            if error is not None:
                raise error
        watch = ForwardCollectives().watch(shadow, watched_layers(plan))
        with fresh_caches(shadow), torch.no_grad(), meta_autocast(), values, watch as collectives:
            outputs = shadow(*args, **kwargs)
    except LookupRefusal as error:
        refusal = ValueError(f"{error}; the plan was refused and the model left unchanged")
        refusal.whole_layers = [error.embedding]
        refusal.whole_reason = f"an embedding whose forward {error.what}, which a split table cannot answer"
        raise refusal from None
    except ShapeMismatch as error:
        refusal = ValueError(f"parallelize: on a meta copy of the model, {error}; the plan was refused and the model "
                             "left unchanged")
        refusal.folded_block = isinstance(error, FoldedBlockMismatch)
        refusal.module = getattr(error, "module", None)
        raise refusal from None
    except Exception as error:
        raise ValueError(f"parallelize: the plan does not run on a meta copy of the model "
                         f"({type(error).__name__}: {error}); the model was left unchanged") from error
    # The plan counted its collectives on its own example inputs (as it predicted its shapes).
    mismatch = forward_mismatch(plan, collectives, shadow) if group.size() > 1 and planned_shapes else None
    if mismatch is not None:
        refusal = ValueError(f"parallelize: on a meta copy of the model, {mismatch}; the plan was refused and the "
                             "model left unchanged")
        refusal.silent_layers = silent_layers(plan, collectives)
        raise refusal
    if hasattr(outputs, "to_tuple"):
        outputs = outputs.to_tuple()
    flat = [o for o in torch.utils._pytree.tree_flatten(outputs)[0] if isinstance(o, torch.Tensor)]
    got = [list(o.shape) for o in flat]
    want = plan.example.get("output_shapes")
    if want is not None and planned_shapes and got != want:
        raise ValueError(f"parallelize: on a meta copy, the sharded model's outputs have shapes {got} instead of "
                         f"{want}; the model was left unchanged")
    return state_shapes


@contextlib.contextmanager
def paper_group(rank: int, size: int) -> Iterator[ProcessGroup]:
    """A process group of `size` ranks seen from `rank` that communicates nothing: what sharded
    modules built on a meta copy ask of their group (its rank, its size, its name for the ops'
    meta kernels), registered under a name of its own for as long as the block runs."""
    group = ProcessGroup(rank, size)
    # torch 2.13 builds a fake backend through _create_internal; older releases by its constructor.
    make_backend = getattr(FakeProcessGroup, "_create_internal", FakeProcessGroup)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, make_backend(rank, size))
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    name = f"autoshard-dry-run-{id(group):x}-rank-{rank}-of-{size}"  # unique while it is registered
    group._set_group_name(name)
    _register_process_group(name, group)
    try:
        yield group
    finally:
        _unregister_process_group(name)


def dry_run_on_paper(model: nn.Module, plan: ShardingPlan, example_inputs, apply, check_fits) -> Optional[dict]:
    """check_fits(model, plan, world_size), then dry_run for each of the plan's ranks in turn,
    over paper groups, as parallelize(model) checks its own plans: the first rank's refusal is
    raised, as parallelize's ranks all raise the lowest failing rank's. A refusal of check_fits
    that names no layers to hold whole (hooks of the user's own on a layer) is parallelize's to
    raise: the plan is still what the model's dataflow allows."""
    try:
        check_fits(model, plan, plan.world_size)
    except ValueError as refusal:
        if getattr(refusal, "whole_layers", None):
            raise
    state_shapes = None
    for rank in range(plan.world_size):
        with paper_group(rank, plan.world_size) as group:
            state_shapes = dry_run(model, plan, group, example_inputs, apply)
    return state_shapes
