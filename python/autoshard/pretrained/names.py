"""Which model tensor each checkpoint tensor fills.

A checkpoint written by ``save_pretrained`` of a model with a head (GPT2LMHeadModel) names its
tensors ``transformer.h.0...``, one of the bare model (GPT2Model) ``h.0...``; older ones may
hold legacy names (BERT's ``LayerNorm.gamma``). For a transformers model these are resolved
by transformers' own renaming rules for that model (the ones its ``from_pretrained`` applies:
the ``base_model_prefix`` added or stripped, legacy renamings, per-model renamings). A rule
that does more than rename (splitting or fusing tensors) cannot be loaded slice by slice;
such tensors are reported. Any other module is matched by name exactly.
"""

import sys
from typing import Callable, Dict, Iterable, List, Optional, Tuple


def _transformers_renamer(model, model_names: Iterable[str]) -> Optional[Callable[[str], Tuple[str, bool]]]:
    """key -> (model name, whether the key needs a conversion beyond renaming), or None when
    ``model`` is not a transformers model."""
    if "transformers" not in sys.modules:
        return None  # then the model cannot be a transformers model; importing it costs seconds
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    # rename_source_key only asks whether a name is in the model (a non-None value).
    known = {name: True for name in model_names}

    def rename(key: str) -> Tuple[str, bool]:
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, known)
        return name, converter is not None

    return rename


def match_names(model, checkpoint_keys: Iterable[str], model_names: Iterable[str]
                ) -> Tuple[Dict[str, str], List[str]]:
    """(checkpoint key -> model name for every key whose name the model has; keys that only a
    conversion beyond renaming would load). Keys are visited in sorted order, as transformers
    does: some of its renaming rules decide on the first key they see."""
    model_names = set(model_names)
    checkpoint_keys = sorted(checkpoint_keys)
    # Building transformers' rules takes a while (hundreds of regular expressions): only when
    # some name differs.
    exact = all(key in model_names for key in checkpoint_keys)
    rename = None if exact else _transformers_renamer(model, model_names)
    matched: Dict[str, str] = {}
    converted: List[str] = []
    for key in checkpoint_keys:
        if key in model_names or rename is None:
            name, needs_conversion = key, False
        else:
            name, needs_conversion = rename(key)
        if needs_conversion:
            converted.append(key)
        elif name in model_names:
            matched[key] = name
    return matched, converted
