"""A plan parallelize() made itself, planned again until its dry run on a meta copy computes
what it predicts.

The dry run (planner/dry_run.py) traces the sharded model on meta and compares every op's
shape, and the forward collectives, with the plan's prediction. Where they differ, the plan
would compute something else than the model: a plan the user gave is refused. A plan made here
is instead made again with the module where the difference appeared held whole, and so on
outwards, so that the model is never refused for one region:

1. a block recorded as identical to another without being run (see capture/folding.py) that
   computes otherwise: planned again running every block;
2. the module that computed other shapes (the innermost module whose call holds the first
   differing op), in every block alike (`layers.0.attn` -> `layers.*.attn`): its layers whole;
   if it holds none, or still differs, its parent's; at the end the whole model;
3. layers whose forward issued none of the collectives their plan needs, and embedding
   subclasses whose forward reads their table other than by a lookup (nn/embedding_subclass.py):
   those layers whole.

The layers held whole say why in the plan (reason "shape_mismatch", the dry run's finding).
"""

import re
from typing import Callable, Dict, Optional, Tuple

from .sharding_plan import ShardingPlan
from .make_plan import plan_keeping_whole, within

# Each round holds one more module whole; a model deeper than this is held whole at once.
MAX_ROUNDS = 8


def _every_block(module: str) -> str:
    """The module in every block of its ModuleLists: numbered path parts become wildcards."""
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def plan_until_it_runs(model, world_size: int, example_inputs, sequence_parallel: bool,
                       dry_run: Callable[[ShardingPlan], Optional[dict]], sequence_choice: str = "",
                       overrides: Optional[Dict[str, str]] = None,
                       gather_unpaired: bool = True) -> Tuple[ShardingPlan, Optional[dict]]:
    """(plan, what dry_run returned) for the first plan whose dry run passes; `sequence_choice`
    is why sequence_parallel is what it is, where "auto" chose it."""
    whole: Dict[str, str] = {}
    every_block = False

    def make() -> ShardingPlan:
        return plan_keeping_whole(model, world_size, example_inputs, overrides, sequence_parallel, whole,
                                  fold_blocks=not every_block, sequence_choice=sequence_choice,
                                  gather_unpaired=gather_unpaired)

    plan = make()
    for _ in range(MAX_ROUNDS):
        try:
            return plan, dry_run(plan)
        except ValueError as refusal:
            why = "the sharded forward on a meta copy differed from the plan: " + re.sub(
                r"^parallelize: on a meta copy of the model, |; the plan was refused and the model left unchanged$",
                "", str(refusal))
            if getattr(refusal, "folded_block", False) and not every_block:
                every_block = True
            elif getattr(refusal, "silent_layers", None) or getattr(refusal, "whole_layers", None):
                layers = getattr(refusal, "silent_layers", None) or refusal.whole_layers
                if all(name in whole for name in layers):
                    raise
                whole.update({name: getattr(refusal, "whole_reason", why) for name in layers})
            elif getattr(refusal, "module", None) is not None:
                pattern = _every_block(refusal.module) if refusal.module != "<model>" else ""
                while pattern and (pattern in whole or not _holds_split_layer(plan, pattern)):
                    pattern = _parent(pattern)
                if pattern in whole:
                    raise
                whole[pattern] = why
            else:
                raise
        plan = make()
    whole = {"": "the sharded forward on a meta copy differed from the plan in more than "
                 f"{MAX_ROUNDS} modules"}
    plan = make()
    return plan, dry_run(plan)


def _holds_split_layer(plan: ShardingPlan, pattern: str) -> bool:
    return any(layer.style.is_split and within(layer.module, pattern) for layer in plan.layers)
