"""ShardingPlan: what the planner decided, per layer and per parameter, and what it costs."""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..core.spec import ShardSpec
from ..core.parallel_state import LOSS_PARALLEL_ALL_REDUCES
from . import holdings, plan_json, printout
from .layer_plan import LayerPlan, RegionPlan
from .prediction import Prediction
from ..core.sealed import NOT_IN_DOCUMENT, Sealed
from .records import PLAN_FIELDS, Collective, ParameterRecord, PartialGradientBucket
from ..constructs import record_constructs
from ..constructs.attention import ReturnedAttentionWeights
from ..constructs.gathered_parameter import GatheredParameter
from ..constructs.head_cut import HeadCut
from ..constructs.head_parameter import HeadParameter
from ..constructs.linear import AdapterFactors
from ..constructs.sequence import TokenCut
from ..constructs.split_norm import SplitNorm
from ..constructs.summed_output import SummedOutput
from .memory_prediction import predict


@dataclass
class ShardingPlan(Sealed):
    world_size: int
    layers: List[LayerPlan]
    regions: Dict[int, RegionPlan]
    comm: List[Collective]  # per step at the example shapes
    example: Dict[str, object] = field(default_factory=dict)  # what the comm figures were measured on
    overrides: Dict[str, str] = field(default_factory=dict)
    # Replicated parameters read inside a sharded region get a partial gradient on each rank,
    # summed over the group in backward: one all-reduce per bucket.
    partial_gradients: List[PartialGradientBucket] = field(default_factory=list)
    # Every parameter of the model, tied ones once, by name (see holdings): what each rank holds
    # is counted from these and the shard specs.
    parameters: Dict[str, ParameterRecord] = field(default_factory=dict)
    # The constructs' records, each documented with its construct (autoshard/constructs/).
    # Sequence parallelism: tensors held whole cut to this rank's tokens where a module receives
    # them, and tokens gathered where a module receives or returns them, for column layers that
    # read every token (constructs/sequence.py).
    sequence_entries: List[TokenCut] = field(default_factory=list)
    sequence_gathers: List[TokenCut] = field(default_factory=list)
    sequence_exits: List[TokenCut] = field(default_factory=list)
    # Tensors cut to this rank's heads where a module receives them (an ALiBi bias), or as a
    # replicated embedding's output leaves it (T5's relative position bias; constructs/head_cut.py).
    head_entries: List[HeadCut] = field(default_factory=list)
    head_outputs: List[HeadCut] = field(default_factory=list)
    # The attention weights each nn.MultiheadAttention split by heads returns with need_weights.
    attention_weights: List[ReturnedAttentionWeights] = field(default_factory=list)
    # Norms split with their layer's features (OLMo 2's q_norm), parameters split with their
    # heads, large parameters stored split and gathered whole for each call of their module.
    norms: List[SplitNorm] = field(default_factory=list)
    head_parameters: List[HeadParameter] = field(default_factory=list)
    gathered_parameters: List[GatheredParameter] = field(default_factory=list)
    # LoRA layers' factors; replicated layers whose output's gradient is summed where they return it.
    adapters: List[AdapterFactors] = field(default_factory=list)
    summed_outputs: List[SummedOutput] = field(default_factory=list)
    # Why sequence parallelism is on or off, where sequence_parallel="auto" chose (sequence_choice.py).
    sequence_choice: str = ""
    # What the plan was made from, for parallelize's dry run and the memory prediction: every
    # traced tensor's local shape as the plan predicts it (prediction.py; written to the JSON
    # document under "prediction"), and the example inputs it was traced with (replayed).
    prediction: Optional[Prediction] = field(default=None, repr=False, compare=False, metadata=NOT_IN_DOCUMENT)
    input_values: Optional[tuple] = field(default=None, repr=False, compare=False, metadata=NOT_IN_DOCUMENT)

    def _seal(self) -> None:
        """Seals the plan and every part of it (planner/sealed.py), their lists and mappings too."""
        for part in (*self.layers, *self.regions.values(), *self.parameters.values(),
                     *(record for f in PLAN_FIELDS for record in getattr(self, f))):
            part._seal()
        super()._seal()

    # ---- queries

    def layer(self, module: str) -> LayerPlan:
        for layer in self.layers:
            if layer.module == module:
                return layer
        raise KeyError(f"ShardingPlan: no layer named {module!r}")

    def param_specs(self, rank: int) -> Dict[str, ShardSpec]:
        """Every sharded parameter's ShardSpec on `rank`, by parameter name."""
        specs = {}
        for layer in self.layers:
            for name, spec in ((layer.weight, layer.weight_spec(rank, self.world_size)),
                               (layer.bias, layer.bias_spec(rank, self.world_size))):
                if name is not None and spec is not None:
                    specs[name] = spec
        for construct in record_constructs():
            specs.update(construct.specs(self, rank))
        for record in self.adapters:
            # A split LoRA factor shares its base weight's split axis (B's rows, A's columns).
            if record.split:
                spec = self.layer(record.module).weight_spec(rank, self.world_size)
                specs.update({name: spec for name in record.split})
        return specs

    def collectives(self, phase: str, loss_parallel: bool = False, training: bool = True) -> Dict[str, int]:
        """Collectives per step in `phase` ("forward" or "backward"). With `loss_parallel`, those of
        a call with labels whose loss parallelize computes over vocabulary shards (see
        ParallelState.collectives): the head's gather of its logits gives way to the loss's three
        all-reduces of a few values per token (its backward needs none). With `training=False`,
        those of a forward in eval mode, where a split BatchNorm reads its running statistics
        instead of all-gathering their update."""
        counts = {c.kind: c.count for c in self.comm if c.phase == phase}
        if not training and phase == "forward":
            updates = sum(1 for norm in self.norms if norm.per_channel and norm.running_stats)
            if updates:
                counts["all_gather"] -= updates
                if not counts["all_gather"]:
                    del counts["all_gather"]
        if loss_parallel and phase == "forward":
            if not counts.get("all_gather"):
                raise ValueError("ShardingPlan.collectives: loss_parallel=True, but this plan gathers no logits in "
                                 "forward (no output head is column-parallel): loss parallelism does not apply")
            counts["all_gather"] -= 1
            if not counts["all_gather"]:
                del counts["all_gather"]
            counts["all_reduce"] = counts.get("all_reduce", 0) + LOSS_PARALLEL_ALL_REDUCES
        return counts

    def returned_weights(self, attention: str) -> str:
        """What the nn.MultiheadAttention named `attention`, split by heads, returns as its
        weights with need_weights: "none" where the plan found them never read, else
        "all_reduce" (averaged over every head, exact; see nn.multihead_attention.ReturnedAttentionWeights)."""
        for returned in self.attention_weights:
            if returned.module == attention:
                return "all_reduce" if returned.used else "none"
        return "all_reduce"

    def parameter_bytes(self, rank: int, element_size: int = 4) -> Dict[str, int]:
        """Bytes of the planned layers' parameters: all of them, and the part `rank` holds."""
        full = local = 0
        seen = set()
        for layer in self.layers:
            if layer.weight in seen:
                continue
            seen.add(layer.weight)
            count = math.prod(layer.weight_shape)
            spec = layer.weight_spec(rank, self.world_size)
            full += count
            local += count if spec is None else count // spec.full_size * spec.local_size()
            if layer.bias is not None and layer.construct.bias_has_spec:
                bias = layer.construct.bias_size(layer)
                bias_spec = layer.bias_spec(rank, self.world_size)
                full += bias
                local += bias if bias_spec is None else bias_spec.local_size()
        return {"full": full * element_size, "local": local * element_size}

    def held_parameters(self, rank: int) -> Dict[str, int]:
        """Parameter name -> how many of its elements `rank` holds (tied parameters once)."""
        self._check_rank(rank)
        return holdings.local_counts(self, rank)

    def held_fraction(self, rank: int, module_class: Optional[str] = None) -> float:
        """The fraction of the model's parameters (or of one module class's, e.g. "LlamaAttention")
        that `rank` holds: 1/world_size for a model split evenly, 1.0 for one kept whole."""
        held = self.held_parameters(rank)
        names = [n for n, r in self.parameters.items() if module_class is None or r.module_class == module_class]
        if not names:
            raise ValueError(f"ShardingPlan.held_fraction: no parameters of module class {module_class!r} "
                             f"(classes: {sorted({r.module_class for r in self.parameters.values()})})")
        full = sum(holdings._numel(self.parameters[n].shape) for n in names)
        return sum(held[n] for n in names) / full if full else 1.0

    def replicated(self) -> List["holdings.Replicated"]:
        """What every rank holds whole, module by module, largest first, each with its reason
        (a key of autoshard.planner.holdings.REASONS)."""
        return holdings.replicated(self)

    def memory(self, example_inputs=None, *, batch=None, seq=None, optimizer="adamw", master_weights=None,
               dtype=None, model=None, loss_parallel=True):
        """Predicted bytes per rank of one training step under this plan: parameters, gradients,
        optimizer state ("adamw", "sgd" with momentum, or None; fp32 master weights as
        autoshard.optim keeps them), activations saved for backward, and the peak. `batch` and
        `seq` rescale the plan's example inputs (a Hugging Face model's batch and token dims);
        `dtype` casts the parameters first; `model` is the model the plan was made for, needed
        only for a plan read from JSON. Returns a memory_prediction.MemoryPrediction (see that
        module for what is counted and the model of the peak)."""
        return predict(self, example_inputs, batch=batch, seq=seq, optimizer=optimizer, master_weights=master_weights,
                       dtype=dtype, model=model, loss_parallel=loss_parallel)

    def _check_rank(self, rank: int) -> None:
        if not self.parameters:
            raise ValueError("ShardingPlan: this plan records no parameters (it was made before autoshard counted "
                             "them); make it again with autoshard.plan")
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"ShardingPlan: rank must be an int in [0, {self.world_size}), got {rank!r}")

    def __str__(self) -> str:
        return printout.text(self)

    def sequence_regions(self) -> Dict[int, Dict[str, List[str]]]:
        """Each sequence region's modules by role: {"reduce_scatter": [...], "gather": [...], "entry": [...]}."""
        return printout.sequence_regions(self)

    def to_json(self) -> str:
        """The plan as a versioned JSON document, with the shape prediction and example inputs
        parallelize's dry run uses (see plan_json)."""
        return plan_json.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        """The plan a to_json document holds; from_json(plan.to_json()).to_json() == plan.to_json()."""
        return plan_json.loads(cls, text)
