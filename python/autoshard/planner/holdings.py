"""What each rank holds under a plan, counted from the model's parameters and the plan's shard
sizes, and what stays whole on every rank, and why.

Every parameter of the model is counted once (tied parameters under their first name), by
the module class it belongs with: the class of the module that holds it, or for a plain
Linear, Conv1D or einsum layer inside a larger module, that module's class (q_proj's weight
counts with LlamaAttention; embeddings count as Embedding). A sharded parameter counts its local part by its ShardSpec
(uneven splits, fused parts, KV heads held by several ranks all included); everything else
counts whole.
"""

import json
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..core import _library
from ..conventions.huggingface import CONV1D_CLASS_NAME
from ..nn.lora import is_lora_linear
from ..core.split import split_sizes
from .name_ranges import fold
from .records import ParameterRecord
from . import policy

# Why a parameter stays whole, in words, by reason code: the planner's table (csrc/plan/reasons.cpp),
# which also words the codes given outside the planner (parameters of no layer, layers held whole
# after their module computed other shapes than planned).
_library.load()
REASONS: Dict[str, str] = json.loads(torch.ops.autoshard.plan_reasons())

# Layer classes that count with the module holding them.
_PLAIN_LAYERS = ("Linear", CONV1D_CLASS_NAME, "EinsumDense")


def inventory(model: nn.Module) -> Dict[str, ParameterRecord]:
    """name -> its ParameterRecord for every parameter, tied ones once."""
    modules = dict(model.named_modules())
    found = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        owner_name = name.rpartition(".")[0]
        # A LoRA layer's base layer and factors count as the Linear it wraps.
        owner_name = _lora_layer_above(owner_name, modules) or owner_name
        owner = modules[owner_name]
        group = type(owner).__name__
        if group in _PLAIN_LAYERS and owner_name:
            parent = modules[owner_name.rpartition(".")[0]]
            if parent is not model:
                group = type(parent).__name__
        found[name] = ParameterRecord(list(param.shape), owner_name, group)
    return found


def _lora_layer_above(name: str, modules: Dict[str, nn.Module]) -> str:
    """The name of the LoRA layer holding module `name` (itself, its base layer, or a factor in
    its lora_A / lora_B), or ""."""
    parts = name.split(".")
    for depth in range(len(parts), max(len(parts) - 3, 0), -1):
        candidate = ".".join(parts[:depth])
        if is_lora_linear(modules.get(candidate)):
            return candidate
    return ""


def _numel(shape) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def local_counts(plan, rank: int) -> Dict[str, int]:
    """Parameter name -> the number of its elements `rank` holds."""
    specs = plan.param_specs(rank)
    counts = {}
    for name, record in plan.parameters.items():
        full = _numel(record.shape)
        spec = specs.get(name)
        counts[name] = full if spec is None else full // spec.full_size * spec.local_size()
    for layer in plan.layers:
        # A bias laid out by its own axes is split with the weight where it spans the split letter.
        if layer.bias in counts and layer.construct.bias_split_by_letter(layer):
            split = layer.weight_shape[layer.weight_dim()]
            counts[layer.bias] = counts[layer.bias] // split * split_sizes(split, plan.world_size)[rank]
    return counts


@dataclass
class Replicated:
    reason: str  # a key of REASONS
    module: str
    module_class: str
    params: int  # elements held whole on every rank
    note: str = ""


def replicated(plan) -> List[Replicated]:
    """What every rank holds whole, module by module, with the reason."""
    counts = local_counts(plan, 0)
    reasons: Dict[str, Tuple[str, str]] = {}
    for layer in plan.layers:
        if not layer.style.is_split:
            code = layer.reason or layer.construct.whole_reason
            for name in (layer.weight, layer.bias):
                if name is not None:
                    reasons.setdefault(name, (code, layer.note))
        elif layer.bias is not None and (layer.bias_spec(0, plan.world_size) is None if layer.construct.bias_has_spec
                                         else not layer.construct.bias_split_by_letter(layer)):
            reasons.setdefault(layer.bias, ("row_bias", ""))
    for record in plan.adapters:
        # A replicated LoRA layer's factors stay whole for the layer's reason.
        code, note = reasons.get(plan.layer(record.module).weight, ("adapter_factor", ""))
        for name in record.whole:
            reasons.setdefault(name, (code, note))
    split = set(plan.param_specs(0)) | {l.bias for l in plan.layers if l.construct.bias_split_by_letter(l)}
    found: Dict[Tuple[str, str], Replicated] = {}
    for name, record in plan.parameters.items():
        if name in split:
            continue
        code, note = reasons.get(name, (record.whole_reason or "not_a_layer", ""))
        key = (code, record.module)
        if key not in found:
            found[key] = Replicated(code, record.module, record.module_class, 0, note)
        found[key].params += counts[name]
    return sorted(found.values(), key=lambda r: -r.params)


