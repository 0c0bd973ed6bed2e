"""Which model tensor each checkpoint tensor fills.

A checkpoint written by ``save_pretrained`` of a model with a head (GPT2LMHeadModel) names its
tensors ``transformer.h.0...``, one of the bare model (GPT2Model) ``h.0...``; older ones may
hold legacy names (BERT's ``LayerNorm.gamma``). For a transformers model these are resolved
by transformers' own renaming rules for that model (the ones its ``from_pretrained`` applies:
the ``base_model_prefix`` added or stripped, legacy renamings, per-model renamings). A rule
that does more than rename cannot be loaded slice by slice, and such tensors are reported,
with one exception: per-expert tensors stacked into a mixture-of-experts module's 3-D weights
(transformers' MergeModulelist on dim 0, then optionally Concatenate), each of which fills a
block of the 3-D tensor that a rank can read its part of (see ``stacked_experts``). Any other
module is matched by name exactly.
"""

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from ..conventions import huggingface as hf


def match_names(model, checkpoint_keys: Iterable[str], model_names: Iterable[str]
                ) -> Tuple[Dict[str, str], List[str]]:
    """(checkpoint key -> model name for every key whose name the model has; keys that only a
    conversion beyond renaming would load). Keys are visited in sorted order, as transformers
    does: some of its renaming rules decide on the first key they see."""
    model_names = set(model_names)
    checkpoint_keys = sorted(checkpoint_keys)
    # Building transformers' rules takes a while (hundreds of regular expressions): only when
    # some name differs. None: not a transformers model.
    exact = all(key in model_names for key in checkpoint_keys)
    rules = None if exact else hf.conversion_rules(model, model_names)
    matched: Dict[str, str] = {}
    converted: List[str] = []
    for key in checkpoint_keys:
        name, pattern = (key, None) if key in model_names or rules is None else rules.rename(key)
        if pattern is not None:  # a conversion beyond renaming
            converted.append(key)
        elif name in model_names:
            matched[key] = name
    return matched, converted


@dataclass(frozen=True)
class StackedExpert:
    """A checkpoint tensor that is one expert's block of a model's 3-D experts weight: expert
    `expert` (index on dim 0), source `part` of `parts` concatenated on `concat_dim` of the 3-D
    weight (None: a single source)."""
    name: str
    expert: int
    part: int
    parts: int
    concat_dim: Optional[int]


def stacked_experts(model, keys: Iterable[str], model_names: Iterable[str]) -> Dict[str, StackedExpert]:
    """key -> StackedExpert for the checkpoint keys (among those that need a conversion) that
    transformers' rules stack per expert into a model weight."""
    keys = sorted(keys)
    rules = hf.conversion_rules(model, model_names) if keys else None
    if rules is None:
        return {}
    found = {}
    for key in keys:
        name, pattern = rules.rename(key)
        converter = next((c for c in rules.converters if pattern in c.source_patterns), None)
        if converter is None or name not in rules.known:
            continue
        operations = list(converter.operations)
        if not operations or not hf.is_merge_on_first_dim(operations[0]):
            continue
        if len(operations) > 2 or (len(operations) == 2 and not hf.is_concatenate(operations[1])):
            continue
        concat_dim = operations[1].dim if len(operations) == 2 else None
        if concat_dim is None and len(converter.source_patterns) != 1:
            continue
        match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if match is None or len(match.groups()) != 1:
            continue
        found[key] = StackedExpert(name, int(match.group(1)), converter.source_patterns.index(pattern),
                                   len(converter.source_patterns), concat_dim)
    return found
