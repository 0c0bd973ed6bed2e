"""The typed records a ShardingPlan holds beside its layers and regions: its collectives, the
model's parameters, and, declared by the constructs that hold them (each construct's `fields`,
constructs/record_io.py), what the planner decided for constructs that are no layer of their
own. Each is a plain dataclass, written to JSON by asdict and read back by from_dict."""

from dataclasses import dataclass, fields
from typing import List

from ..constructs import constructs, record_constructs
# The constructs' records, also by their names here: code and pickled plans that name them so.
from ..constructs.attention import ReturnedAttentionWeights
from ..constructs.gathered_parameter import GatheredParameter
from ..constructs.head_cut import HeadCut
from ..constructs.head_parameter import HeadParameter
from ..constructs.linear import AdapterFactors
from ..constructs.sequence import TokenCut
from ..constructs.split_norm import SplitNorm
from ..constructs.summed_output import SummedOutput
from ..core.sealed import Sealed

__all__ = ["PLAN_FIELDS", "AdapterFactors", "Collective", "GatheredParameter", "HeadCut", "HeadParameter",
           "ParameterRecord", "PartialGradientBucket", "ReturnedAttentionWeights", "SplitNorm", "SummedOutput",
           "TokenCut", "from_dict", "record_holders"]


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


def record_holders() -> list:
    """Every construct that holds records in a plan (declares `fields`): the record constructs
    and the layer constructs with records of their own."""
    return [construct for construct in (*constructs(), *record_constructs()) if construct.fields]


def _plan_fields() -> dict:
    """The plan's lists of typed records, by field: its own, then each construct's."""
    found = {"comm": Collective, "partial_gradients": PartialGradientBucket}
    for construct in record_holders():
        for name, record in construct.fields.items():
            if name in found:
                raise ValueError(f"plan field {name!r} of construct {construct.kind!r} is declared twice")
            found[name] = record
    return found


# The ShardingPlan fields holding lists of these records, with the record type of each.
PLAN_FIELDS = _plan_fields()
