"""The layer constructs the planner decides about, one class each.

A construct does four jobs, as torch's ParallelStyle is one class per style: it recognises
its layer among a model's modules (the capture records the call as one node of the planner's
graph), gives the layout of its weight for a planned style, builds its local stand-in for the
dry run, and shards the module when parallelize applies the plan. Constructs that are no layer
of their own (split RMS norms, parameters split with their heads, head cuts, sequence
parallelism's token cuts) are RecordConstructs: the same jobs, for the records the planner
emits beside the layers, which each declares (the plan fields they fill), reads from the
planner's answer and prints (record_io.py). Every module of this package is imported here, and
each registers its construct: adding a construct is adding one file (plus, where the planner
needs a new rule, its pass in csrc/plan/, and for new records their ShardingPlan field).
"""

import importlib
import pkgutil

from .base import (
    LayerConstruct,
    LayerSurgery,
    RecordConstruct,
    Surgery,
    adopted_kind,
    construct_of,
    constructs,
    recognise,
    record_constructs,
    register,
    register_records,
)

__all__ = ["LayerConstruct", "LayerSurgery", "RecordConstruct", "Surgery", "adopted_kind", "construct_of", "constructs",
           "recognise", "record_constructs", "register", "register_records"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
