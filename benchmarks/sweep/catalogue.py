"""Every architecture of the installed transformers: its base model and, where it has one, its
causal-LM head, each built from its tiny config with random weights, and example inputs made
from the config and the model's main input (for a model of text and images or audio, text with
its images or audio first, their tokens placed in the ids)."""

import inspect
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.utils import logging

from tiny_configs import tiny_config
from autoshard.inputs.hf_inputs import encoder_states_argument, encoder_states_width

logging.set_verbosity_error()

BATCH, SEQ, DECODER_SEQ = 2, 7, 5  # 7 tokens: neither 2 nor 3 ranks divide it
from autoshard.inputs.audio_inputs import AUDIO_SAMPLES, audio_features, configs_within, first_int  # noqa: E402 - shared with autoshard's inputs
from autoshard.inputs.image_inputs import count_at_check, ids_with_tokens  # noqa: E402 - shared with autoshard's inputs


class NoSuchInputs(LookupError):
    """The sweep cannot make this kind of inputs for the model (not a failure of the model)."""


class NoMediaLayoutRuns(RuntimeError):
    """A model that takes images or audio beside its text fails with every layout of them the
    sweep makes (or the sweep makes none for its config): it is judged on its text alone, and the
    record keeps this failure."""


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


def _special_ids(config) -> Set[int]:
    ids = set()
    for c in configs_within(config):
        for key, value in vars(c).items():
            if key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids"):
                ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _token_ids(config, shape, generator) -> torch.Tensor:
    """Ids inside the vocabulary that no special token uses (an image token would ask for images)."""
    vocab = first_int(config, "vocab_size") or 128
    allowed = torch.tensor([i for i in range(1, vocab) if i not in _special_ids(config)])
    return allowed[torch.randint(0, len(allowed), shape, generator=generator)]


def _pixels(config, generator) -> torch.Tensor:
    channels, size = first_int(config, "num_channels") or 3, first_int(config, "image_size") or 32
    return torch.randn(BATCH, channels, size, size, generator=generator)


def _video(config, generator) -> torch.Tensor:
    frames = first_int(config, "num_frames") or 2
    channels, size = first_int(config, "num_channels") or 3, first_int(config, "image_size") or 32
    return torch.randn(BATCH, frames, channels, size, size, generator=generator)


# The sets of example inputs a model is tried with, in turn, the first that runs unsharded being
# the one it is judged on: "media", text with the images or audio it takes beside it, their tokens
# in the ids (media_inputs; only for such a model), so that its vision or audio tower runs and is
# planned; then kind 0, its main input alone; then kind 1, the main input in its other layout:
# text with images beside it and no image tokens (a dual encoder such as CLIP needs both), audio
# as (batch, 1 channel, samples) (codecs), images as videos (batch, frames, channels, H, W).
INPUT_KINDS = ("media", 0, 1)


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
        length, channels = first_int(config, "context_length") or 32, first_int(config, "num_input_channels")
        shape = (BATCH, length, channels) if channels else (BATCH, length)
        inputs = {"past_values": torch.randn(*shape, generator=generator)}
    elif main == "input_features":
        bins, frames = first_int(config, "num_mel_bins") or 16, 2 * (first_int(config, "max_source_positions") or 32)
        inputs = {"input_features": torch.randn(BATCH, bins, frames, generator=generator)}
    else:
        raise NoSuchInputs(f"no example inputs for the main input {main!r}")
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = _token_ids(config, (BATCH, DECODER_SEQ), generator)
    # A decoder alone with cross-attention (BartForCausalLM) reads an encoder's states there.
    width = encoder_states_width(model)
    if width is not None:
        inputs[encoder_states_argument(model)] = torch.randn(BATCH, SEQ, width, generator=generator)
    return inputs


# The inputs a model's forward may take beside its input_ids, which put a tower of their own to work.
IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")
AUDIO_INPUTS = ("input_features", "input_values")


def _accepted(model: torch.nn.Module) -> Set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def takes_media_beside_text(model: torch.nn.Module) -> bool:
    """Whether the model reads input_ids first and takes images, videos or audio (features or a
    waveform) beside them."""
    return (getattr(model, "main_input_name", "input_ids") == "input_ids"
            and bool(_accepted(model) & set(IMAGE_INPUTS + AUDIO_INPUTS)))


