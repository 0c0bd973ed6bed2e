"""Example inputs for planning a Hugging Face model, made from its config and class.

The model's `main_input_name` says what its forward reads first: token ids (`input_ids`),
images (`pixel_values`, at the config's image size and channels), log-mel features
(`input_features`, with the config's mel bins and the frame count the encoder accepts) or raw
audio (`input_values`). Encoder-decoder models also get `decoder_input_ids`, models of text and
images (CLIP) get `pixel_values` too, and inputs the forward requires (no default: an
`attention_mask`, `token_type_ids`) are added when autoshard knows how to make them. The tensors are small
CPU tensors: the planner runs the forward on their meta copies and keeps their values for the
few reads of input values the forward makes (a padding check).

Other models (a plain nn.Module) get one tensor shaped for the first layer their forward's one
required argument reaches (module_inputs.py); where one tensor is not enough they need
example_inputs from the caller: a tuple of positional arguments, one tensor, or a dict of
keyword arguments.
"""

import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..conventions import huggingface as hf
from .audio_inputs import AUDIO_INPUTS, audio_beside_text, with_audio
from .image_inputs import first_of, with_images
from .missing import HOW_TO_PASS, MissingInputs
from .module_inputs import (as_dtype, example_inputs_for_module, fits_first_layer, float_dtype, forward_arguments,
                            required_parameters)

BATCH = 2
SEQUENCE = 8
DEFAULT_IMAGE_SIZE = 224
VIDEO_FRAMES = ("num_frames", "frames_per_clip")


def _config_value(config, *names, default=None):
    """The first of `names` the config (or its nested text / vision / audio config) holds."""
    holders = (config, *(getattr(config, nested, None) for nested in hf.NESTED_CONFIGS))
    return next((v for v in (first_of(h, *names) for h in holders if h is not None) if v is not None), default)


