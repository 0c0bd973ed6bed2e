"""How a layer is split: the style the planner decides for it (csrc/plan/settle.cpp and its
passes in csrc/plan/passes/).

A `Style` is a string too ("column" == Style.COLUMN), so a plan's JSON and the planner's document
carry the plain words, and user overrides name them as text.
"""

from enum import Enum


class _Words(str, Enum):
    """An enum whose members print and format as their plain words."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Style(_Words):
    COLUMN = "column"  # output features split; the input is copied (backward all-reduces its gradient)
    COLUMN_GATHER = "column_gather"  # column, with its output gathered whole (a model output)
    ROW = "row"  # input features split; the partial outputs are all-reduced
    VOCAB = "vocab"  # an embedding split over its rows (the vocabulary)
    # split on a letter its input, weight and output share (a grouped convolution's groups): its
    # input arrives split there and its output leaves split alike, with no collective
    BATCH = "batch"
    REPLICATE = "replicate"  # held whole on every rank

    @property
    def is_column(self) -> bool:
        """Splits its output features (column or column_gather)."""
        return self in (Style.COLUMN, Style.COLUMN_GATHER)

    @property
    def is_split(self) -> bool:
        return self is not Style.REPLICATE


class TokenRole(_Words):
    """What a layer does with the tokens under sequence parallelism (csrc/plan/sequence.cpp)."""

    NONE = ""  # nothing: its input and output hold every token
    REDUCE_SCATTER = "reduce_scatter"  # a row layer: its output's tokens split over the ranks, in place of its all-reduce
    GATHER = "gather"  # a column layer: gathers its input's tokens in place of copying it
    GATHERED = "gathered"  # a column layer reading tokens a module gathered before it (see plan.sequence_gathers)

    @property
    def gathers(self) -> bool:
        """Reads every token through a gather (its own or a module's)."""
        return self in (TokenRole.GATHER, TokenRole.GATHERED)


# The styles a user may force on a layer (plan(..., overrides=)).
OVERRIDE_STYLES = (Style.REPLICATE, Style.COLUMN_GATHER)
