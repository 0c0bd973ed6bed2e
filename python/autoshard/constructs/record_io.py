"""How a construct's records enter a plan and its printout. A construct that holds records in a
ShardingPlan beside the layers (a RecordConstruct, or a layer construct with records of its own:
a LoRA layer's factors, a split attention's returned weights) declares the plan fields it holds
and their record types (`fields`), reads its records from the planner's answer (`read`) and
writes its lines of print(plan) (`printout`): the planner's reading, printing and JSON document
ask every construct, so a new kind of record is declared in its construct's module alone."""

from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List


@dataclass
class Reading:
    """What reading the planner's answer (planner/read_answer.py) knows beyond the answer itself."""

    graph: object  # the captured graph the planner was given (capture.CapturedGraph)
    names: List[str]  # parameter names, by the index the planner gives them
    element_size: int  # bytes per element of the model's floating-point parameters
    regions: Dict[int, object]  # region id -> the plan's RegionPlan
    named: Callable[[str], str]  # a planner's note with its parameters named, not numbered


@dataclass
class Printing:
    """The name folding print(plan) shares (planner/name_ranges.py, planner/printout.py)."""

    listed: Callable[..., str]  # names folded and joined, the first few and a count: (names, shown=4)
    fold: Callable  # [(name, payload)] -> [(folded name, count, payload)]
    fold_names: Callable[[List[str]], List[str]]


class PlanRecords:
    """The plan fields a construct holds records in, read and printed by the construct."""

    # ShardingPlan field -> the record dataclass of its items (each construct declares its own).
    fields: ClassVar[Dict[str, type]] = {}
    # Where its lines stand in print(plan), after the layers (lower first; see planner/printout.py).
    printout_order: int = 100

    def read(self, answer: dict, reading: Reading) -> Dict[str, list]:
        """Its records in the planner's JSON answer (csrc/plan/emit_json.cpp), by plan field."""
        return {}

    def printout(self, plan, printing: Printing) -> List[str]:
        """Its lines of print(plan), each indented by two spaces; none where it holds no record."""
        return []
