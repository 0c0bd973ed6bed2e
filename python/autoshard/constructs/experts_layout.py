"""Where a mixture-of-experts module keeps its experts' weights as 3-D parameters."""

from typing import NamedTuple, Optional

from torch import nn


class ExpertsWeights(NamedTuple):
    """Where an experts module keeps its weights (see experts_weights)."""
    first: str  # the in weight's name
    second: str  # the out weight's name
    parts: int  # 2: gated (gate and up in the in weight), 1: plain
    transposed: bool
    # Gate and up interleaved on the FFN axis (gate 0, up 0, gate 1, ...: gpt-oss, transformers'
    # is_concatenated=False) rather than one after the other.
    interleaved: bool = False
    in_bias: Optional[str] = None  # [E, parts * F], added to each expert's in product
    out_bias: Optional[str] = None  # [E, H], added to each expert's output


def experts_weights(module: nn.Module) -> Optional[ExpertsWeights]:
    """Where a module holding mixture-of-experts weights as 3-D parameters keeps them, or None:
    exactly two 3-D parameters, [E, parts * F, H] then [E, H, F] (each expert a gated or plain
    MLP whose input and output have H features), gated ones holding the gate and up projections
    one after the other on the FFN axis (parts = 2), or interleaved where the module says so
    (transformers' `is_concatenated=False`); or, stored transposed for `x @ w` (transformers'
    `is_transposed`, Llama 4's, Aria's and gpt-oss's experts), [E, H, parts * F] then [E, F, H].
    Without the flag the first layout is read where it fits. A module flagged `has_bias` (gpt-oss)
    also holds one bias per side, [E, parts * F] and [E, H], after its weight."""
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    weights = [(name, p) for name, p in params if p.dim() == 3]
    biases = [(name, p) for name, p in params if p.dim() == 2]
    with_bias = bool(getattr(module, "has_bias", False))
    if len(weights) != 2 or len(biases) != (2 if with_bias else 0) or len(params) != len(weights) + len(biases):
        return None
    interleaved = not getattr(module, "is_concatenated", True)
    (first, a), (second, b) = weights
    flagged = getattr(module, "is_transposed", None)
    for transposed in ((False, True) if flagged is None else (bool(flagged),)):
        if transposed:
            experts, hidden, features_in = a.shape
            ffn, out_hidden = b.shape[1], b.shape[2]
        else:
            experts, features_in, hidden = a.shape
            out_hidden, ffn = b.shape[1], b.shape[2]
        if b.shape[0] != experts or out_hidden != hidden or ffn == 0:
            continue
        parts = features_in // ffn if features_in % ffn == 0 else 0
        has_gate = getattr(module, "has_gate", parts == 2)
        if parts != (2 if has_gate else 1) or (interleaved and parts != 2):
            continue
        if not with_bias:
            return ExpertsWeights(first, second, parts, transposed, interleaved)
        (in_bias, c), (out_bias, d) = biases
        if tuple(c.shape) == (experts, features_in) and tuple(d.shape) == (experts, hidden):
            return ExpertsWeights(first, second, parts, transposed, interleaved, in_bias, out_bias)
    return None
