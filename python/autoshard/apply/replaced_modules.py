"""The modules parallelize replaces by sharded ones, and the hooks that would be lost with them.

A Linear, Conv1D, einsum layer, plain nn.Embedding or RMS norm that the plan splits is swapped
for a new module (ColumnParallelLinear, VocabParallelEmbedding, ShardedRMSNorm, ...), which
has none of the old one's hooks: a forward hook that scales its output, a pre-hook that edits
its input, or a state_dict hook that saves a fused weight under other names would silently
stop applying. Such a plan is refused before any weight changes. Modules changed in place (an
nn.MultiheadAttention split by heads, an embedding subclass with a forward of its own, an
experts module) keep their hooks.
"""

from typing import List

from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..constructs import record_constructs
from ..nn.multihead_attention import IN_PROJECTION
from ..core.styles import Style

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def replaced_modules(model: nn.Module, plan) -> List[str]:
    """The names of the modules `plan` replaces in `model`."""
    names = []
    for layer in plan.layers:
        if not layer.style.is_split:
            continue
        owner, _, child = layer.module.rpartition(".")
        if child == IN_PROJECTION:
            continue  # the attention itself is changed in place; its out_proj is replaced
        if layer.construct.replaces(model.get_submodule(layer.module)):
            names.append(layer.module)
    for construct in record_constructs():
        names += construct.replaced(plan)
    return sorted(set(names))


def _computes_weight(hook) -> bool:
    """Whether a forward pre-hook is torch's own that computes the module's weight before each call
    (torch.nn.utils.weight_norm, spectral_norm): the module, held whole, computes what it did."""
    return isinstance(hook, (WeightNorm, SpectralNorm))


def check_no_hooks_lost(model: nn.Module, plan) -> None:
    """Refuses a plan that would replace a module holding hooks of its own."""
    found, computed = [], []
    for name in replaced_modules(model, plan):
        module = model.get_submodule(name)
        kinds = [attr.strip("_").removesuffix("s") for attr in _HOOKS if getattr(module, attr, None)]
        if kinds:
            found.append(f"{name!r} ({type(module).__name__}: {', '.join(kinds)})")
            hooks = [hook for attr in _HOOKS for hook in getattr(module, attr, {}).values()]
            if all(_computes_weight(hook) for hook in hooks):
                computed.append(name)
    if found:
        overrides = {text.split("'")[1]: Style.REPLICATE.value for text in found}
        refusal = ValueError(f"parallelize: the plan replaces module(s) {'; '.join(found)} by sharded ones, which "
                             "would not run their hooks; remove the hooks before parallelize (and register them again "
                             f"on the sharded modules if they still apply), or keep these modules whole with "
                             f"autoshard.plan(model, overrides={overrides}); the model was left unchanged")
        if len(computed) == len(found):
            # Only torch's own weight-computing hooks: a plan autoshard makes holds these modules
            # whole instead (planner/plan_until_it_runs.py); a user's hooks are theirs to move.
            refusal.whole_layers = computed
            refusal.whole_reason = ("its weight is computed before each call by torch.nn.utils.weight_norm's (or "
                                    "spectral_norm's) forward pre-hook, which a sharded module would not run")
        raise refusal
