"""Audio beside text for a Hugging Face model of text and audio (Qwen2-Audio, Voxtral, Granite
Speech, GLM-ASR, Audio Flamingo 3, ...), made from its config and its audio tower.

The layouts are tried in turn:
- log-mel features: first Whisper's layout (batch, mel bins, frames); then (batch, features,
  frames) and (batch, frames, features) for each width the config names (num_mel_bins,
  feature_size, input_feat_per_channel, ...) and the width the audio tower's first layer reads
  (a convolution's input channels, a projection's or a norm's width: some encoders read stacked
  frames no config field names), over 2 x max_source_positions frames and, where the encoder
  cuts its input in windows, one window of frames (n_window); with a mask of every frame where
  the forward takes one (input_features_mask, feature_attention_mask), unless the model's
  get_audio_features does not take it beside the features (Granite Speech's mask selects its
  projector's outputs instead);
- a waveform, where the forward reads input_values instead: (batch, samples) and (batch, 1,
  samples), with a padding_mask where the forward takes one.

As with images, the audio features take the place of audio tokens in input_ids: the number is
found by running the forward on meta copies up to the placeholder check (get_placeholder_mask,
get_audio_placeholder_mask, ...), or up to the model's refusal of features and tokens of
different counts, which names it ("Audio features and audio tokens do not match, tokens: 0,
features: 64"); the ids are then made again with that many audio tokens
(config.audio_token_id / audio_token_index, in the config or one it holds). A forward that tells
a processor's expanded prompt by a run of audio tokens already in the ids (Qwen2-Audio) gets
every layout again with two audio tokens in each sample.
"""

import inspect
import re
from typing import Dict, List, Optional

import torch
from torch import nn

from .image_inputs import count_at_check, ids_with_tokens, shapes, with_ids
from .module_inputs import as_dtype, float_dtype, forward_arguments

AUDIO_INPUTS = ("input_features", "input_values")
AUDIO_TOKEN = ("audio_token_id", "audio_token_index")
AUDIO_SAMPLES = 1600  # a tenth of a second at 16 kHz: a few frames after a codec's strides
# Config fields that may give the width of an audio encoder's input features.
FEATURE_SIZES = ("num_mel_bins", "feature_size", "input_feat_per_channel", "feature_projection_input_dim",
                 "input_dim")
FEATURE_MASKS = ("input_features_mask", "feature_attention_mask")

# transformers' refusal of features and placeholder tokens of different counts, naming the count
# of features (the tokens they fill). MusicFlamingo checks it before its placeholder check.
_MISMATCH = re.compile(r"audio features and audio tokens do not match[,:] tokens: \S+, features:? (\d+)", re.IGNORECASE)


def configs_within(config) -> List[object]:
    """The config and every config it holds (text_config, audio_config, ...), depth first."""
    found = [config]
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            found += configs_within(value)
    return found


def first_int(config, name: str) -> Optional[int]:
    """The first integer `name` of the config or of a config it holds."""
    for holder in configs_within(config):
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def audio_token(config) -> Optional[int]:
    return next((v for v in (first_int(config, n) for n in AUDIO_TOKEN) if v is not None), None)


def audio_beside_text(model: nn.Module) -> bool:
    """Whether autoshard makes audio beside the text of this model: its forward reads input_ids
    first and takes audio features or a waveform."""
    return getattr(model, "main_input_name", None) == "input_ids" and bool(forward_arguments(model) & set(AUDIO_INPUTS))


def tower_input_width(model: nn.Module) -> Optional[int]:
    """The width of features the first weighted layer of the model's audio tower (the first module
    below it whose forward takes input_features) reads."""
    tower = next((m for name, m in model.named_modules() if name and "input_features" in forward_arguments(m)), None)
    for layer in tower.modules() if tower is not None else ():
        if isinstance(layer, nn.Conv1d):
            return layer.in_channels
        if isinstance(layer, nn.Linear):
            return layer.in_features
        if isinstance(layer, nn.LayerNorm):
            return layer.normalized_shape[-1]
    return None


