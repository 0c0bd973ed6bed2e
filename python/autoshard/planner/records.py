"""The typed records a ShardingPlan holds beside its layers and regions: what the planner
decided for constructs that are no layer of their own, its collectives, and the model's
parameters. Each is a plain dataclass, written to JSON by asdict and read back by from_dict."""

from dataclasses import dataclass, field, fields
from typing import List, Optional

from .sealed import Sealed


@dataclass
class Collective(Sealed):
    """One kind of collective in one phase of a step, at the example inputs' shapes."""

    phase: str  # "forward" or "backward"
    kind: str  # "all_reduce", "all_gather", "reduce_scatter"
    count: int
    bytes: int


@dataclass
class PartialGradientBucket(Sealed):
    """Replicated parameters read inside a sharded region: their gradients, partial on each rank,
    summed over the group in backward by one all-reduce per bucket."""

    params: List[str]
    bytes: int


@dataclass
class TokenCut(Sealed):
    """Sequence parallelism where a module receives (or returns) a tensor: the tensor at `leaf`
    among the call's flattened inputs, its tokens on axis `dim`, cut to this rank's tokens or
    gathered (see nn/sequence.py)."""

    module: str
    leaf: int
    dim: int
    region: int


@dataclass
class HeadCut(Sealed):
    """A tensor held whole cut to this rank's heads: where a module receives it (its input at
    `leaf`: an ALiBi bias passed to each attention) or as an embedding's output leaves it (T5's
    relative position bias); the heads are the outer factor of axis `axis` ({outer, size})."""

    module: str
    axis: int
    outer: int
    size: int
    region: int
    leaf: int = 0


@dataclass
class ReturnedAttentionWeights(Sealed):
    """The attention weights an nn.MultiheadAttention split by heads returns with need_weights:
    averaged over every head by one all-reduce where the model reads them (`used`), else None."""

    module: str
    used: bool


@dataclass
class SplitNorm(Sealed):
    """An RMS norm over a layer's output features split by heads (OLMo 2's q_norm), a LayerNorm
    (`centered`: ESM-C's q_norm), or a BatchNorm over a convolution's output channels
    (`per_channel`; `running_stats` where it updates them): its weight `weight` (and bias
    `bias`; either None where it has none) of `features` global elements, split in the region's
    `units`."""

    module: str
    weight: Optional[str]
    features: int
    units: int
    region: int
    bias: Optional[str] = None
    centered: bool = False
    per_channel: bool = False
    running_stats: bool = False


@dataclass
class HeadParameter(Sealed):
    """A parameter over the heads split with them: dim `dim` of global length `size`. With
    `layer` (a fused layer's module name), split part by part as that layer's output features
    are: a depthwise convolution's taps over fused q/k/v channels."""

    name: str
    dim: int
    size: int
    region: int
    layer: str = ""
    # Or the parts of a concatenation of split layer outputs (q, k and v of separate projections
    # joined for one convolution), each split like the region.
    parts: List[int] = field(default_factory=list)


@dataclass
class GatheredParameter(Sealed):
    """A large parameter outside the layers, stored split on dim `dim` (of global length `size`)
    and all-gathered whole where each call of the module holding it begins
    (nn/gathered_parameters.py): one all-gather of `elements` elements per call, none in backward.
    `module`: where the module holding it is never called and its parent's forward reads it
    itself (a position table interpolated), the module whose call gathers it; "" for its own."""

    name: str
    dim: int
    size: int
    elements: int
    module: str = ""


@dataclass
class AdapterFactors(Sealed):
    """A LoRA layer's factor weights: those split with the base layer, and those held whole."""

    module: str
    split: List[str] = field(default_factory=list)
    whole: List[str] = field(default_factory=list)


@dataclass
class ParameterRecord(Sealed):
    """One parameter of the model (tied ones once): its shape, the module counted as holding it,
    that module's class, and why it stays whole where no layer says (see planner/parameter_reasons.py)."""

    shape: List[int]
    module: str
    module_class: str
    whole_reason: str = ""


def from_dict(cls, data: dict):
    """A record of class `cls` from its JSON object (fields it does not know are refused)."""
    if isinstance(data, cls):
        return data
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)} in a plan record")
    return cls(**data)


@dataclass
class SummedOutput(Sealed):
    """A replicated layer whose output's gradient is partial on every rank (MLA's compressed kv
    and k_pe, read by a column layer and by the split heads): all-reduced in backward where the
    layer returns it, while the column layers reading it (LayerPlan.deferred_copy) sum nothing."""

    module: str
    elements: int


# The ShardingPlan fields holding lists of these records, with the record type of each.
PLAN_FIELDS = {"comm": Collective, "partial_gradients": PartialGradientBucket, "sequence_entries": TokenCut,
               "sequence_gathers": TokenCut, "sequence_exits": TokenCut, "head_entries": HeadCut,
               "head_outputs": HeadCut, "attention_weights": ReturnedAttentionWeights, "norms": SplitNorm,
               "head_parameters": HeadParameter, "gathered_parameters": GatheredParameter,
               "adapters": AdapterFactors, "summed_outputs": SummedOutput}
