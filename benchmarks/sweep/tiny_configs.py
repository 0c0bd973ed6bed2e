"""Tiny configs for every architecture of transformers, made from the config classes themselves.

A config class's defaults describe the released model (4096 wide, 32 layers, 128k tokens). Each
field below that exists in a config is shrunk to a small value, in every sub-config too
(`text_config`, `vision_config`, `encoder`, ...). Sizes that must agree are derived together:
`head_dim` from the width and the head count, grouped-query KV heads kept fewer than the query
heads, per-layer lists cut to the new layer count, blocks per stage (`depths`) capped at the layer
count with the stages kept, special token ids kept inside the vocabulary. A feed-forward width keeps
its ratio to the residual width in the released model (4x in BERT and BART, 2.7x in Llama, 8x in
Gemma), so that attention and feed-forward weigh in the tiny model as they do in the real one.

A model that needs more than the generic rules gets a line of `OVERRIDES` (fields only, no code).
"""

from typing import Any, Dict, List, Tuple

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

WIDTH, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 128

FFN_FIELDS = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff",
              "hidden_dim", "ffn_hidden_size", "mlp_dim", "inner_dim")
_WIDTH_FIELDS = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
# A released model's feed-forward is 0.5x to 16x its width; outside [1/4, 8] it is kept at the ends.
_FFN_RATIO_RANGE = (0.25, 8.0)

# field -> tiny value, applied only where the config's value is an int larger than it.
SHRINK: Dict[str, int] = {
    # widths of the residual stream
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim",
                     "projection_dim", "text_embed_dim", "vision_embed_dim", "output_hidden_size",
                     "embedding_size", "entity_emb_size", "hidden_dim_out", "hidden_size_global",
                     # widths that must equal another (sub-)config's width (the vision tower's output
                     # and the text width, a flow head's condition and the backbone, ...)
                     "text_hidden_size", "audio_hidden_size", "condition_dim",
                     "adapter_in_dim",
                     # a vision tower's merger projects to the text width (Qwen2.5-VL, GLM-4V: 3584
                     # and 4096 by default, which made the image features fill ~50x more tokens
                     # than the grid's positions, and the merger most of the tiny model)
                     "out_hidden_size"), WIDTH),
    # feed-forward widths (where the config has no residual width to keep their ratio to)
    **dict.fromkeys(FFN_FIELDS, FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    # depth
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "depth"), LAYERS),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads"), HEADS),
    # positions and tokens
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length",
                     "max_source_positions", "max_target_positions", "n_ctx", "seq_length"), 64),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
                     "encoder_hash_byte_group_vocab", "entity_vocab_size"), VOCAB),
    "hidden_size_per_layer_input": 16,
    # experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"), 2),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    # multi-head latent attention
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # images and audio
    "image_size": 32, "patch_size": 8, "num_mel_bins": 16, "conv_dim_last": 64,
    # the first convolution's channels of an audio codec, doubled at each downsampling stage
    # (VibeVoice's tokenizers: 32 doubled six times, 2048 channels and 8192-wide feed-forwards)
    "num_filters": 8,
    # layers made dense before the first experts
    "first_k_dense_replace": 1,
}

