"""The plan's record of one layer (LayerPlan) and of one region of split units (RegionPlan)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..core.spec import ShardSpec
from ..core.split import split_sizes
from ..core.styles import Style, TokenRole
from ..core.sealed import NOT_IN_DOCUMENT, Sealed
from ..constructs import adopted_kind, construct_of


@dataclass
class LayerPlan(Sealed):
    module: str
    kind: str  # its construct's kind (autoshard.constructs): "linear", "embedding", "einsum", ...
    style: Style
    weight: str  # parameter names
    bias: Optional[str]
    weight_shape: List[int]
    transposed: bool = False  # Conv1D: weight is [in, out]
    units: int = 0  # pieces are whole units (heads) of the sharded dimension
    parts: List[int] = field(default_factory=list)  # fused output layout (QKV in one layer)
    # Parts held whole on every rank (indices into parts: one KV head fused beside the query
    # heads); with summed_parts their gradient is summed over the ranks in backward.
    whole_parts: List[int] = field(default_factory=list)
    summed_parts: bool = False
    region: int = -1
    copy_group: int = -1  # column layers reading the same input copy it once
    # Its input copy sums nothing in backward: a replicated layer upstream sums the gradient
    # where it returns its output (ShardingPlan.summed_outputs).
    deferred_copy: bool = False
    note: str = ""
    equation: str = ""  # einsum layers: the equation and the weight letter split
    letter: str = ""
    # KV projections with fewer KV heads than the ranks need: each of `units` KV heads serves
    # `repeat` query-head units of the region, and ranks hold the KV heads their queries use.
    repeat: int = 0
    # Why the planner chose this style when it is not the obvious one, as a code (see
    # csrc/plan/settle.cpp: "conflict", "too_few_units", "model_output", ...); note says it in words.
    reason: str = ""
    bias_axes: str = ""  # einsum layers: the output letters the bias spans
    # Sequence parallelism (see csrc/plan/sequence.cpp): "reduce_scatter" (this layer's output
    # tokens are split over the ranks in place of its all-reduce), "gather" (this column layer
    # gathers its input's tokens in place of copying it), or "". sequence_dim is that token axis, and
    # sequence_note says why a layer that could split tokens does not.
    sequence: TokenRole = TokenRole.NONE
    sequence_dim: int = -1
    sequence_region: int = -1
    sequence_note: str = ""
    # How many whole units (heads) the layer has where the planner found too few to split.
    whole_units: int = field(default=0, compare=False, metadata=NOT_IN_DOCUMENT)

    def __post_init__(self):
        self.style = Style(self.style)  # from JSON, a plain word
        self.sequence = TokenRole(self.sequence)
        self.kind = adopted_kind(self)

    @property
    def construct(self):
        """The construct (autoshard.constructs) of this layer's kind."""
        return construct_of(self.kind)

    def weight_dim(self) -> Optional[int]:
        """The weight dimension this layer splits, or None."""
        return self.construct.weight_dim(self)

    def weight_spec(self, rank: int, world_size: int) -> Optional[ShardSpec]:
        dim = self.weight_dim()
        if dim is None:
            return None
        return ShardSpec(dim, self.weight_shape[dim], rank, world_size, units=self.units or None,
                         parts=tuple(self.parts) if self.parts else None, repeat=self.repeat or None,
                         whole_parts=tuple(self.whole_parts) if self.whole_parts else None)

    def bias_spec(self, rank: int, world_size: int) -> Optional[ShardSpec]:
        return self.construct.bias_spec(self, rank, world_size)


@dataclass
class RegionPlan(Sealed):
    units: int
    module: str  # the smallest module holding all of the region's layers
    # Integer attributes of that module that hold a global size the sharded model must see
    # locally (GPT-2's split_size, OPT's num_heads), each a whole number of units.
    attributes: Dict[str, int] = field(default_factory=dict)
    # With KV heads replicated where needed: how many of the region's units share one KV head,
    # the KV units, and the sizes seen on the KV side (KV heads and features).
    repeat: int = 0
    coarse_units: int = 0
    coarse_sizes: List[int] = field(default_factory=list)
    # Those of `attributes` that count the query heads per KV head (repeat_kv's n_rep): where
    # that count equals a KV-side size (4 query heads over 2 KV heads), only the model's shapes
    # tell which one an attribute holds, and uneven splits give the two different local values.
    repeat_attributes: List[str] = field(default_factory=list)
    # Sizes the module reads from a whole tensor and reshapes a sharded one with (nanoGPT's
    # `y.view(B, T, C)`): [ordinal of the view or reshape call in one call of the module,
    # position in its sizes, global size], made local while the module runs (nn/view_sizes.py).
    view_sizes: List[List[int]] = field(default_factory=list)
    # Global sizes seen on the region's sharded axis that become local (the planner's
    # RegionSummary.localize): what the attribute choice looks for (local_attributes.py).
    localize: List[int] = field(default_factory=list, compare=False, metadata=NOT_IN_DOCUMENT)

    def local_value(self, value: int, rank: int, world_size: int) -> int:
        local_units = split_sizes(self.units, world_size)[rank]
        if self.repeat:
            if value in self.coarse_sizes:
                return value // self.coarse_units * self._local_kv(rank, world_size)
            if value == self.repeat:
                return self.local_repeat(rank, world_size)
        return value // self.units * local_units

    def _local_kv(self, rank: int, world_size: int) -> int:
        return ShardSpec(0, self.coarse_units, rank, world_size, units=self.coarse_units, repeat=self.repeat).local_size()

    def local_repeat(self, rank: int, world_size: int) -> int:
        """The query heads per KV head on `rank` (repeat_kv's n_rep there)."""
        return split_sizes(self.units, world_size)[rank] // self._local_kv(rank, world_size)

    def local_attribute(self, attr: str, rank: int, world_size: int) -> int:
        """The value the sharded model's `attr` holds on `rank`."""
        if attr in self.repeat_attributes:
            return self.local_repeat(rank, world_size)
        return self.local_value(self.attributes[attr], rank, world_size)
