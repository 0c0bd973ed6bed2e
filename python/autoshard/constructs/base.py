"""LayerConstruct: what every construct answers, and the registry that finds one by kind.

The planner (csrc/plan/) decides a style per layer node from the dataflow; a construct only
describes its layer to it and carries out the decision. `kind` names the construct in the
capture's LayerInfo and in the plan's LayerPlan; `planner_kind` is the node kind the planner
reads (csrc/plan/graph.h: "linear", "embedding" or "einsum"). Whatever the rest of autoshard
must know of a layer's kind, it asks its construct: apply_plan hands each planned module's plan
entries to its construct's shard_module(), the capture and the plan's accounts read the
properties below.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..core.spec import ShardSpec
from ..core.styles import TokenRole
from .record_io import PlanRecords


class LayerConstruct(PlanRecords):
    """One kind of layer: recognised in the capture, laid out, stood in for, and sharded."""

    kind: str = ""
    planner_kind: str = "linear"
    # Recognition order: a module is the first construct's that recognises it (lower first).
    order: int = 100
    # Whether the layer maps the features of its input's last axis (a norm on its output may
    # split with them, and a user may force the layer to column_gather).
    last_axis_features: bool = True
    # Whether an override may force the layer to Style.COLUMN_GATHER (its column split's output
    # gathered whole after it).
    column_gather_override: bool = False
    # Whether the layer, as a model's output head gathered because its output is a model output,
    # can leave its logits split over the vocabulary for a loss computed on each rank's slice
    # (runtime/loss_parallel.py).
    splits_logits_for_loss: bool = False
    # The reason code (planner/holdings.py REASONS) a replicated layer is held whole for where
    # the planner gives none.
    whole_reason: str = "unsplit"
    # Whether bias_spec() and bias_size() describe the layer's bias. Where not (an einsum, whose
    # bias spans the output letters of its bias_axes), the bias is split, on the split letter's
    # axis, exactly where bias_split_by_letter() says.
    bias_has_spec: bool = True
    # Whether the capture records the layer's call as the nodes it stands for (an experts
    # module: one gated MLP of its two sides, then the routing's combine), where its forward
    # reads its weights as weight_reads() allows, rather than as one node.
    records_inner_nodes: bool = False

    def recognise(self, name: str, module: nn.Module, param_index: Dict[int, int]):
        """The layer's LayerInfo (capture/layers.py) if `module` is this construct, else None."""
        return None

    def adopts(self, layer) -> bool:
        """Whether a plan entry a document gave another construct's kind is this construct's
        layer (a document written before the construct had a kind of its own)."""
        return False

    def records_weight_products(self, info) -> bool:
        """Whether a product of the layer's weight that the model computes itself, outside the
        layer's call (Mamba's `self.dt_proj.weight @ x`), is recorded as a call of the layer: ATen
        sees the weight transposed, so only a weight stored [out, in] is recognised."""
        return False

    def recorded_at_lookup(self, info) -> bool:
        """Whether the call the capture is entering (`info.input` its first input) is recorded at
        the row lookup its forward makes (ATen's embedding of the weight), its node reading the
        indices looked up: a table given no index tensor (a learned position table given the
        input's shape)."""
        return False

    def weight_reads(self, module: nn.Module, info) -> Optional[Dict[str, object]]:
        """Where records_inner_nodes: what the capture follows through the call of `module`, as
        the fields of the recorder's ExpertReads (`tracked`, `out_weight`, `biases`), with what
        the call's nodes need noted on `info`; None otherwise."""
        return None

    def planner_fields(self, info, inputs: torch.Tensor, output: torch.Tensor) -> Dict[str, object]:
        """The fields of the layer's node in the planner's graph document (csrc/plan/graph.h)."""
        return {"in_features": info.in_features, "out_features": info.out_features,
                "weight_param": info.weight_param, "bias_param": info.bias_param}

    def weight_shape(self, info) -> List[int]:
        """The shape of the layer's weight parameter as it is stored."""
        return list(info.weight_shape)

    def weight_dim(self, layer) -> Optional[int]:
        """The weight dimension a LayerPlan of this construct splits, or None (held whole)."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define weight_dim")

    def bias_spec(self, layer, rank: int, world_size: int) -> Optional[ShardSpec]:
        """The bias's ShardSpec on `rank`: split with the output features of a column layer,
        whole (None) otherwise."""
        if layer.bias is None or not layer.style.is_column:
            return None
        return ShardSpec(0, layer.weight_shape[self.weight_dim(layer)], rank, world_size, units=layer.units or None,
                         parts=tuple(layer.parts) if layer.parts else None, repeat=layer.repeat or None,
                         whole_parts=tuple(layer.whole_parts) if layer.whole_parts else None)

    def stored_layout(self, info, units: int, parts: List[int]) -> Tuple[int, List[int]]:
        """The (units, parts) a split of the planner's `units` and `parts` is made in, as the
        layer `info` stores its weight (the planner reads fused parts one after the other)."""
        return units, parts

    def bias_split_by_letter(self, layer) -> bool:
        """Whether the layer's split cuts its bias too where not bias_has_spec (the bias spans the
        split letter); False where bias_has_spec."""
        return False

    def bias_size(self, layer) -> int:
        """The number of elements of the layer's bias (the output features)."""
        return layer.weight_shape[1 if layer.transposed else 0]

    def module_of(self, model: nn.Module, layer) -> nn.Module:
        """The module a LayerPlan of this construct names in `model` (AttributeError if none)."""
        return model.get_submodule(layer.module)

    def weight_of(self, module: nn.Module, layer):
        """The weight parameter of `module` that `layer` plans, or None."""
        return getattr(module, "weight", None)

    def stand_in(self, layer, module: nn.Module, rank: int, world_size: int) -> Optional[nn.Module]:
        """A meta module computing the shapes the sharded layer computes on `rank`, with no
        collective (the dry run's choice of local attributes traces it); None where there is none."""
        return None

    def shard(self, layer, module: nn.Module, group) -> nn.Module:
        """The sharded module that replaces `module` under the planned `layer`."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define shard")

    def replaces(self, module: nn.Module) -> bool:
        """Whether shard() gives a new module (which has none of the old one's hooks) rather than
        changing `module` in place."""
        return True

    def stand_in_within(self, root: nn.Module, prefix: str, plan, layer, rank: int) -> Set[str]:
        """Where the layer's stand-in is more than its module swapped for stand_in()'s (a module
        changed in place, with other layers of the plan): makes it so in `root`, a meta copy of
        the module named `prefix` without its dot ("" for the model), for the split `layer` there;
        returns the names of the layers it stood in for, which are left alone then."""
        return set()

    def sharded_with(self, layers) -> Set[str]:
        """The other modules that shard_module() shards with the module whose plan entries are
        `layers` (an attention's out_proj), which are then left alone."""
        return set()

    def shard_module(self, layers, surgery: "LayerSurgery") -> None:
        """Shards the module that `layers` (every entry the plan has for it, in plan order) name,
        in `surgery.model`. A layer called more than once appears once per call, each split alike
        (the planner sees to it): sharded once. The sharded module replaces the old one, its
        parameters tied wherever the old ones were (surgery.replaced), with its input copy and its
        cut of the output tokens."""
        layer = same_split(layers)
        if not layer.style.is_split or layer.module in surgery.taken:
            return
        module = surgery.model.get_submodule(layer.module)
        originals = {name: getattr(module, name, None) for name in ("weight", "bias")}
        sharded = self.shard(layer, module, surgery.group)
        for name, original in originals.items():
            if original is None:
                continue
            if id(original) in surgery.replaced:
                setattr(sharded, name, surgery.replaced[id(original)])
            else:
                surgery.replaced[id(original)] = getattr(sharded, name)
        calls = [call for call in layers if call.style.is_column]
        input_copy = surgery.input_copy(calls) if calls else None
        deferred = [call.deferred_copy for call in calls]
        if any(deferred) and not all(deferred):
            raise ValueError(f"parallelize: layer {layer.module!r} is called more than once and the plan sums its input's "
                             "gradient upstream in only some of its calls; every call must copy its input alike")
        if deferred and all(deferred):
            input_copy = surgery.deferred_copy
        if input_copy is not None:
            sharded.input_copy = input_copy
        if layer.sequence is TokenRole.REDUCE_SCATTER:
            sharded.output_tokens = surgery.tokens.reduce_scatter(layer)
        set_submodule(surgery.model, layer.module, sharded)


@dataclass
class LayerSurgery:
    """What sharding a module by its plan entries (LayerConstruct.shard_module) needs beyond
    them."""

    model: nn.Module
    plan: object
    group: object
    tokens: object  # the plan's sequence steps (nn/sequence.PlanSteps)
    # A column layer's input copy from the plan's records of its calls (apply/shard_model.py):
    # its group's shared copy, its gather of the tokens, or None (a copy of its own).
    input_copy: Callable[[list], object]
    # The input copy of a column layer whose input's gradient is summed upstream, where a
    # replicated layer returns it (LayerPlan.deferred_copy, constructs/summed_output.py).
    deferred_copy: Callable
    shared_copies: Dict[int, object]  # copy group -> the copy its column layers share
    # id of a parameter replaced -> its replacement, so that tied parameters stay one.
    replaced: Dict[int, nn.Parameter]
    taken: Set[str]  # modules sharded with another's (LayerConstruct.sharded_with)


def same_split(layers):
    """The first of the plan entries of one module's calls; ValueError where they split it differently."""
    split = lambda l: (l.style, l.units, tuple(l.parts), tuple(l.whole_parts), l.summed_parts, l.repeat, l.letter,
                       l.sequence)
    first = layers[0]
    for again in layers[1:]:
        if split(first) != split(again):
            raise ValueError(f"parallelize: layer {first.module!r} is called more than once and the plan splits its "
                             f"calls differently ({split(first)} and {split(again)}); every call must meet the same split")
    return first


_BY_KIND: Dict[str, LayerConstruct] = {}


def register(cls):
    """Class decorator: makes `cls` the construct of its kind."""
    if not cls.kind or cls.kind in _BY_KIND:
        raise ValueError(f"register: construct kind {cls.kind!r} is empty or taken")
    _BY_KIND[cls.kind] = cls()
    return cls


def construct_of(kind: str) -> LayerConstruct:
    """The construct of a LayerInfo's or LayerPlan's kind."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise ValueError(f"no layer construct of kind {kind!r} (known: {sorted(_BY_KIND)})") from None


def adopted_kind(layer) -> str:
    """The kind of a plan entry: the construct's that adopts it, else the one it names."""
    for construct in constructs():
        if construct.kind != layer.kind and construct.adopts(layer):
            return construct.kind
    return layer.kind


def constructs() -> List[LayerConstruct]:
    """Every construct, in recognition order."""
    return sorted(_BY_KIND.values(), key=lambda c: (c.order, c.kind))


def recognise(name: str, module: nn.Module, param_index: Dict[int, int]):
    """The LayerInfo of the first construct that recognises `module`, or None."""
    for construct in constructs():
        info = construct.recognise(name, module, param_index)
        if info is not None:
            return info
    return None


@dataclass
class Surgery:
    """What applying a plan's records to a model needs beyond the plan: the group, this
    rank, the plan's sequence steps (nn/sequence.PlanSteps, shared with the layers that cut and
    gather tokens) and every place each parameter is registered (id -> [(owner, attr)]), so
    that a parameter tied elsewhere is replaced everywhere at once."""

    group: object
    rank: int
    world_size: int
    tokens: object
    registrations: Dict[int, List[Tuple[nn.Module, str]]]


class RecordConstruct(PlanRecords):
    """A construct that is no layer of its own: records the planner emits beside the layers'
    styles (csrc/plan/emit.cpp), held in the ShardingPlan fields its `fields` declare, which it
    reads from the planner's answer and prints itself (constructs/record_io.py).

    It does the jobs a LayerConstruct does, for its records: it recognises its modules where
    the capture must (a split RMS norm), gives the layout of the parameters it splits, changes
    a meta copy of a region's module to one rank's local shapes for the dry run, and applies
    its records to the model, each checked against the model before anything changes."""

    kind: str = ""
    # Application order (lower first), after every layer is sharded.
    order: int = 100

    def records(self, plan) -> list:
        """This construct's records in `plan`."""
        return [record for field in self.fields for record in getattr(plan, field)]

    def specs(self, plan, rank: int) -> Dict[str, ShardSpec]:
        """The ShardSpec on `rank` of each parameter it splits, by parameter name."""
        return {}

    def replaced(self, plan) -> List[str]:
        """The modules it replaces by new ones (whose hooks would be lost)."""
        return []

    def check(self, model: nn.Module, plan, params: Dict[str, nn.Parameter]) -> None:
        """Raises ValueError naming the record the model does not fit; changes nothing."""

    def stand_in(self, copy: nn.Module, prefix: str, plan, rank: int) -> None:
        """Changes `copy`, a meta copy of the module named `prefix` without its dot, to what
        applying its records inside that module gives on `rank`, with no collective."""

    def cut_inputs(self, plan, module: str, args, kwargs, rank: int):
        """The recorded inputs of `module` as it receives them on `rank` (for the dry run)."""
        return args, kwargs

    def apply(self, model: nn.Module, plan, surgery: Surgery) -> None:
        """Applies every record of it in `plan` to `model`."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define apply")


class ParameterRecords(RecordConstruct):
    """Records each naming one parameter (`name`) split on dim `dim` of global length `size`,
    with the ShardSpec `spec(plan, record, rank)` gives; `how` says in errors how it is split."""

    how: str = ""
    # What print(plan) says of them, before their names.
    said: str = ""

    def printout(self, plan, printing) -> List[str]:
        names = [record.name for record in self.records(plan)]
        return [f"  {self.said}: {printing.listed(names)}"] if names else []

    def spec(self, plan, record, rank: int) -> ShardSpec:
        """The ShardSpec of `record`'s parameter on `rank`."""
        raise NotImplementedError(f"{type(self).__name__} (kind {self.kind!r}) must define spec")

    def specs(self, plan, rank: int) -> Dict[str, ShardSpec]:
        return {record.name: self.spec(plan, record, rank) for record in self.records(plan)}

    def check(self, model: nn.Module, plan, params: Dict[str, nn.Parameter]) -> None:
        for record in self.records(plan):
            param = params.get(record.name)
            if param is None or param.dim() <= record.dim or param.shape[record.dim] != record.size:
                got = None if param is None else list(param.shape)
                raise ValueError(f"parallelize: the plan splits parameter {record.name!r} {self.how} ({record.size} "
                                 f"on dim {record.dim}); the model's has shape {got}")


_RECORDS: Dict[str, RecordConstruct] = {}


def register_records(cls):
    """Class decorator: makes `cls` the construct of its records' kind."""
    if not cls.kind or cls.kind in _RECORDS or cls.kind in _BY_KIND:
        raise ValueError(f"register_records: construct kind {cls.kind!r} is empty or taken")
    _RECORDS[cls.kind] = cls()
    return cls


def record_constructs() -> List[RecordConstruct]:
    """Every record construct, in application order."""
    return sorted(_RECORDS.values(), key=lambda c: (c.order, c.kind))


def named_owner(root: nn.Module, dotted: str) -> Tuple[nn.Module, str]:
    """(module, attribute) for a dotted parameter name under `root`."""
    owner, _, attr = dotted.rpartition(".")
    return (root.get_submodule(owner) if owner else root), attr


def planned_module(model: nn.Module, name: str, what: str) -> nn.Module:
    """The module `name` of `model`; where the model lacks it, ValueError saying what the plan does there."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"parallelize: the plan {what} {name!r}, which the model lacks") from None


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Puts `module` in `root` under the dotted `name`."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