def summary_lines(plan) -> List[str]:
    """The printout's part on what each rank holds and what stays whole."""
    if not plan.parameters:
        return ["parameters held per rank: not recorded in this plan (made before autoshard counted them)"]
    world = plan.world_size
    ranks = list(range(world)) if world <= 8 else [0, world - 1]
    per_rank = [local_counts(plan, r) for r in ranks]
    total = sum(_numel(r.shape) for r in plan.parameters.values())
    classes: Dict[str, List[str]] = {}
    for name, record in plan.parameters.items():
        classes.setdefault(record.module_class, []).append(name)
    rows = [("all", total, [sum(c.values()) / total if total else 1.0 for c in per_rank])]
    for cls, names in sorted(classes.items(), key=lambda kv: -sum(_numel(plan.parameters[n].shape) for n in kv[1])):
        full = sum(_numel(plan.parameters[n].shape) for n in names)
        rows.append((cls, full, [sum(c[n] for n in names) / full if full else 1.0 for c in per_rank]))
    width = max(len(r[0]) for r in rows)
    lines = ["parameters held per rank (fraction of each class's parameters; tied parameters counted once):"]
    lines.append(f"  {'module class'.ljust(width)}  {'params':>10}" + "".join(f"{f'rank {r}':>9}" for r in ranks))
    for cls, full, fractions in rows:
        lines.append(f"  {cls.ljust(width)}  {full:>10,}" + "".join(f"{f:>9.2f}" for f in fractions))
    whole = replicated(plan)
    if whole:
        lines.append("held whole on every rank, by reason:")
        by_reason: Dict[str, List[Replicated]] = {}
        for item in whole:
            by_reason.setdefault(item.reason, []).append(item)
        for code, items in sorted(by_reason.items(), key=lambda kv: -sum(i.params for i in kv[1])):
            params = sum(i.params for i in items)
            # Identical blocks once: model.layers.0-31.input_layernorm (LlamaRMSNorm, 4,096 each).
            folded = fold([(i.module or "<model>", (i.module_class, i.params)) for i in items])
            shown = ", ".join(f"{name} ({cls}, {size:,}{' each' if count > 1 else ''})"
                              for name, count, (cls, size) in folded[:4])
            more = f", ... {len(folded) - 4} more" if len(folded) > 4 else ""
            lines.append(f"  {REASONS.get(code, code)}: {params:,} params ({params / total:.1%}): {shown}{more}")
    return lines


def largest_reasons(plan, shown: int = 2) -> List[str]:
    """The reasons that keep the most parameters whole, largest first, each with its share of the
    model (the printout's summary)."""
    total = sum(_numel(r.shape) for r in plan.parameters.values())
    by_reason: Dict[str, int] = {}
    for item in replicated(plan):
        by_reason[item.reason] = by_reason.get(item.reason, 0) + item.params
    ranked = sorted(by_reason.items(), key=lambda kv: -kv[1])
    said = [f"{params / total:.1%} of the parameters: {REASONS.get(code, code)}" for code, params in ranked[:shown]]
    if len(ranked) > shown:
        said.append(f"{len(ranked) - shown} more reasons below")
    return said


def held_fraction(plan) -> float:
    """The largest fraction of the model's parameters any rank holds (1.0 when not recorded)."""
    total = sum(_numel(r.shape) for r in plan.parameters.values())
    if not total:
        return 1.0
    return max(sum(local_counts(plan, r).values()) / total for r in range(plan.world_size))


def _held(plan) -> Tuple[List[int], int]:
    """(the elements of the model's parameters each rank holds, their total), ([], 0) without an
    inventory."""
    total = sum(_numel(r.shape) for r in (plan.parameters or {}).values())
    return ([sum(local_counts(plan, r).values()) for r in range(plan.world_size)], total) if total else ([], 0)


def fullest_holding(plan) -> Tuple[int, int]:
    """(the elements of the model's parameters the fullest rank holds, their total); (0, 0)
    without an inventory."""
    held, total = _held(plan)
    return max(held, default=0), total


def nothing_split_error(plan) -> str:
    """The refusal's text when the plan splits nothing over its ranks (every rank would hold the
    whole model), with why and what to pass, else ""."""
    total = sum(_numel(r.shape) for r in (plan.parameters or {}).values())
    if plan.world_size <= 1 or not total or plan.param_specs(0):
        return ""
    whole = replicated(plan)
    parts: Dict[str, List[str]] = {}
    for i in whole[:3]:
        parts.setdefault(i.reason, []).append(f"{i.module or '<model>'} ({i.module_class}, {i.params:,} params)")
    reasons = "; ".join(f"{', '.join(modules)}: {REASONS.get(code, code)}" for code, modules in parts.items())
    if any(i.reason == "not_called" for i in whole):
        fix = ("its traced forward did not call all of its layers: pass example_inputs that reach them (a forward "
               "whose inputs are all optional, such as CLIP's image= and text=, needs each tower's)")
    else:
        fix = ("parallelizing it would only repeat the whole model on every rank: train it without tensor "
               "parallelism (data parallel), or on fewer ranks")
    return (f"parallelize: the plan splits nothing over its {plan.world_size} ranks, every rank would hold all {total:,} "
            f"of the model's parameters; the largest parts held whole: {reasons}. {fix[0].upper()}{fix[1:]}; the "
            "model was left unchanged")


def imbalance_warning(plan) -> str:
    """A warning's text when some rank holds more of the parameters than the policy allows over
    its share (csrc/plan/policy.h), else ""."""
    held, total = _held(plan)
    if not held:
        return ""
    worst = max(range(plan.world_size), key=lambda r: held[r])
    if not policy.ask({"ask": "imbalance", "world_size": plan.world_size, "parameters": total,
                       "fullest": held[worst]})["imbalanced"]:
        return ""
    largest = "; ".join(f"{i.module or '<model>'} ({i.module_class}, {i.params:,} params): {REASONS.get(i.reason, i.reason)}"
                        + (f" ({i.note})" if i.note else "") for i in replicated(plan)[:3])
    return (f"plan: rank {worst} of {plan.world_size} would hold {held[worst] / total:.0%} of the model's parameters "
            f"(an even split is {1 / plan.world_size:.0%}); the largest parts held whole on every rank: {largest}. "
            "print(plan) lists them all by reason")
