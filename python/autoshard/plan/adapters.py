"""LoRA adapters in a plan: each adapter's factors split with its base layer (nn/lora.py).

The planner sees a LoRA layer as the Linear it wraps and decides its style; what follows
from that style for the adapter's factors is fixed (the base layer's split carries over to
the factor that shares its split axis), so it is written down here as the plan's `adapters`
records rather than decided:

- column (output features split): B's weight is split like the base weight's rows; A's is
  held whole, and its gradient is partial (it meets only this rank's rows of B);
- row (input features split): A's weight is split like the base weight's columns; B's is
  held whole, and its gradient is partial (it meets only this rank's partial A output);
- replicate: both whole, like the base layer.

The partial gradients of trainable whole factors are summed over the group in backward, in
buckets of their own after the planner's (one all-reduce each, counted in the plan's
collectives), by the same reducer as the planner's partial gradients. Like the planner's, these
counts take every parameter as trained.
"""

from typing import List

from ..styles import Style
from .capture import CapturedGraph
from .records import AdapterFactors, Collective, PartialGradientBucket

# As the planner's partial-gradient buckets (csrc/plan/emit.cpp): at most 100 MiB of fp32.
BUCKET_ELEMENTS = 25 << 20
SPLIT_STYLES = (Style.COLUMN, Style.COLUMN_GATHER, Style.ROW)


def _numel(shape) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def add_adapters(result, graph: CapturedGraph, element_size: int) -> None:
    """Fills result.adapters with every LoRA layer's factors, split or whole, and adds the
    partial gradients of the whole ones (where the layer is split) to its buckets and collectives."""
    names = graph.param_names
    params = dict(graph.shadow.named_parameters(remove_duplicate=False))
    records: List[AdapterFactors] = []
    partial: List[str] = []
    for info in graph.layers.values():
        if not info.adapters:
            continue
        layer = result.layer(info.name)
        split_side = 1 if layer.style.is_column else 0 if layer.style is Style.ROW else None
        record = AdapterFactors(info.name)
        for factors in info.adapters:
            for side, index in enumerate(factors):
                name = names[index]
                if side == split_side:
                    record.split.append(name)
                else:
                    record.whole.append(name)
                    if split_side is not None and params[name].requires_grad:
                        partial.append(name)
            # B split like KV heads held by several ranks, or with parts held whole, sums its
            # gradient over the group as its base layer would (nn/linear.py): one all-reduce.
            b = params[names[factors[1]]]
            if split_side == 1 and b.requires_grad and (layer.repeat or layer.summed_parts) and result.world_size > 1:
                rows = (b.shape[0] if layer.repeat else sum(layer.parts[i] for i in layer.whole_parts))
                _count(result.comm, "backward", "all_reduce", rows * b.shape[1] * element_size)
        records.append(record)
    result.adapters = records
    if result.world_size <= 1 or not partial:
        return
    # In the order backward produces them: the reverse of the forward's.
    buckets: List[PartialGradientBucket] = []
    elements: List[int] = []
    for name in reversed(partial):
        count = _numel(params[name].shape)
        if not buckets or elements[-1] + count > BUCKET_ELEMENTS:
            buckets.append(PartialGradientBucket([], 0))
            elements.append(0)
        buckets[-1].params.append(name)
        elements[-1] += count
    for bucket, count in zip(buckets, elements):
        bucket.bytes = count * element_size
        _count(result.comm, "backward", "all_reduce", bucket.bytes)
    result.partial_gradients = list(result.partial_gradients) + buckets


def _count(comm: List[Collective], phase: str, kind: str, nbytes: int) -> None:
    for c in comm:
        if c.phase == phase and c.kind == kind:
            c.count += 1
            c.bytes += nbytes
            return
    comm.append(Collective(phase, kind, 1, nbytes))