# model_type -> fields set after the generic rules (for models whose defaults the rules get wrong).
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # Configs whose defaults leave a size unset (None), which their model cannot be built with:
    # the experts routed and chosen, the vocabulary (ESM's is its tokenizer's).
    "deepseek_v2": dict(num_experts_per_tok=2),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "esm": dict(vocab_size=VOCAB, pad_token_id=1),
    # Mamba-2 heads times their width must be the expanded width (2 x 64); one attention layer of
    # the two (the default indices lie past them, and a cache of Mamba layers alone is refused)
    "bamba": dict(mamba_n_heads=4, mamba_d_head=2 * WIDTH // 4, mamba_d_state=16, attn_layer_indices=[1]),
    "whisper": dict(max_source_positions=32),  # the encoder's frames are 2 x this
    # transformers 5.24 builds BLT's cache from the top config, which has no layer count
    # (AttributeError in DynamicCache); the sweep's forward needs no cache.
    "blt": dict(use_cache=False),
    # head_dim x decoder_attention_heads must be d_model (the generic head_dim follows the encoder)
    "d_fine": dict(head_dim=WIDTH // HEADS), "deimv2": dict(head_dim=WIDTH // HEADS),
    # the adaptor (a sub-config with no model_type) is the text width, its feed-forward a quarter of it
    "fun_asr_nano": dict(adaptor_config=dict(hidden_size=WIDTH, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                                             intermediate_size=WIDTH // 4)),
    # image_size / num_windows must be a multiple of sqrt(num_windows)
    "lw_detr_vit": dict(num_windows=4, num_windows_side=2),
    # the vision layers whose features the adapter takes (defaults 24 and 18 of 27)
    "molmo2_adapter": dict(vision_feature_layer=[-1, -2]),
    # WavTokenizer has no projections around its quantizer: the codebook is the hidden size
    "wavtokenizer": dict(codebook_dim=WIDTH),
    # the vision (audio) tower's output is the text width
    "granite_docling_vision": dict(out_hidden_size=WIDTH), "muse_spark_audio": dict(out_hidden_size=WIDTH),
    # d_head must be d_model // n_head
    "xlnet": dict(d_head=WIDTH // HEADS),
    # 32 / 8 = 4 patches a side, pooled to 2 x 2 image tokens (the default 256 tokens would pool
    # 4 patches a side with a window of 0)
    "gemma3": dict(mm_tokens_per_image=4),
    # the last stage's channels are the hidden size
    "efficientloftr": dict(out_features=[16, 16, 32, WIDTH]),
    # The projector normalises the vision tower's features before merging them: its width is the
    # tower's (1152 by default), not shrunk with it.
    "kimi_k25": dict(projection_hidden_size=WIDTH),
    # The projector reads the tower's output after its 2 x 2 pixel shuffle, 4 x the tower's width
    # (6144 = 4 x 1536 by default); the generic rule makes it the text width.
    **dict.fromkeys(("muse_spark", "muse_glimmer"), dict(out_hidden_size=4 * WIDTH)),
    # The projector reads the last layer's features beside those of the layers named here (of 32
    # by default, counted from 0, past the tiny tower's 2), vision_output_dim wide in all.
    "mllama_vision_model": dict(intermediate_layers_indices=[0, LAYERS - 1], vision_output_dim=3 * WIDTH,
                                num_global_layers=LAYERS),
    # SAM's feature map, after its last downsampling, is the vision encoder's patch embedding.
    "unlimited_ocr_sam_vision_model": dict(downsample_channels=[WIDTH, WIDTH]),
    # The VQ encoder reads the vision tower's features (1536 wide by default), and its codes are
    # placed in the ids as tokens of the text model, below its special tokens (16384 codes, the
    # image start token 16384 by default; the tiny config keeps those in the vocabulary's top 8).
    "glm_image_vqmodel": dict(latent_channels=WIDTH, num_embeddings=VOCAB // 2),
    # The image token is the first of the extra vocabulary past vocab_size (151938 by default),
    # an id the sweep's text never draws.
    "molmo2": dict(image_patch_id=VOCAB + 2),
    # The high-resolution tower's features are read after its first global-attention layer
    # (global_attn_indexes[0], 2 of 12 by default: past the tiny tower's 2). The whole sub-config
    # is replaced, so it is given tiny here.
    "deepseek_vl_hybrid": dict(high_res_vision_config=dict(
        model_type="sam_vision_model", hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        mlp_dim=FFN, image_size=32, patch_size=8, global_attn_indexes=[LAYERS - 1])),
    # Voxtral and GLM-ASR stack 4 of the audio encoder's output frames into one vector of the
    # encoder's intermediate_size (5120 = 4 x 1280) before the projector: 96 stacks no whole
    # number of frames, and their audio never ran
    "voxtral_encoder": dict(intermediate_size=4 * WIDTH), "glmasr_encoder": dict(intermediate_size=4 * WIDTH),
    # the released checkpoint's audio token; the default (None) gives the audio features no place in the ids
    "voxtral": dict(audio_token_id=24),
    # The encoder's positions count from one (2049 by default, for 2048 frames): 64 leave the
    # sweep's 64 frames one position short
    "fun_asr_nano_encoder": dict(max_position_embeddings=65),
    # The Q-Former projector cross-attends to the encoder's states, hidden_dim wide (1024 in the
    # released checkpoints); the default config leaves its encoder_hidden_size at BLIP-2's 1408.
    # The whole projector_config is replaced, so it is given tiny here.
    **dict.fromkeys(("granite_speech", "granite_speech_plus"), dict(projector_config=dict(
        model_type="blip_2_qformer", hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=64, vocab_size=VOCAB, encoder_hidden_size=FFN))),
}

_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_HEAD_COUNT_FIELDS = ("num_attention_heads", "n_head", "n_heads", "num_heads")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _special_tokens_inside(fields: Dict[str, Any], vocab: int) -> None:
    for key, value in list(fields.items()):
        if (key.endswith("_token_id") or key.endswith("_token_index")) and _is_count(value) and value >= vocab:
            fields[key] = vocab - 1 - sum(map(ord, key)) % 8
        elif key.endswith("_token_id") and isinstance(value, list):
            fields[key] = [v if not _is_count(v) or v < vocab else vocab - 1 for v in value]


def _attends(kind: str) -> bool:
    return kind.startswith("hybrid") or ("attention" in kind and "linear" not in kind)


def _kinds_kept(values: List[str], n: int) -> List[str]:
    """The first n of a list of layer kinds; where those have no attention layer (a hybrid of
    linear and full attention cut to two linear layers), with every kind present where n allows."""
    cut = list(values[:n])
    if any(_attends(k) for k in cut) or not any(_attends(k) for k in values):
        return cut
    missing = [k for k in dict.fromkeys(values) if k not in cut]
    if len(dict.fromkeys(values)) <= n:
        for i, kind in enumerate(missing):
            cut[n - 1 - i] = kind
    return cut


def _first_count(fields: Dict[str, Any], keys) -> int:
    return next((fields[k] for k in keys if _is_count(fields.get(k))), 0)


def _ffn_ratios(fields: Dict[str, Any]) -> Dict[str, Tuple[int, float]]:
    """Each feed-forward width of a (sub-)config, and its ratio to the residual width there."""
    width = _first_count(fields, _WIDTH_FIELDS)
    low, high = _FFN_RATIO_RANGE
    return {key: (fields[key], min(high, max(low, fields[key] / width))) for key in FFN_FIELDS
            if width and _is_count(fields.get(key))}


def _keep_ffn_ratios(fields: Dict[str, Any], ratios: Dict[str, Tuple[int, float]]) -> None:
    """Feed-forward widths set from the shrunk residual width and their released ratios, in
    multiples of 8 (never wider than they were)."""
    width = _first_count(fields, _WIDTH_FIELDS)
    for key, (released, ratio) in ratios.items():
        fields[key] = min(released, max(8, 8 * round(width * ratio / 8)))


def shrink(fields: Dict[str, Any]) -> Dict[str, Any]:
    """A config's fields (`to_dict()`) shrunk, sub-configs included; the input is not changed."""
    fields = dict(fields)
    old_layers = _first_count(fields, _LAYER_COUNT_FIELDS)
    old_heads = _first_count(fields, _HEAD_COUNT_FIELDS)
    kv = fields.get("num_key_value_heads")
    original_depth = fields.get("depth")
    ffn_ratios = _ffn_ratios(fields)
    for key, tiny in SHRINK.items():
        if _is_count(fields.get(key)) and fields[key] > tiny:
            fields[key] = tiny
    _keep_ffn_ratios(fields, ffn_ratios)
    new_layers = _first_count(fields, _LAYER_COUNT_FIELDS)
    heads = _first_count(fields, _HEAD_COUNT_FIELDS)
    # Layers whose features a later module reads (Qwen3-VL's deepstack mergers, one per index)
    # are kept among the tower's remaining blocks, spread as they were: otherwise the mergers of
    # the indices past the last block are never called.
    indexes, depth = fields.get("deepstack_visual_indexes"), fields.get("depth")
    if isinstance(indexes, list) and indexes and all(_is_count(i) for i in indexes) and _is_count(depth) \
            and _is_count(original_depth) and max(indexes) >= depth:
        fields["deepstack_visual_indexes"] = list(dict.fromkeys(i * depth // original_depth for i in indexes))
    vision = fields.get("vision_config") if isinstance(fields.get("vision_config"), dict) else {}
    old_image = vision.get("image_size")
    for key, value in list(fields.items()):
        # Per-layer lists (layer_types, block sizes, ...) follow the layer count.
        if isinstance(value, list) and old_layers and new_layers < old_layers and value and all(
                isinstance(v, str) for v in value) and (len(value) == old_layers or key.endswith("types")):
            # Kinds of layer (a pattern such as block_types repeats): every kind kept.
            fields[key] = _kinds_kept(value, new_layers) if len(value) > new_layers else value
        elif isinstance(value, list) and old_layers and len(value) == old_layers and new_layers < old_layers:
            fields[key] = value[:new_layers]
        elif isinstance(value, dict) and "model_type" in value:
            fields[key] = shrink(value)
    if vision:
        _vision_fields_follow(fields, old_image, fields["vision_config"])
    if _is_count(kv):
        # Grouped-query attention stays grouped; multi-query stays multi-query.
        fields["num_key_value_heads"] = 1 if kv == 1 else (heads if kv >= old_heads else min(KV_HEADS, heads))
    width = _first_count(fields, ("hidden_size", "d_model", "n_embd"))
    for key in ("head_dim", "d_kv", "attention_head_size"):
        if _is_count(fields.get(key)) and heads and width:
            fields[key] = width // heads
    if "head_dim" in fields and fields["head_dim"] is None and heads and width:
        # None stands for hidden_size // heads, but some models read it without that fallback.
        fields["head_dim"] = width // heads
    if old_layers and new_layers < old_layers:
        # Layers of a kind every `period` layers from `offset` (Jamba's attention and experts): the
        # last of the remaining layers is of that kind.
        for key in [k for k in fields if k.endswith("_layer_period")]:
            offset = key[:-len("period")] + "offset"
            if _is_count(fields[key]) and _is_count(fields.get(offset)) and fields[offset] >= new_layers:
                fields[key], fields[offset] = new_layers, new_layers - 1
        # Layers counted by part (Dory's input, recurrent and output layers) sum to the layer count.
        parts = [k for k in ("n_input_layers", "n_recurrent_layers", "n_output_layers") if _is_count(fields.get(k))]
        if len(parts) == 3 and sum(fields[k] for k in parts) != new_layers:
            fields.update(n_input_layers=0, n_recurrent_layers=new_layers, n_output_layers=0) if new_layers < 3 else \
                fields.update(n_input_layers=1, n_recurrent_layers=new_layers - 2, n_output_layers=1)
        # Backbone outputs named by stage follow the stages: left to the config's defaults
        # (the stage names from the stages, the last stage's output).
        for key in ("out_features", "out_indices", "stage_names"):
            fields.pop(key, None)
        # A module inserted after one layer (MiniCPM-V's window-attention merger after vision layer
        # 6) stays after a layer that remains, as far along the tower as it was.
        if _is_count(fields.get("insert_layer_id")) and fields["insert_layer_id"] >= new_layers:
            fields["insert_layer_id"] = fields["insert_layer_id"] * new_layers // old_layers
        # Settings of single layers by index keep those of the layers that remain.
        if isinstance(fields.get("per_layer_config"), dict):
            fields["per_layer_config"] = {k: v for k, v in fields["per_layer_config"].items()
                                          if str(k).isdigit() and int(k) < new_layers}
    if isinstance(fields.get("num_heads"), list):  # heads per stage (Swin): the same small count
        fields["num_heads"] = [HEADS] * len(fields["num_heads"])
    if isinstance(fields.get("depths"), list):  # blocks per stage: at most the layer count, stages kept
        fields["depths"] = [min(d, LAYERS) if _is_count(d) else d for d in fields["depths"]]
    head_width = width // heads if heads and width else 0
    if head_width and _is_count(fields.get("rotary_dim")) and fields["rotary_dim"] > head_width:
        fields["rotary_dim"] = head_width
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" not in rope and _declares_mrope(fields.get("model_type")):
        # The modeling code's default sections (time, height, width) 2:3:3, made for a 128-wide head.
        rope = {**rope, "mrope_section": [16, 24, 24]}
    if head_width and isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        # Multimodal rotary sections share half a head's (rotary) features.
        sections = rope["mrope_section"]
        rotary = fields["qk_rope_head_dim"] if _is_count(fields.get("qk_rope_head_dim")) else head_width
        rotary = int(rotary * rope.get("partial_rotary_factor", 1.0))
        half, total = rotary // 2, sum(sections)
        scaled = [max(1, s * half // total) for s in sections]
        scaled[0] += half - sum(scaled)
        fields["rope_parameters"] = {**rope, "mrope_section": scaled}
    if _is_count(fields.get("qk_rope_head_dim")):
        # Multi-head latent attention: a head is its no-position part and its rotary part.
        rope, nope = fields["qk_rope_head_dim"], fields.get("qk_nope_head_dim", 0)
        if "head_dim" in fields:
            fields["head_dim"] = rope
        if "qk_head_dim" in fields:
            fields["qk_head_dim"] = rope + (nope or 0)
    if _is_count(fields.get("vocab_size")):
        _special_tokens_inside(fields, fields["vocab_size"])
    elif isinstance(fields.get("text_config"), dict) and _is_count(fields["text_config"].get("vocab_size")):
        # A model of text and images: its image and video tokens are ids of its text model.
        _special_tokens_inside(fields, fields["text_config"]["vocab_size"])
    fields.update(OVERRIDES.get(fields.get("model_type", ""), {}))
    return fields


def _vision_fields_follow(fields: Dict[str, Any], old_image, vision: Dict[str, Any]) -> None:
    """The top config's fields about its vision tower follow the shrunk tower: the grid of an
    any-resolution model (LLaVA-NeXT's pinpoints, multiples of the image size) scaled with the
    image size, and the tower layers whose features the projector reads kept among its layers
    (VipLLaVA reads five of them, counted from either end)."""
    if _is_count(fields.get("insert_layer_id")) and _is_count(vision.get("insert_layer_id")):
        fields["insert_layer_id"] = vision["insert_layer_id"]  # the top config repeats the tower's
    new_image = vision.get("image_size")
    pinpoints = fields.get("image_grid_pinpoints")
    if _is_count(old_image) and _is_count(new_image) and isinstance(pinpoints, list) and all(
            isinstance(p, list) and all(_is_count(v) and v % old_image == 0 for v in p) for p in pinpoints):
        fields["image_grid_pinpoints"] = [[v // old_image * new_image for v in p] for p in pinpoints]
    layers = _first_count(vision, _LAYER_COUNT_FIELDS)
    if not layers:
        return
    # hidden_states holds the embeddings and each layer's output: indices in [-(layers + 1), layers]
    keep = lambda i: max(-(layers + 1), min(layers, i)) if _is_count(i) else i
    for key in ("vision_feature_layer", "vision_feature_layers"):
        value = fields.get(key)
        if isinstance(value, list):
            fields[key] = [keep(i) for i in value]
        elif _is_count(value):
            fields[key] = keep(value)


def _declares_mrope(model_type) -> bool:
    """Whether the config class keeps multimodal rotary sections in rope_parameters."""
    cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    return "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ())


def tiny_config(model_type: str) -> PretrainedConfig:
    """The default config of `model_type`, shrunk, with eager attention everywhere."""
    default = AutoConfig.for_model(model_type)
    config = type(default).from_dict(shrink(default.to_dict()))
    _eager(config)
    return config


def _eager(config: PretrainedConfig) -> None:
    config._attn_implementation = "eager"
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            _eager(value)
