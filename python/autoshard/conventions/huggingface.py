"""What autoshard relies on of Hugging Face transformers: the names, attributes, classes and
file layouts its models, configs and checkpoints use, and the predicates that test for them.

Held in one place so that a transformers release that renames or moves something is met here
and nowhere else. Nothing here imports transformers at import time: importing it costs seconds,
and autoshard runs without it. A predicate on a module never imports it either (a module of a
transformers class implies transformers is imported already); the few functions that need
transformers itself import it when called, and say so.
"""

import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from torch import nn

# --- Model classes -------------------------------------------------------------------------

# Where transformers defines its Conv1D (GPT-2's Linear, its weight stored as [in, out]); it has
# moved between these modules across releases.
CONV1D_MODULES = ("transformers.pytorch_utils", "transformers.modeling_utils")
CONV1D_CLASS_NAME = "Conv1D"


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a transformers Conv1D. Shared by the layers that shard it and the
    planner that plans it, so that both accept the same modules."""
    for module_name in CONV1D_MODULES:
        conv1d = getattr(sys.modules.get(module_name), CONV1D_CLASS_NAME, None)
        if isinstance(conv1d, type) and isinstance(module, conv1d):
            return True
    return False


def is_pretrained_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers PreTrainedModel."""
    if "transformers" not in sys.modules:
        return False  # then the model cannot be a transformers model; importing it costs seconds
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415  (transformers is optional)
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    """The model's output head (its vocabulary projection), as transformers models name it;
    None where the model has none or no such method."""
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None


# --- Forward arguments ---------------------------------------------------------------------

# Arguments that carry the model's own state from an earlier call (the attention keys and values
# of a generation cache; GPT-2's older name is layer_past), not data.
CACHE_INPUTS = frozenset({"past_key_values", "past_key_value", "layer_past"})

# The main inputs autoshard can make for planning, by the model's main_input_name.
MAIN_INPUTS = ("pixel_values", "input_ids", "input_features", "input_values")

# Inputs of images that a model of text and images reads beside its input_ids.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes")

# Any one of these gives an encoder-decoder model's decoder its input (labels are shifted into
# decoder_input_ids by the model itself).
DECODER_INPUTS = frozenset({"decoder_input_ids", "decoder_inputs_embeds", "labels"})

# The methods that check the image features fill as many image tokens as input_ids holds.
PLACEHOLDER_CHECKS = ("get_placeholder_mask", "inputs_merger")  # Idefics2/3 merge and check in one
# The check's argument holding the image features, under each architecture's name for it.
IMAGE_FEATURES = ("image_features", "image_hidden_states", "features")  # Inkling2: one check for every kind


# --- Config attributes ---------------------------------------------------------------------

# Configs within a config, where a composite model (text and images, audio, an
# encoder-decoder) keeps the values of its parts.
NESTED_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder")

# Token ids a config may name as special.
SPECIAL_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                     "cls_token_id", "unk_token_id", "mask_token_id")

# The longest sequence a model's positions cover, under each architecture's name for it.
POSITION_LIMITS = ("max_position_embeddings", "n_positions")
DECODER_POSITION_LIMITS = ("max_target_positions", "max_position_embeddings", "n_positions")

# A vision config's values, under each architecture's name for them.
IMAGE_SIZE = "image_size"
IMAGE_CHANNELS = ("num_channels", "in_channels", "in_chans")
PATCH_SIZE = ("patch_size", "spatial_patch_size")
SPATIAL_MERGE = ("spatial_merge_size", "merge_kernel_size", "merge_size")
TEMPORAL_PATCH_SIZE = ("temporal_patch_size", "patch_temporal")
IMAGE_GRID_PINPOINTS = "image_grid_pinpoints"  # any-resolution models (LLaVA-NeXT)
IMAGE_TOKEN = ("image_token_id", "image_token_index")
VISION_START_TOKEN = ("vision_start_token_id", "image_start_token_id", "boi_token_index")
VISION_END_TOKEN = ("vision_end_token_id", "image_end_token_id", "eoi_token_index")


def any_resolution_crops(image: Tuple[int, int], pinpoints: list, size: int) -> int:
    """How many crops of `size` an any-resolution model (LLaVA-NeXT) cuts an image of `image`
    (height, width) into, the crop of the whole among them. Imports transformers."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches  # noqa: PLC0415  (transformers is optional)

    return image_size_to_num_patches(image, pinpoints, size)


def config_json(model: nn.Module) -> Optional[str]:
    """The model's config as transformers writes it to config.json; None for a model without one."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


# --- Losses --------------------------------------------------------------------------------

# The call by which a model's forward computes its loss through its loss_function attribute.
LOSS_FUNCTION_CALL = "self.loss_function("

