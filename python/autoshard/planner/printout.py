"""print(plan): a ShardingPlan as text, short for any model (identical blocks fold into one line)."""

from typing import List

from ..constructs.record_io import Printing
from ..constructs.sequence import sequence_regions
from . import holdings
from .name_ranges import blocks, fold, fold_names
from .records import record_holders

# sequence_regions is the sequence construct's, named here too for ShardingPlan.sequence_regions.
__all__ = ["sequence_regions", "text"]

# Where the partial gradients' lines stand among the constructs' (their printout_order).
_PARTIAL_GRADIENTS_ORDER = 70


def _listed(names: List[str], shown: int = 4) -> str:
    names = fold_names(names)
    if len(names) <= shown:
        return ", ".join(names) if names else "-"
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def text(plan) -> str:
    """What print(plan) shows: a summary, the layers (identical blocks once), the plan's other
    records, the collectives per step and what each rank holds."""
    header = ["layer", "style", "units", "shard sizes (per rank)", "note"]
    rows = []
    for layer in plan.layers:
        spec0 = layer.weight_spec(0, plan.world_size)
        if spec0 is None:
            sizes = "-"
        else:
            sizes = "/".join(str(layer.weight_spec(r, plan.world_size).local_size()) for r in range(plan.world_size))
            sizes += f" of {spec0.full_size}" + (f" in parts {tuple(layer.parts)}" if layer.parts else "")
            if layer.repeat:
                sizes += f" (KV heads shared, {layer.repeat} units each)"
            if layer.whole_parts:
                sizes += f" (parts {', '.join(str(i + 1) for i in layer.whole_parts)} whole on every rank)"
        units = str(layer.units) if layer.units else "-"
        rows.append((layer.module, (layer.style, units, sizes, layer.note)))
    # Identical blocks print once, their index as a range (model.layers.0-31.mlp.up_proj).
    rows = [[name, *cells] for name, _, cells in fold(rows)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [f"ShardingPlan for {plan.world_size} ranks"]
    lines += _summary_lines(plan, [r[0] for r in rows])
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    attributes = []
    for region_id, region in sorted(plan.regions.items()):
        if region.attributes:
            local = {k: "/".join(str(region.local_attribute(k, r, plan.world_size)) for r in range(plan.world_size))
                     for k in region.attributes}
            attributes.append((region.module, f"local attributes {local}"))
        if region.view_sizes:
            calls = ", ".join(f"call {ordinal} size {position}: {size} -> "
                              + "/".join(str(region.local_value(size, r, plan.world_size)) for r in range(plan.world_size))
                              for ordinal, position, size in region.view_sizes)
            attributes.append((region.module, f"view and reshape sizes read from whole tensors, made local ({calls})"))
    lines += [f"  {module}: {text}" for module, _, text in fold(attributes)]
    lines += _record_lines(plan)
    shape = plan.example.get("description", "the example inputs")
    lines.append(f"collectives per step on {shape}:")
    for c in sorted(plan.comm, key=lambda c: c.phase != "forward"):
        lines.append(f"  {c.phase:<8} {c.kind:<14} x{c.count:<5} {c.bytes / 2**20:.3f} MiB")
    b = plan.parameter_bytes(0)
    lines.append(f"parameters of planned layers: {b['full'] / 2**20:.2f} MiB unsharded, "
                 f"{b['local'] / 2**20:.2f} MiB on rank 0 (fp32)")
    lines += holdings.summary_lines(plan)
    return "\n".join(lines)

def _summary_lines(plan, folded_layers: List[str]) -> List[str]:
    """The printout's first lines: what a rank holds, what a step communicates, what stays
    whole and why, and which blocks are shown once."""
    lines = []
    if plan.parameters:
        total = sum(holdings._numel(r.shape) for r in plan.parameters.values())
        lines.append(f"  parameters: {total:,}; the fullest rank holds {holdings.held_fraction(plan):.1%} "
                     f"(an even split is {1 / plan.world_size:.1%})")
    for phase in ("forward", "backward"):
        counts = plan.collectives(phase)
        said = ", ".join(f"{kind} x{count}" for kind, count in counts.items()) or "none"
        lines.append(f"  collectives per step, {phase}: {said}")
    whole = holdings.largest_reasons(plan) if plan.parameters else []
    if whole:
        lines.append("  held whole on every rank: " + "; ".join(whole))
    shown_once = blocks(folded_layers)
    if shown_once:
        lines.append(f"  identical blocks shown once: {_listed(shown_once, shown=6)}")
    return lines

def _record_lines(plan) -> List[str]:
    """The lines of each construct's records (its printout), in their printout_order, with the
    plan's partial gradients among them."""
    sections = [(construct.printout_order, construct.printout(plan, _PRINTING)) for construct in record_holders()]
    sections.append((_PARTIAL_GRADIENTS_ORDER, _partial_gradient_lines(plan)))
    return [line for _, section in sorted(sections, key=lambda s: s[0]) for line in section]


def _partial_gradient_lines(plan) -> List[str]:
    return [f"  partial gradients summed over the ranks in backward (one all-reduce, {bucket.bytes / 2**20:.3f} MiB): "
            f"{', '.join(fold_names(bucket.params))}" for bucket in plan.partial_gradients]


_PRINTING = Printing(listed=_listed, fold=fold, fold_names=fold_names)