def _waveform_layouts(model: nn.Module, batch: int) -> List[Dict[str, torch.Tensor]]:
    layouts = []
    for shape in ((batch, AUDIO_SAMPLES), (batch, 1, AUDIO_SAMPLES)):
        layout = {"input_values": torch.zeros(shape)}
        if "padding_mask" in forward_arguments(model):
            layout["padding_mask"] = torch.ones(batch, AUDIO_SAMPLES, dtype=torch.long)
        layouts.append(layout)
    return layouts


def audio_layouts(model: nn.Module, batch: int) -> List[Dict[str, torch.Tensor]]:
    """The layouts of audio tried for the model, in order (the module docstring), zeros in their
    floating-point tensors."""
    accepted = forward_arguments(model)
    if "input_features" not in accepted:
        return _waveform_layouts(model, batch) if "input_values" in accepted else []
    config = model.config
    bins, frames = first_int(config, "num_mel_bins") or 16, 2 * (first_int(config, "max_source_positions") or 32)
    window = first_int(config, "n_window")
    shapes = [(bins, frames, frames)]  # (features axis 1, frames axis 2, the frame count)
    # The tower's width comes last: a model that runs with an earlier layout keeps it.
    sizes = [bins] + [v for v in (first_int(config, k) for k in FEATURE_SIZES) if v] + [tower_input_width(model)]
    for size in dict.fromkeys(v for v in sizes if v):
        for count in dict.fromkeys([frames] + ([2 * window] if window else [])):
            for shape in ((size, count, count), (count, size, count)):
                if shape not in shapes:
                    shapes.append(shape)
    encoder = getattr(model, "get_audio_features", None)
    encodes = set(inspect.signature(encoder).parameters) if callable(encoder) else set()
    masks = [m for m in FEATURE_MASKS if m in accepted and (m in encodes or "input_features" not in encodes)]
    layouts = []
    for first, second, count in shapes:
        layout = {"input_features": torch.zeros(batch, first, second)}
        for mask in masks:
            layout[mask] = torch.ones(batch, count, dtype=torch.long)
        layouts.append(layout)
    return layouts


def _audio_checks(module: nn.Module):
    return [name for name in dir(type(module)) if name.startswith("get_") and name.endswith("placeholder_mask")]


def audio_features(bound: dict):
    """Every feature tensor a placeholder check was called with (audio_features,
    audio_hidden_states, a shared check's `features`), or None."""
    features = [v for k, v in bound.items()
                if v is not None and (k.endswith("_features") or k.endswith("_hidden_states") or k == "features")]
    return [t for f in features for t in (f if isinstance(f, (list, tuple)) else [f])] or None


def with_audio(model: nn.Module, config, kwargs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """kwargs (input_ids among them) with the model's audio inputs, and audio tokens in the ids
    where its forward places the audio features by them. Raises RuntimeError naming each layout's
    failure where none runs."""
    token = audio_token(config)
    ids = kwargs["input_ids"]
    layouts = [as_dtype(layout, float_dtype(model)) for layout in audio_layouts(model, ids.shape[0])]
    failures = []
    # The second pass, with tokens already in the ids, comes after every layout without them, so
    # that a model that runs with one of those keeps it.
    for seeded in (False, True) if token is not None else (False,):
        for layout in layouts:
            tried = {**kwargs, **layout}
            if seeded:
                tried = with_ids(tried, ids_with_tokens(ids, token, 2 * ids.shape[0]))
            try:
                count = count_at_check(model, tried, _audio_checks, audio_features)
            except Exception as error:  # noqa: BLE001 - the model's own error, told in ours
                found = _MISMATCH.search(str(error))
                if found is None:
                    failures.append(f"{shapes(layout)}{' with audio tokens in the ids' if seeded else ''}: "
                                    f"{type(error).__name__}: {str(error)[:200]}")
                    continue
                count = int(found.group(1))
            if count is not None and token is not None:
                tried = with_ids(tried, ids_with_tokens(ids, token, count))
            return tried
    raise RuntimeError("plan: the forward failed with each layout of audio autoshard made ("
                       + "; ".join(failures) + ")")