def ordinary_token(config) -> int:
    """A token id that is no special token (so that a padding check finds no padding)."""
    special = set()
    for name in hf.SPECIAL_TOKEN_IDS:
        value = getattr(config, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        special.update(v for v in values if isinstance(v, int))
    vocab = _config_value(config, "vocab_size", default=2 ** 31)
    return next((t for t in range(min(vocab, 64)) if t not in special), 0)


def _sequence(config, *limits) -> int:
    bound = _config_value(config, *limits) if limits else None
    return min(SEQUENCE, bound) if isinstance(bound, int) and bound > 0 else SEQUENCE


def _token_ids(config, *limits) -> torch.Tensor:
    return torch.full((BATCH, _sequence(config, *limits)), ordinary_token(config), dtype=torch.long)


def _pixel_values(config, video: bool = False) -> torch.Tensor:
    # Convolutional backbones (ResNet, RegNet, SegFormer, ...) take any image size and their
    # configs name none: the ImageNet size they are made for, which every stage's stride divides.
    size = _config_value(config, hf.IMAGE_SIZE, "crop_size", default=DEFAULT_IMAGE_SIZE)
    channels = _config_value(config, "num_channels", default=3)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    # A video model (TimeSformer, VideoMAE, ViViT, V-JEPA 2) names its clip's frames in its own
    # config and takes (batch, frames, channels, height, width).
    frames = next((getattr(config, name) for name in VIDEO_FRAMES if isinstance(getattr(config, name, None), int)), None)
    if video or frames is not None:
        if frames is None:
            raise MissingInputs(f"its config has none of {VIDEO_FRAMES} to make a clip of frames from")
        return torch.zeros(BATCH, frames, channels, height, width)
    return torch.zeros(BATCH, channels, height, width)


def _input_features(model: nn.Module, config) -> torch.Tensor:
    per_channel = _config_value(config, "input_feat_per_channel")
    if per_channel is not None:
        # Speech2Text's layout: batch x frames x features, subsampled by stride-2 convolutions.
        features = per_channel * _config_value(config, "input_channels", default=1)
        layers = len(_config_value(config, "conv_kernel_sizes", default=()))
        return torch.zeros(BATCH, SEQUENCE * 2 ** layers, features)
    mel_bins = _config_value(config, "num_mel_bins")
    positions = _config_value(config, "max_source_positions")
    if mel_bins is None or positions is None:
        raise MissingInputs("its config has no num_mel_bins and max_source_positions to make input_features from "
                            "(autoshard knows Whisper's layout, batch x mel bins x frames, and Speech2Text's)")
    # The encoder's convolutions subsample the frames to its positions (Whisper checks it).
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else model
    strides = math.prod(m.stride[0] for m in encoder.modules() if isinstance(m, nn.Conv1d))
    return torch.zeros(BATCH, mel_bins, positions * strides)


def _input_values(config) -> torch.Tensor:
    kernels = _config_value(config, "conv_kernel")
    strides = _config_value(config, "conv_stride")
    if kernels is None or strides is None:
        raise MissingInputs("its config has no conv_kernel and conv_stride to make input_values from")
    # Frames after the feature extractor's convolutions: more than a SpecAugment mask spans.
    length = max(SEQUENCE, 2 * _config_value(config, "mask_time_length", default=0))
    for kernel, stride in reversed(list(zip(kernels, strides))):
        length = (length - 1) * stride + kernel
    return torch.zeros(BATCH, length)


def _main_input(model: nn.Module, config, name: str) -> torch.Tensor:
    if name == "input_ids":
        return _token_ids(config, *hf.POSITION_LIMITS)
    if name == "pixel_values":
        return _pixel_values(config)
    if name == "pixel_values_videos":
        return _pixel_values(config, video=True)
    if name == "input_features":
        return _input_features(model, config)
    if name == "input_values":
        return _input_values(config)
    if name == "past_values" and isinstance(_config_value(config, "context_length"), int):
        # A time series (PatchTST, PatchTSMixer): batch x context x channels.
        channels = _config_value(config, "num_input_channels")
        context = _config_value(config, "context_length")
        return torch.zeros((BATCH, context, channels) if isinstance(channels, int) else (BATCH, context))
    raise MissingInputs(f"autoshard makes input_ids, pixel_values, pixel_values_videos, input_features and input_values, "
                        f"not its main input {name!r}")


def _main_or_inferred(model: nn.Module, config, name: str) -> torch.Tensor:
    """The main input made from the config, or where the config does not say its shape (an audio
    codec's waveform, an encoder's features of a width no field names), inferred from the first
    layer it reaches, as for a plain module; MissingInputs with both reasons where neither works.
    An audio input made from the config that its first layer cannot take (OmniASR's waveform of
    one channel) is inferred instead, where inferring works."""
    try:
        made = _main_input(model, config, name)
    except MissingInputs as from_config:
        try:
            return example_inputs_for_module(model, argument=name)[1][name]
        except MissingInputs as inferred:
            raise MissingInputs(f"{from_config}, and inferring it from the first layer failed ({inferred.reason})") from None
    # An audio input's layout the config does not settle: the same config fields serve waveforms
    # taken as (batch, samples) and as (batch, 1, samples).
    if name not in AUDIO_INPUTS or fits_first_layer(model, name, made):
        return made
    try:
        return example_inputs_for_module(model, argument=name)[1][name]
    except MissingInputs:
        return made  # the model's own error then names what it expected


def images_beside_text(model: nn.Module) -> bool:
    """Whether autoshard makes images beside the text of this model (a vision config, a forward
    that reads input_ids first and takes pixel_values)."""
    config = getattr(model, "config", None)
    return (getattr(model, "main_input_name", None) == "input_ids" and getattr(config, "vision_config", None) is not None
            and "pixel_values" in forward_arguments(model))


def media_beside_text(model: nn.Module) -> bool:
    """Whether autoshard makes images or audio beside the text of this model."""
    return images_beside_text(model) or audio_beside_text(model)


def example_inputs_for(model: nn.Module, media: bool = True) -> Tuple[tuple, Dict[str, torch.Tensor]]:
    """(args, kwargs) for one forward of a Hugging Face model, made from its config and class (of
    another module, inferred from its forward and first layer); raises MissingInputs naming what
    is missing and how to pass it. A model of text and images gets images beside its text, else
    a model of text and audio audio (image_inputs.py, audio_inputs.py); with media=False it gets
    its text alone."""
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    if config is None or not isinstance(name, str):
        return example_inputs_for_module(model)
    try:
        kwargs = {name: _main_or_inferred(model, config, name)}
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = _token_ids(config, *hf.DECODER_POSITION_LIMITS)
        width = encoder_states_width(model)
        if width is not None:
            kwargs[encoder_states_argument(model)] = torch.zeros(BATCH, SEQUENCE, width)
        # A model of text and images reads both: its images have a config of their own.
        beside_text = images_beside_text(model)
        audio = not beside_text and audio_beside_text(model)
        for extra in (p.name for p in required_parameters(model)[0]):
            if extra in kwargs or (beside_text and extra in hf.IMAGE_INPUTS) or (audio and extra in AUDIO_INPUTS):
                continue
            if extra == "attention_mask":
                kwargs[extra] = torch.ones(kwargs[name].shape[:2], dtype=torch.long)
            elif extra == "decoder_attention_mask" and "decoder_input_ids" in kwargs:
                kwargs[extra] = torch.ones_like(kwargs["decoder_input_ids"])
            elif extra == "token_type_ids" and name == "input_ids":
                kwargs[extra] = torch.zeros_like(kwargs[name])
            elif extra in hf.MAIN_INPUTS:
                kwargs[extra] = _main_input(model, config, extra)
            else:
                raise MissingInputs(f"its forward requires {extra!r}, which autoshard does not know how to make")
        if beside_text and media:
            kwargs = with_images(model, config, kwargs)
        elif audio and media:
            kwargs = with_audio(model, config, kwargs)
    except MissingInputs as error:
        if str(error).startswith("plan:"):
            raise
        raise MissingInputs(f"plan: cannot make example inputs for {type(model).__name__} (main input "
                            f"{name!r}): {error}; {HOW_TO_PASS}") from None
    # Images and features in the model's own floating-point dtype, as its processor would give them.
    return (), as_dtype(kwargs, float_dtype(model))


def encoder_states_width(model: nn.Module) -> Optional[int]:
    """The features of the encoder_hidden_states that a decoder alone (BartForCausalLM, a BERT
    decoder with cross-attention) reads in its cross-attention, or None where it has none: the
    trace of a forward without them never calls those layers, which then stay whole. A decoder
    alone that takes `encoder_outputs` (WhisperForCausalLM, whose layers all cross-attend) reads
    them there (encoder_states_argument)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    takes_outputs = encoder_states_argument(model) == "encoder_outputs"
    if not takes_outputs and (not getattr(config, "is_decoder", False)
                              or getattr(config, "add_cross_attention", None) is False
                              or "encoder_hidden_states" not in forward_arguments(model)):
        return None
    return _config_value(config, "cross_attention_hidden_size", "encoder_hidden_size", "d_model", "hidden_size")


def encoder_states_argument(model: nn.Module) -> str:
    """The argument through which a decoder alone takes its encoder's states: encoder_hidden_states,
    or encoder_outputs where its forward takes only that."""
    accepted = forward_arguments(model)
    return "encoder_outputs" if "encoder_outputs" in accepted and "encoder_hidden_states" not in accepted \
        else "encoder_hidden_states"


def missing_decoder_inputs(model: nn.Module, kwargs: Optional[dict]) -> bool:
    """Whether an encoder-decoder model was given no input for its decoder."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return False
    given = set(kwargs or {})
    return not given & hf.DECODER_INPUTS