def _placeholder_checks(module: torch.nn.Module) -> List[str]:
    # get_placeholder_mask, get_audio_placeholder_mask, ...; Idefics3 checks in inputs_merger
    return [name for name in dir(type(module))
            if (name.startswith("get_") and name.endswith("placeholder_mask")) or name == "inputs_merger"]


def placeholder_count(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> Optional[int]:
    """Runs the forward on `inputs` up to the check where the model puts image or audio features in
    place of their tokens in the ids (get_placeholder_mask, get_audio_placeholder_mask): the number
    of tokens the features fill, or None where the forward ends without such a check. Raises what
    the forward raises before it. autoshard's own count (inputs/image_inputs.py), on real tensors,
    not meta ones: a tiny model runs in milliseconds, and the count is then the one the judged
    forward sees. Inkling2's one check for every kind names its argument `features`."""
    return count_at_check(model, inputs, _placeholder_checks, audio_features, on_meta=False)


def _media_token(config, kind: str) -> Optional[int]:
    """The config's token for an image or for audio, and its start and end tokens where it has them."""
    names = {"image": ("image_token_id", "image_token_index"), "audio": ("audio_token_id", "audio_token_index")}[kind]
    for c in configs_within(config):
        for name in names:
            value = getattr(c, name, None)
            if isinstance(value, int):
                return value
    return None


def _ids_with_tokens(ids: torch.Tensor, config, token: int, count: int, kind: str) -> torch.Tensor:
    """`ids` with `count` tokens `token` inserted after each sample's first id, shared out over the
    samples, between the config's start and end tokens for images where it has them."""
    start = end = None
    if kind == "image":
        start = next((v for v in (first_int(config, n) for n in ("vision_start_token_id", "image_start_token_id",
                                                              "boi_token_index")) if v is not None), None)
        end = next((v for v in (first_int(config, n) for n in ("vision_end_token_id", "image_end_token_id",
                                                            "eoi_token_index")) if v is not None), None)
    return ids_with_tokens(ids, token, count, start, end)


def _image_layouts(model: torch.nn.Module, generator) -> List[Dict[str, torch.Tensor]]:
    """autoshard's layouts of images for the model (inputs/image_inputs.py), random values in them."""
    from autoshard.inputs.image_inputs import image_layouts

    config = model.config
    if getattr(config, "vision_config", None) is None or "pixel_values" not in _accepted(model):
        return []
    # In the model's dtype: a layout is tried by running the model (an fp64 model's convolution
    # refuses fp32 pixels), and the judged inputs are cast to it anyway.
    dtype = next(model.parameters()).dtype
    return [{k: torch.randn(v.shape, generator=generator).to(dtype) if v.is_floating_point() else v
             for k, v in layout.items()} for layout in image_layouts(model, config, BATCH)]


def _audio_layouts(model: torch.nn.Module, generator) -> List[Dict[str, torch.Tensor]]:
    """autoshard's layouts of audio for the model (inputs/audio_inputs.py: log-mel features in the
    layouts its config and audio tower suggest, or a waveform), random values in them."""
    from autoshard.inputs.audio_inputs import audio_layouts

    dtype = next(model.parameters()).dtype  # as for images
    return [{k: torch.randn(v.shape, generator=generator).to(dtype) if v.is_floating_point() else v
             for k, v in layout.items()} for layout in audio_layouts(model, BATCH)]


# The message with which transformers' multimodal models refuse features and placeholder tokens
# of different counts ("Audio features and audio tokens do not match, tokens: 0, features: 64"):
# the count of features is the number of tokens they fill. MusicFlamingo checks it before the
# placeholder check, building the audio's timestamps from the tokens.
_MISMATCH = r"{} features and {} tokens do not match[,:] tokens: \S+, features:? (\d+)"


def _mismatch_count(error: Exception, kind: str) -> Optional[int]:
    found = re.search(_MISMATCH.format(kind, kind), str(error), re.IGNORECASE)
    return int(found.group(1)) if found else None


def _with_tokens(model: torch.nn.Module, inputs: Dict[str, torch.Tensor], ids: torch.Tensor, token: int,
                 count: int, kind: str) -> Dict[str, torch.Tensor]:
    inputs = {**inputs, "input_ids": _ids_with_tokens(ids, model.config, token, count, kind)}
    if kind == "image" and "mm_token_type_ids" in _accepted(model):
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == token).long()  # 1 where an image is
    return inputs