# BERT's and RoBERTa's masked-LM forward (its body's statements, as ast.unparse writes them):
# every line that mentions labels, and the lines that make the loss torch's cross-entropy of the
# returned logits (a tuple holds the alternatives of one line). A forward with any other use of
# labels is not taken over.
MASKED_LM_LABEL_LINES = frozenset({
    "if labels is not None:",
    "labels = labels.to(prediction_scores.device)",
    "masked_lm_loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))",
})
MASKED_LM_LOSS_LINES = (
    ("prediction_scores = self.cls(sequence_output)", "prediction_scores = self.lm_head(sequence_output)"),
    "loss_fct = CrossEntropyLoss()",
    "masked_lm_loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))",
    "return MaskedLMOutput(loss=masked_lm_loss, logits=prediction_scores,",
)


def vocabulary_losses() -> Optional[tuple]:
    """transformers' loss functions that are a cross-entropy of the logits over the vocabulary
    (ForCausalLMLoss, ForMaskedLMLoss); None where transformers is not installed. Imports it."""
    try:
        # PreTrainedModel: its absence means no transformers.
        from transformers import PreTrainedModel  # noqa: F401, PLC0415  (transformers is optional)
        from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss  # noqa: PLC0415  (transformers is optional)
    except ImportError:
        return None
    return ForCausalLMLoss, ForMaskedLMLoss


def is_causal_lm_loss(function) -> bool:
    """Whether `function` is transformers' ForCausalLMLoss (it shifts the labels by one token).
    Imports transformers."""
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415  (transformers is optional)

    return function is ForCausalLMLoss


def has_own_loss_function(model: nn.Module) -> bool:
    """Whether a PreTrainedModel's loss_function is not the one transformers picks by its class:
    its class overrides the property, or the instance was given one (the property's setter
    keeps it as _loss_function)."""
    from transformers import PreTrainedModel  # noqa: PLC0415  (transformers is optional)

    return type(model).loss_function is not PreTrainedModel.loss_function or "_loss_function" in vars(model)


# --- Checkpoints ---------------------------------------------------------------------------

# save_pretrained's files: one safetensors file, or shards listed by an index
# ({"metadata": {...}, "weight_map": {tensor name: file}}), beside the config.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def safetensors_shard_file(number: int, count: int) -> str:
    """The name save_pretrained gives shard `number` (from 1) of `count`."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def hub_cache_blobs(directory: str) -> Optional[str]:
    """The blobs folder of the Hugging Face cache repository of which `directory` (a real path)
    is a snapshot (``<repo>/snapshots/<revision>``, whose files are symbolic links to
    ``../../blobs/<hash>``); None where it is no snapshot."""
    snapshots = os.path.dirname(directory)
    if os.path.basename(snapshots) == "snapshots":
        return os.path.join(os.path.dirname(snapshots), "blobs")
    return None


# Class attributes listing the checkpoint names from_pretrained tolerates (tensors that older
# versions saved, or that a head does not need), as regular expressions.
IGNORED_UNEXPECTED_KEYS = "_keys_to_ignore_on_load_unexpected"
IGNORED_MISSING_KEYS = "_keys_to_ignore_on_load_missing"

# The flag from_pretrained sets on the tensors and modules its initialize_weights must leave alone.
INITIALISED_FLAG = "_is_hf_initialized"


def initialises_itself(module: nn.Module) -> bool:
    """Whether `module` computes its own tensors as transformers models do (initialize_weights,
    which calls _init_weights on each module not flagged as initialised)."""
    return callable(getattr(module, "initialize_weights", None)) and callable(getattr(module, "_init_weights", None))


@dataclass(frozen=True)
class ConversionRules:
    """transformers' rules that turn a model's checkpoint names into its own (the ones its
    from_pretrained applies: the base_model_prefix added or stripped, legacy and per-model
    renamings, and converters that do more than rename)."""

    renamings: list
    converters: list
    prefix: str
    known: dict  # model name -> True: rename_source_key only asks whether a name is in the model

    def rename(self, key: str) -> Tuple[str, Optional[str]]:
        """(the model name of checkpoint `key`, the source pattern of the converter it needs, or None)."""
        from transformers.core_model_loading import rename_source_key  # noqa: PLC0415  (transformers is optional)

        return rename_source_key(key, self.renamings, self.converters, self.prefix, self.known)


def conversion_rules(model: nn.Module, model_names) -> Optional[ConversionRules]:
    """The conversion rules of a transformers model whose tensors are `model_names`; None for
    any other model, or a transformers release without them (they came with 5.0)."""
    if not is_pretrained_model(model):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415  (transformers is optional)
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key  # noqa: F401, PLC0415
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    return ConversionRules(renamings=[t for t in transforms if isinstance(t, WeightRenaming)],
                           converters=[t for t in transforms if isinstance(t, WeightConverter)],
                           prefix=model.base_model_prefix, known={name: True for name in model_names})


def is_merge_on_first_dim(operation) -> bool:
    """Whether a converter's operation stacks per-expert tensors on a new dim 0 (MergeModulelist)."""
    from transformers.core_model_loading import MergeModulelist  # noqa: PLC0415  (transformers is optional)

    return type(operation) is MergeModulelist and operation.dim == 0


def is_concatenate(operation) -> bool:
    """Whether a converter's operation concatenates its sources (Concatenate, on operation.dim)."""
    from transformers.core_model_loading import Concatenate  # noqa: PLC0415  (transformers is optional)

    return type(operation) is Concatenate
