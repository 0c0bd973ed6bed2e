"""print(plan): a ShardingPlan as text, short for any model (identical blocks fold into one line)."""

from typing import Dict, List

from . import holdings
from .name_ranges import blocks, fold, fold_names


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
    if plan.head_entries:
        lines.append(f"  bias over the heads cut to each rank's heads on entering "
                     f"{_listed([e.module for e in plan.head_entries])}")
    if plan.head_outputs:
        lines.append(f"  output cut to each rank's heads as it leaves "
                     f"{_listed([e.module for e in plan.head_outputs])} (its gradient gathered back)")
    for module, _, used in fold([(returned.module, returned.used) for returned in plan.attention_weights]):
        lines.append(f"  {module}: attention weights averaged over every head (one all-reduce of each "
                     "rank's sum in forward)" if used else
                     f"  {module}: attention weights not returned (None): the model never reads them")
    feature_norms = [n.module for n in plan.norms if not n.per_channel]
    if feature_norms:
        lines.append(f"  norms split with their layer's features (one all-reduce in forward and one in backward "
                     f"each, two for a LayerNorm): {_listed(feature_norms)}")
    channel_norms = [n.module for n in plan.norms if n.per_channel]
    if channel_norms:
        lines.append(f"  BatchNorms split with their channels (no collective; a training forward all-gathers "
                     f"each one's running statistics): {_listed(channel_norms)}")
    if plan.head_parameters:
        lines.append(f"  parameters split with their heads: {_listed([r.name for r in plan.head_parameters])}")
    if plan.gathered_parameters:
        lines.append("  parameters stored split and gathered whole for each call of their module (one all-gather "
                     f"each in forward): {_listed([r.name for r in plan.gathered_parameters])}")
    if plan.sequence_choice:
        lines.append(f"  {plan.sequence_choice}")
    lines += _sequence_lines(plan)
    for bucket in plan.partial_gradients:
        lines.append(f"  partial gradients summed over the ranks in backward (one all-reduce, "
                     f"{bucket.bytes / 2**20:.3f} MiB): {', '.join(fold_names(bucket.params))}")
    if plan.summed_outputs:
        deferred = [layer.module for layer in plan.layers if layer.deferred_copy]
        lines.append(f"  output gradients summed where their layer returns them (one all-reduce each in "
                     f"backward): {', '.join(fold_names([r.module for r in plan.summed_outputs]))}; the column layers "
                     f"reading them sum nothing themselves: {', '.join(fold_names(deferred))}")
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

def sequence_regions(plan) -> Dict[int, Dict[str, List[str]]]:
    """Each sequence region's modules by role: {"reduce_scatter": [...], "gather": [...], "entry": [...]}."""
    regions: Dict[int, Dict[str, List[str]]] = {}
    empty = lambda: {"reduce_scatter": [], "gather": [], "gathered": [], "entry": []}
    for layer in plan.layers:
        if layer.sequence:
            regions.setdefault(layer.sequence_region, empty())[layer.sequence].append(layer.module)
    for entry in plan.sequence_entries:
        regions.setdefault(entry.region, empty())["entry"].append(entry.module)
    for entry in plan.sequence_gathers:
        regions.setdefault(entry.region, empty())["gather"].append(entry.module)
    for entry in plan.sequence_exits:
        regions.setdefault(entry.region, empty())["gather"].append(f"the output of {entry.module}")
    for roles in regions.values():
        roles.pop("gathered", None)
    return regions

def _sequence_lines(plan) -> List[str]:
    lines = []
    for region, roles in sorted(sequence_regions(plan).items()):
        cut = f"; cut on entering {_listed(roles['entry'])}" if roles["entry"] else ""
        lines.append(f"  sequence parallel (tokens split over the ranks): after {_listed(roles['reduce_scatter'])}"
                     f"{cut}; gathered before {_listed(roles['gather'])}")
    # A note that names its own layer's modules folds with the layer: the name becomes a mark.
    mark = "\0"
    folded = fold([(layer.module, layer.sequence_note.replace(layer.module, mark))
                   for layer in plan.layers if layer.sequence_note])
    refused: Dict[str, List[str]] = {}
    for module, _, note in folded:
        if mark in note:
            lines.append(f"  tokens held whole after {module}: {note.replace(mark, module)}")
        else:
            refused.setdefault(note, []).append(module)
    for note, modules in refused.items():
        lines.append(f"  tokens held whole after {_listed(modules)}: {note}")
    return lines
