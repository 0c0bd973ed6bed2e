"""What the memory prediction reads of a plan, each read in one place, so that a change to the
plan's records meets the prediction here alone."""

from typing import Dict, Optional

from torch import nn


def parameter_records(plan) -> Dict[str, object]:
    """Parameter name -> its ParameterRecord for every parameter, tied ones once."""
    return plan.parameters


def held_counts(plan, rank: int) -> Dict[str, int]:
    """Parameter name -> the elements `rank` holds."""
    return plan.held_parameters(rank)


def captured_model(plan) -> Optional[nn.Module]:
    """The meta model the plan was captured from, or None (a plan read from JSON)."""
    graph = getattr(plan.prediction, "graph", None)
    return getattr(graph, "shadow", None)


def recorded_inputs(plan):
    """The example inputs the plan was made with: (args, kwargs) of tensors, or None."""
    return plan.input_values


def input_spec(plan):
    """Shapes and dtypes of the plan's example inputs ({"args": [...], "kwargs": {...}}), or None."""
    return plan.example.get("inputs")