def media_inputs(model: torch.nn.Module, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Text with the images (or else the audio) the model takes beside it: each layout of images
    autoshard makes, then the sweep's audio features, run up to the model's placeholder check (or
    its refusal of features and tokens of different counts) for the number of tokens they fill,
    and that many image (audio) tokens placed in the ids; the first layout that gets there (or runs
    through without one) is the model's. Where none does, each layout again with two of the
    model's tokens in each sample's ids. Raises NoSuchInputs where the model takes no such inputs,
    NoMediaLayoutRuns where none of the layouts runs."""
    if not takes_media_beside_text(model):
        raise NoSuchInputs("the model takes no images or audio beside its input_ids")
    text = {"input_ids": _token_ids(model.config, (BATCH, SEQ), generator)}
    if getattr(model.config, "is_encoder_decoder", False):
        text["decoder_input_ids"] = _token_ids(model.config, (BATCH, DECODER_SEQ), generator)
    ids = text["input_ids"]
    media = (("image", _image_layouts(model, generator)), ("audio", _audio_layouts(model, generator)))
    failures = []
    # The second pass, with tokens already in the ids, is for a forward that tells ids a processor
    # expanded from a legacy prompt by a run of media tokens in them (Qwen2-Audio merges a prompt
    # without such a run the legacy way, which needs an attention mask); it comes after every
    # layout without tokens, so that a model that runs with one of those keeps it.
    for seeded in (False, True):
        for kind, layouts in media:
            token = _media_token(model.config, kind)
            if seeded and token is None:
                continue
            for layout in layouts:
                tried = {**text, **layout}
                if seeded:
                    tried = _with_tokens(model, tried, ids, token, 2 * BATCH, kind)
                try:
                    count = placeholder_count(model, tried)
                except Exception as error:  # noqa: BLE001 - the model's own error, kept for the record
                    count = _mismatch_count(error, kind)
                    if count is None:
                        why = f"{type(error).__name__}: {str(error)[:200]}"
                        if f"{_shapes(layout)}: {why}" not in failures:  # else the tokens changed nothing
                            failures.append(f"{_shapes(layout)}{' with its tokens in the ids' if seeded else ''}: {why}")
                        continue
                if count is not None and token is not None:
                    tried = _with_tokens(model, tried, ids, token, count, kind)
                return tried
    raise NoMediaLayoutRuns("; ".join(failures) or "the sweep makes no images or audio for its config")


def _shapes(inputs: Dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in inputs.items())


def inputs_label(inputs: Dict[str, torch.Tensor]) -> str:
    """What the judged inputs hold, for the record: "text+images", "text", "images", "audio", ..."""
    parts = [("text", ("input_ids",)), ("images", ("pixel_values",)), ("videos", ("pixel_values_videos",)),
             ("audio", ("input_features", "input_values")), ("series", ("past_values",))]
    return "+".join(label for label, keys in parts if any(k in inputs for k in keys)) or "+".join(sorted(inputs))


def autoshard_inputs(model: torch.nn.Module, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """The inputs autoshard makes itself for plan(model) without example_inputs (their layout:
    images beside text, image tokens in the ids), with random values in their floating-point
    tensors, so that the judge runs the model on what the plan traced."""
    from autoshard.inputs.hf_inputs import example_inputs_for
    from autoshard.inputs.meta_shadow import meta_shadow

    shadow = meta_shadow(model, always_copy=True)
    try:
        args, kwargs = example_inputs_for(shadow)
    except RuntimeError:  # no layout of images or audio fits: plan() takes the text alone, and so does the judge
        args, kwargs = example_inputs_for(shadow, media=False)
    if args:
        raise NoSuchInputs("autoshard made positional inputs")
    return {k: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v for k, v in kwargs.items()}
