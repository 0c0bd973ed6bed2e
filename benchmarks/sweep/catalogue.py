"""Every architecture of the installed transformers: its base model and, where it has one, its
causal-LM head, each built from its tiny config with random weights, and example inputs made
from the config and the model's main input."""

import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.utils import logging

from tiny_configs import tiny_config

logging.set_verbosity_error()

BATCH, SEQ, DECODER_SEQ = 2, 7, 5  # 7 tokens: neither 2 nor 3 ranks divide it
AUDIO_SAMPLES = 1600


class NoSuchInputs(LookupError):
    """The sweep cannot make this kind of inputs for the model (not a failure of the model)."""


@dataclass(frozen=True)
class Variant:
    model_type: str
    head: str  # "base" or "causal"
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.model_type}:{self.head}"


def variants() -> List[Variant]:
    found = []
    for head, mapping in (("base", modeling_auto.MODEL_MAPPING_NAMES),
                          ("causal", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        for model_type, class_name in mapping.items():
            if isinstance(class_name, (tuple, list)):
                class_name = class_name[0]
            found.append(Variant(model_type, head, class_name))
    return sorted(found, key=lambda v: v.name)


def by_name(name: str) -> Variant:
    found = [v for v in variants() if v.name == name]
    if not found:
        raise LookupError(f"no variant {name!r} in this transformers (names are model_type:base or model_type:causal)")
    return found[0]


def build(variant: Variant) -> torch.nn.Module:
    """The model in fp32 (the checks convert it), in eval mode so that dropout is off."""
    cls = getattr(transformers, variant.class_name)
    return cls(tiny_config(variant.model_type)).eval()


def _configs(config) -> List[object]:
    found = [config]
    for value in vars(config).values():
        if isinstance(value, transformers.PretrainedConfig):
            found += _configs(value)
    return found


def _first(config, key: str) -> Optional[int]:
    for c in _configs(config):
        value = getattr(c, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _special_ids(config) -> Set[int]:
    ids = set()
    for c in _configs(config):
        for key, value in vars(c).items():
            if key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids"):
                ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _token_ids(config, shape, generator) -> torch.Tensor:
    """Ids inside the vocabulary that no special token uses (an image token would ask for images)."""
    vocab = _first(config, "vocab_size") or 128
    allowed = torch.tensor([i for i in range(1, vocab) if i not in _special_ids(config)])
    return allowed[torch.randint(0, len(allowed), shape, generator=generator)]


def _pixels(config, generator) -> torch.Tensor:
    channels, size = _first(config, "num_channels") or 3, _first(config, "image_size") or 32
    return torch.randn(BATCH, channels, size, size, generator=generator)


def _video(config, generator) -> torch.Tensor:
    frames = _first(config, "num_frames") or 2
    channels, size = _first(config, "num_channels") or 3, _first(config, "image_size") or 32
    return torch.randn(BATCH, frames, channels, size, size, generator=generator)


# How many sets of example inputs a model may be tried with: its main input alone, then the main
# input in its other layout: text with images beside it (a dual encoder such as CLIP needs both),
# audio as (batch, 1 channel, samples) (codecs), images as videos (batch, frames, channels, H, W).
INPUT_KINDS = 2


def example_inputs(model: torch.nn.Module, generator: torch.Generator, kind: int = 0) -> Dict[str, torch.Tensor]:
    """Inputs for the model's main input (and with `kind` 1, images beside text); raises
    NoSuchInputs for inputs this sweep cannot make."""
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        inputs = {"input_ids": _token_ids(config, (BATCH, SEQ), generator)}
        if kind == 1:
            if "pixel_values" not in inspect.signature(model.forward).parameters:
                raise NoSuchInputs("the model takes no pixel_values beside its input_ids")
            inputs["pixel_values"] = _pixels(config, generator)
    elif kind == 1 and main == "input_values":
        inputs = {"input_values": torch.randn(BATCH, 1, AUDIO_SAMPLES, generator=generator)}
    elif kind == 1 and main == "pixel_values":
        inputs = {"pixel_values": _video(config, generator)}
    elif kind != 0:
        raise NoSuchInputs(f"no other inputs than {main!r}")
    elif main == "pixel_values":
        inputs = {"pixel_values": _pixels(config, generator)}
    elif main == "pixel_values_videos":
        inputs = {"pixel_values_videos": _video(config, generator)}
    elif main == "input_values":
        inputs = {"input_values": torch.randn(BATCH, AUDIO_SAMPLES, generator=generator)}
    elif main == "past_values":  # a time series: (batch, context, channels)
        length, channels = _first(config, "context_length") or 32, _first(config, "num_input_channels")
        shape = (BATCH, length, channels) if channels else (BATCH, length)
        inputs = {"past_values": torch.randn(*shape, generator=generator)}
    elif main == "input_features":
        bins, frames = _first(config, "num_mel_bins") or 16, 2 * (_first(config, "max_source_positions") or 32)
        inputs = {"input_features": torch.randn(BATCH, bins, frames, generator=generator)}
    else:
        raise NoSuchInputs(f"no example inputs for the main input {main!r}")
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = _token_ids(config, (BATCH, DECODER_SEQ), generator)
    return inputs


def autoshard_inputs(model: torch.nn.Module, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """The inputs autoshard makes itself for plan(model) without example_inputs (their layout:
    images beside text, image tokens in the ids), with random values in their floating-point
    tensors, so that the judge runs the model on what the plan traced."""
    from autoshard.plan.inputs import example_inputs_for
    from autoshard.plan.meta_inputs import meta_shadow

    shadow = meta_shadow(model, always_copy=True)
    try:
        args, kwargs = example_inputs_for(shadow)
    except RuntimeError:  # no layout of images fits: plan() takes the text alone, and so does the judge
        args, kwargs = example_inputs_for(shadow, images=False)
    if args:
        raise NoSuchInputs("autoshard made positional inputs")
    return {k: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v for k, v in kwargs.items()}
