"""Example inputs made from a Hugging Face model's config, and reads of input values during the
meta capture. The multi-rank equality of these models' sharded outputs and gradients with the
unsharded model's is in tests/conformance (entries with planning="auto")."""

import copy
import importlib
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, CLIPConfig,
                          CLIPModel)
from transformers.utils import logging

import autoshard
from autoshard.planner import plan_json
from autoshard.inputs.hf_inputs import example_inputs_for
from autoshard.inputs.missing import MissingInputs
from autoshard.inputs.meta_values import KnownValues
from hf_models import build
from multirank import run_on_ranks

logging.set_verbosity_error()
capture_module = importlib.import_module("autoshard.capture.capture")

SEQ2SEQ = dict(d_model=48, d_kv=8, d_ff=70, num_layers=1, num_decoder_layers=1, num_heads=6, vocab_size=101)


def _meta(kind, head, **config):
    with torch.device("meta"):
        return head.from_config(AutoConfig.for_model(kind, **config))


def _whisper(**extra):
    return _meta("whisper", AutoModelForSpeechSeq2Seq, d_model=48, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=70, decoder_ffn_dim=70,
                 num_mel_bins=10, max_source_positions=12, max_target_positions=6, vocab_size=101, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **extra)


def test_inputs_from_the_config():
    _, t5 = example_inputs_for(_meta("t5", AutoModelForSeq2SeqLM, **SEQ2SEQ))
    assert set(t5) == {"input_ids", "decoder_input_ids"}
    assert t5["input_ids"].shape == (2, 8) and t5["input_ids"].dtype == torch.long
    assert not (t5["input_ids"] == 0).any()  # T5's pad token: no padding in the example
    _, vit = example_inputs_for(_meta("vit", AutoModel, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                                      intermediate_size=70, image_size=(12, 8), patch_size=4, num_channels=5))
    assert set(vit) == {"pixel_values"} and vit["pixel_values"].shape == (2, 5, 12, 8)
    _, whisper = example_inputs_for(_whisper())
    # Whisper's encoder accepts exactly max_source_positions x its convolutions' strides frames.
    assert whisper["input_features"].shape == (2, 10, 24)
    assert whisper["decoder_input_ids"].shape == (2, 6)  # no more than max_target_positions
    _, clip = example_inputs_for(_meta("clip_text_model", AutoModel, hidden_size=48, num_hidden_layers=1,
                                       num_attention_heads=6, intermediate_size=70, vocab_size=101))
    assert set(clip) == {"input_ids"}
    _, s2t = example_inputs_for(_meta("speech_to_text", AutoModel, d_model=48, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=70,
                                      decoder_ffn_dim=70, vocab_size=101))
    # Speech2Text: frames x (features per channel x channels), subsampled by two stride-2 convolutions.
    assert s2t["input_features"].shape == (2, 32, 80) and s2t["decoder_input_ids"].shape == (2, 8)


def test_text_and_image_model_gets_both():
    config = CLIPConfig(text_config=dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                                         intermediate_size=70, vocab_size=101),
                        vision_config=dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                                           intermediate_size=70, image_size=8, patch_size=4, num_channels=3),
                        projection_dim=16)
    with torch.device("meta"):
        model = CLIPModel(config)
    _, kwargs = example_inputs_for(model)
    assert set(kwargs) == {"input_ids", "pixel_values"} and kwargs["pixel_values"].shape == (2, 3, 8, 8)
    plan = autoshard.plan(model, world_size=2)
    assert plan.example["description"] == "input_ids (2, 8), pixel_values (2, 3, 8, 8)"


def test_inputs_take_the_model_dtype():
    model = _whisper().to(torch.float64)
    _, kwargs = example_inputs_for(model)
    assert kwargs["input_features"].dtype == torch.float64


@pytest.mark.parametrize("name", ["t5", "vit", "whisper", "clip_text"])
def test_plans_without_example_inputs(name):
    model = {
        "t5": lambda: _meta("t5", AutoModelForSeq2SeqLM, **SEQ2SEQ),
        "vit": lambda: _meta("vit", AutoModel, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                             intermediate_size=70, image_size=8, patch_size=4, num_channels=3),
        "whisper": _whisper,
        "clip_text": lambda: _meta("clip_text_model", AutoModel, hidden_size=48, num_hidden_layers=1,
                                   num_attention_heads=6, intermediate_size=70, vocab_size=101),
    }[name]()
    plan = autoshard.plan(model, world_size=2)
    assert {"column", "row"} <= {layer.style for layer in plan.layers}


@pytest.mark.parametrize("kind", ["resnet", "segformer"])
def test_an_image_model_whose_config_names_no_size_gets_imagenet_images(kind):
    config = {"resnet": dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
              "segformer": dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[12, 24],
                                num_attention_heads=[2, 4], decoder_hidden_size=24, strides=[4, 2],
                                patch_sizes=[7, 3], mlp_ratios=[2, 2])}[kind]
    model = _meta(kind, AutoModel, **config)
    assert getattr(model.config, "image_size", None) is None
    _, kwargs = example_inputs_for(model)
    assert tuple(kwargs["pixel_values"].shape) == (2, 3, 224, 224)
    plan = autoshard.plan(model, world_size=2)  # it used to raise: "its config has no image_size"
    # SegFormer's attention and MLPs are split; ResNet's convolutions with their BatchNorms.
    assert {"column", "row"} <= {layer.style for layer in plan.layers}
    if kind == "resnet":
        assert plan.norms and all(norm.per_channel for norm in plan.norms)


@pytest.mark.parametrize("kind,main", [("videomae", "pixel_values"), ("vjepa2", "pixel_values_videos")])
def test_a_video_model_gets_a_clip_of_its_configs_frames(kind, main):
    config = {"videomae": dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=6, intermediate_size=70,
                               image_size=16, patch_size=8, num_frames=4, tubelet_size=2),
              "vjepa2": dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=6, mlp_ratio=2.0,
                             crop_size=16, patch_size=8, frames_per_clip=4, tubelet_size=2,
                             pred_hidden_size=24, pred_num_hidden_layers=1, pred_num_attention_heads=4)}[kind]
    model = _meta(kind, AutoModel, **config)
    _, kwargs = example_inputs_for(model)
    assert tuple(kwargs[main].shape) == (2, 4, 3, 16, 16)  # (batch, frames, channels, height, width)
    plan = autoshard.plan(model, world_size=2)  # both used to raise for want of inputs
    assert {"column", "row"} <= {layer.style for layer in plan.layers}


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(10, 20), nn.Linear(20, 10)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class EmbeddingFirst(nn.Module):
    def __init__(self):
        super().__init__()
        # Registered before the table: the first layer is the one the input reaches.
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.embed = nn.Embedding(50, 16, padding_idx=0)

    def forward(self, ids, mask=None):
        return self.down(torch.relu(self.up(self.embed(ids))))


class ConvFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, stride=2)
        self.up, self.down = nn.Linear(12, 24), nn.Linear(24, 12)

    def forward(self, images):
        x = torch.relu(self.stem(images)).flatten(2).transpose(1, 2)
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("model, given", [
    (Plain, lambda: torch.randn(2, 8, 10)),
    (EmbeddingFirst, lambda: torch.randint(1, 50, (2, 8))),
    (ConvFirst, lambda: torch.randn(2, 3, 16, 16)),
], ids=["linear", "embedding", "conv"])
def test_plain_module_inputs_from_its_first_layer(model, given):
    """One input tensor shaped for the first layer the forward's one required argument reaches:
    the plan equals the plan made with inputs of that shape by hand."""
    inferred = autoshard.plan(model(), world_size=2)
    by_hand = autoshard.plan(model(), world_size=2, example_inputs=(given(),))
    # The same plan, up to the example inputs' values the document keeps for the dry run.
    assert plan_json.dumps(inferred, input_values=False) == plan_json.dumps(by_hand, input_values=False)
    # A column and row pair (the stem convolution and `up` where a convolution comes first).
    assert {layer.style for layer in inferred.layers} >= {"column", "row"}, str(inferred)
    args, kwargs = example_inputs_for(model())
    assert kwargs == {} and len(args) == 1 and args[0].shape == given().shape and args[0].dtype == given().dtype
    if model is EmbeddingFirst:
        assert 0 < int(args[0].min()) and int(args[0].max()) < 50  # in the table, no padding index


def test_plain_module_inputs_on_meta():
    """A model on meta gets its inputs without its weights: nothing is materialised."""
    with torch.device("meta"):
        model = EmbeddingFirst()
    assert autoshard.plan(model, world_size=2).layer("embed").style == "vocab"


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(10, 10)

    def forward(self, x, memory, scale=1.0):
        return self.proj(x + memory) * scale


class Flattened(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        return self.head(x.flatten(1))


class NoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 10))

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize("model, says", [
    (TwoInputs, r"its forward requires 2 arguments \('x', 'memory'\)"),
    (Flattened, r"'x' reaches its first layer, head \(Linear\), changed"),
    (NoLayer, r"its forward requires 'x', and the model has no layer that says the shape"),
], ids=["two_inputs", "flattened", "no_layer"])
def test_plain_module_error_names_the_arguments(model, says):
    with pytest.raises(ValueError, match=f"cannot infer the example inputs of a {model.__name__}: {says}.*"
                                         r"pass example_inputs=\(tensor, \.\.\.\) for positional arguments .* "
                                         r"example_inputs=\{\"name\": tensor"):
        autoshard.plan(model(), world_size=2)


def test_plain_module_example_inputs_forms():
    x = torch.randn(2, 10)
    for given in ((x,), [x], x, {"x": x}):  # the forms plan() accepts
        assert autoshard.plan(TwoInputs(), world_size=2, example_inputs={"x": x, "memory": x}).layer("proj")
        assert autoshard.plan(Plain(), world_size=2, example_inputs=given).layer("down").style == "row"


def _llava(**extra):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                           intermediate_size=70, image_size=16, patch_size=4, num_channels=3, projection_dim=48),
        text_config=dict(model_type="llama", hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                         num_key_value_heads=2, intermediate_size=70, vocab_size=101),
        image_token_id=100, projector_hidden_act="gelu", **extra)
    with torch.device("meta"):
        return LlavaForConditionalGeneration(config).eval()


def test_text_and_image_model_gets_image_tokens():
    """The image tokens in input_ids are as many as the image features the model places by
    them (LLaVA checks it): a 16x16 image of 4x4 patches gives 16 features per image."""
    import warnings

    model = _llava()
    _, kwargs = example_inputs_for(model)
    assert kwargs["pixel_values"].shape == (2, 3, 16, 16)
    assert ((kwargs["input_ids"] == 100).sum(1) == 16).all()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*failed with the images")
        plan = autoshard.plan(model, world_size=2)
    # The vision tower is traced and planned with the text.
    planned = {layer.module for layer in plan.layers}
    assert any(name.startswith("model.vision_tower.") for name in planned)
    assert any(name.startswith("model.language_model.") for name in planned)
    assert "pixel_values (2, 3, 16, 16)" in plan.example["description"]


def test_images_that_do_not_fit_leave_the_text():
    """Images the model refuses (here: a vision tower that wants another size) plan its text alone,
    with a warning that names the reason."""
    model = _llava()
    model.config.vision_config.image_size = 12  # the positions are for 16x16 images
    with pytest.warns(UserWarning, match="planned on its text alone, so its vision or audio tower is not traced"):
        plan = autoshard.plan(model, world_size=2)
    assert not any(layer.module.startswith("model.vision_tower.") for layer in plan.layers)
    assert plan.example["description"] == "input_ids (2, 8)"


_AUDIO_TEXT = dict(model_type="llama", hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                   num_key_value_heads=2, intermediate_size=70, vocab_size=101, head_dim=8)
# kind -> (config fields, the audio inputs made, audio tokens per sample). Qwen2-Audio's encoder
# halves its 16 frames in a convolution and again in a pooling; Voxtral's projector then merges
# 4 frames of 8 into one token.
_AUDIO = {
    "qwen2_audio": (dict(audio_config=dict(d_model=48, encoder_layers=1, encoder_attention_heads=6, encoder_ffn_dim=70,
                                           num_mel_bins=8, max_source_positions=8),
                         text_config=dict(_AUDIO_TEXT, model_type="qwen2"), audio_token_index=100),
                    {"input_features": (2, 8, 16), "feature_attention_mask": (2, 16)}, 4),
    "voxtral": (dict(audio_config=dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=6, intermediate_size=192,
                                       num_mel_bins=8, max_source_positions=8),
                     text_config=_AUDIO_TEXT, audio_token_id=100, projector_hidden_act="gelu"),
                {"input_features": (2, 8, 16)}, 2),
}


@pytest.mark.parametrize("kind", sorted(_AUDIO))
def test_text_and_audio_model_gets_audio_tokens(kind):
    """A model of text and audio gets log-mel features beside its text, and as many audio tokens
    in the ids as the features fill (the model checks it); the audio changes the output, and
    the plan traces the audio tower with the text."""
    import warnings

    fields, shapes, per_sample = _AUDIO[kind]
    config = AutoConfig.for_model(kind, **fields)
    with torch.device("meta"):
        meta = AutoModel.from_config(config)
    _, kwargs = example_inputs_for(meta)
    assert {k: tuple(v.shape) for k, v in kwargs.items() if k != "input_ids"} == shapes
    assert ((kwargs["input_ids"] == 100).sum(1) == per_sample).all()
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)

    def run():
        audio = {k: torch.randn(v.shape, generator=generator) for k, v in kwargs.items() if v.is_floating_point()}
        with torch.no_grad():
            return model(**{**kwargs, **audio}).last_hidden_state

    assert not torch.allclose(run(), run())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*failed with the images or audio")
        plan = autoshard.plan(model, world_size=2)
    planned = {layer.module for layer in plan.layers}
    assert any(name.startswith("audio_tower.layers.0.") for name in planned)
    assert "input_features (2, 8, 16)" in plan.example["description"]


def test_audio_that_does_not_fit_leaves_the_text():
    """Features no layout fits (a tower wanting more frames than the config's positions give)
    plan the text alone, with a warning naming the model's refusal."""
    fields, _, _ = _AUDIO["voxtral"]
    config = AutoConfig.for_model("voxtral", **fields)
    config.audio_config.max_source_positions = 5  # an odd count of positions: no frames fit
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    with pytest.warns(UserWarning, match="failed with the images or audio .* its vision or audio tower is not traced"):
        plan = autoshard.plan(model, world_size=2)
    assert not any(layer.module.startswith("audio_tower.") for layer in plan.layers)


_TEXT = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, intermediate_size=70,
             vocab_size=101, max_position_embeddings=64)
_VISION = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=70, image_size=16,
               patch_size=4)
# Each takes an input beside pixel_values that the layout makes from its config (None: it has none).
_IMAGE_EXTRAS = {
    # Tiles of each image, with the id of their aspect ratio and a mask of the real ones.
    "mllama": (dict(text_config=dict(_TEXT, cross_attention_layers=[1], pad_token_id=0), image_token_index=100,
                    vision_config=dict(_VISION, attention_heads=6, num_global_layers=1, max_num_tiles=2,
                                       supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
                                       intermediate_layers_indices=[0], vision_output_dim=96)),
               {"pixel_values": (2, 1, 2, 3, 16, 16), "aspect_ratio_ids": (2, 1), "aspect_ratio_mask": (2, 1, 2)}),
    # A second view of each image for the high-resolution tower, at that tower's size.
    "deepseek_vl_hybrid": (dict(text_config=_TEXT, image_token_id=100, vision_config=_VISION,
                                high_res_vision_config=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                                            mlp_dim=70, image_size=32, patch_size=8,
                                                            output_channels=16, global_attn_indexes=[1])),
                           {"pixel_values": (2, 3, 16, 16), "high_res_pixel_values": (2, 3, 32, 32)}),
    # Flattened patches on a grid, with the spatial merge of each image.
    "video_llama_3": (dict(text_config=_TEXT, image_token_id=100, vision_config=_VISION),
                      {"pixel_values": (8, 48), "image_grid_thw": (2, 3), "image_merge_sizes": (2,)}),
}


@pytest.mark.parametrize("kind", sorted(_IMAGE_EXTRAS))
def test_images_come_with_the_inputs_the_forward_needs_beside_them(kind):
    """The layout made from the config runs the model, and its images change the output (its
    vision tower is used, not skipped)."""
    fields, shapes = _IMAGE_EXTRAS[kind]
    config = AutoConfig.for_model(kind, **fields)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        meta = AutoModel.from_config(config)
    _, kwargs = example_inputs_for(meta)  # raises where no layout of images runs the forward
    assert {k: tuple(v.shape) for k, v in kwargs.items() if k != "input_ids"} == shapes
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("gate") and parameter.numel() == 1:
                parameter.fill_(0.5)  # Mllama's cross-attention gates start at 0: no image would count
    generator = torch.Generator().manual_seed(0)

    def run():
        images = {k: torch.randn(v.shape, generator=generator) for k, v in kwargs.items() if v.is_floating_point()}
        with torch.no_grad():
            return model(**{**kwargs, **images}).last_hidden_state

    assert not torch.allclose(run(), run())


def test_encoder_decoder_without_decoder_inputs_names_them():
    model = _meta("t5", AutoModelForSeq2SeqLM, **SEQ2SEQ)
    with pytest.raises(RuntimeError, match="example_inputs has no decoder_input_ids"):
        autoshard.plan(model, world_size=2, example_inputs={"input_ids": torch.ones(2, 5, dtype=torch.long)})


def test_a_decoder_alone_taking_encoder_outputs_gets_them():
    """WhisperForCausalLM cross-attends in every layer to states it takes as `encoder_outputs`
    (no `encoder_hidden_states`): they are made, so its cross-attention is traced and split."""
    from transformers import WhisperConfig, WhisperForCausalLM

    config = WhisperConfig(vocab_size=96, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
                           d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=4,
                           encoder_attention_heads=4, decoder_ffn_dim=48, encoder_ffn_dim=48,
                           max_target_positions=32, max_source_positions=16)
    model = WhisperForCausalLM(config)
    _, kwargs = example_inputs_for(model)
    assert kwargs["encoder_outputs"].shape[-1] == 32 and "encoder_hidden_states" not in kwargs
    plan = autoshard.plan(model, world_size=2)
    styles = {layer.module: layer.style.value for layer in plan.layers}
    assert styles["model.decoder.layers.0.encoder_attn.k_proj"] == "column"
    assert styles["model.decoder.layers.0.encoder_attn.out_proj"] == "row"


class PaddingCheck(nn.Module):
    """Reads its input's values in forward, as Hugging Face's padding checks do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, input_ids):
        ids = input_ids
        if (ids == 0).any().item() or 0 in ids[:, [-1, 0]].tolist()[0] or ids.nonzero().shape[0] != ids.numel():
            raise ValueError("padding")
        positions = torch.arange(ids.shape[1])
        if int(positions.max()) != ids.shape[1] - 1:  # a value made on meta from constants alone
            raise ValueError("positions")
        return self.down(torch.relu(self.up(self.embed(ids))))


def test_value_reads_on_the_inputs_are_answered():
    ids = torch.randint(1, 50, (2, 7))
    plan = autoshard.plan(PaddingCheck(), world_size=2, example_inputs=(ids,))
    assert plan.layer("up").style == "column" and plan.layer("down").style == "row"
    # The answers are the real values: padded inputs take the model's own error path.
    with pytest.raises(RuntimeError, match="forward failed on the meta device .*padding"):
        autoshard.plan(PaddingCheck(), world_size=2, example_inputs=(torch.zeros(2, 7, dtype=torch.long),))


def test_known_values_follow_in_place_writes():
    values = KnownValues()
    weight = torch.empty(4, device="meta")
    with values:
        x = values.to_meta(torch.arange(4))
        y = x * 2
        assert y.tolist() == [0, 2, 4, 6]
        y.add_(weight.long())  # unknown values written in: y is no longer known
        with pytest.raises(RuntimeError, match="depend on more than the example inputs"):
            y.tolist()
        assert x.tolist() == [0, 1, 2, 3]
        # Uninitialized memory is no value to answer with.
        with pytest.raises(RuntimeError, match="depend on more than the example inputs"):
            torch.empty(3, device="meta").tolist()


def test_unknown_values_indexed_by_a_known_mask_give_the_selected_shape():
    # A multimodal model's placeholder check: `inputs_embeds[mask]`, the embeddings (from weights)
    # unknown on meta, the mask made from the ids' media tokens known.
    values = KnownValues()
    embeds = torch.empty(2, 5, 4, device="meta")
    with values:
        ids = values.to_meta(torch.tensor([[1, 9, 9, 2, 3], [9, 1, 2, 3, 4]]))
        mask = (ids == 9).unsqueeze(-1).expand_as(embeds)
        picked = embeds[mask]
        assert picked.shape == (12,) and picked.device.type == "meta"  # 3 tokens x 4 features
        assert embeds[:, ids[0] == 9].shape == (2, 2, 4)  # positions picked by a mask over one axis
        with pytest.raises(RuntimeError, match="depend on more than the example inputs"):
            picked.tolist()  # the selected values themselves stay unknown
        # A mask computed from the unknown values is no answer either.
        with pytest.raises(RuntimeError, match="depend on more than the example inputs"):
            embeds[embeds > 0]


class _Passthrough(KnownValues):
    """KnownValues doing nothing: the capture as it was before reads of values were answered."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "gemma"])
def test_answering_value_reads_changes_no_plan_that_worked(kind, monkeypatch):
    """Twins are consulted only where meta fails: a model that planned before plans the same."""
    model = build(kind, device="meta")
    ids = {"input_ids": torch.randint(1, 101, (2, 8))}
    now = json.loads(autoshard.plan(model, world_size=3, example_inputs=ids).to_json())
    monkeypatch.setattr(capture_module, "KnownValues", _Passthrough)
    before = json.loads(autoshard.plan(model, world_size=3, example_inputs=ids).to_json())
    assert now == before


def _dry_run_inputs():
    world = dist.get_world_size()
    torch.manual_seed(0)
    reference = PaddingCheck()
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(reference, world_size=world, example_inputs={"input_ids": ids})
    results = {}
    # The dry run runs on the inputs given to parallelize: padded ones take the model's error path.
    try:
        autoshard.parallelize(copy.deepcopy(reference), plan, example_inputs=(torch.zeros(3, 5, dtype=torch.long),))
    except ValueError as error:
        results["padded"] = str(error)
    # Other shapes than the plan's: no shape prediction to compare with, the run itself is checked.
    other = torch.randint(1, 50, (3, 5), generator=torch.Generator().manual_seed(2))
    model = autoshard.parallelize(copy.deepcopy(reference), plan, example_inputs=(other,))
    torch.testing.assert_close(model(other), reference(other), rtol=1e-5, atol=1e-6)
    # A plan read from JSON replays the inputs it was made with (their values are in the document).
    again = autoshard.ShardingPlan.from_json(plan.to_json())
    model = autoshard.parallelize(copy.deepcopy(reference), again)
    torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-6)
    return results


def test_parallelize_dry_run_uses_its_example_inputs():
    for results in run_on_ranks(_dry_run_inputs, 2):
        assert "meta copy" in results["padded"] and "padding" in results["padded"]


def _bart_decoder():
    from transformers import AutoModelForCausalLM

    return _meta("bart", AutoModelForCausalLM, d_model=48, decoder_layers=1, decoder_attention_heads=6,
                 decoder_ffn_dim=70, encoder_layers=1, encoder_attention_heads=6, encoder_ffn_dim=70,
                 max_position_embeddings=32, vocab_size=101)


def test_a_decoder_alone_gets_encoder_states_for_its_cross_attention():
    model = _bart_decoder()
    _, kwargs = example_inputs_for(model)
    assert kwargs["encoder_hidden_states"].shape == (2, 8, 48)
    plan = autoshard.plan(model, world_size=2)
    assert plan.layer("model.decoder.layers.0.encoder_attn.k_proj").style.value == "column"
    assert plan.layer("model.decoder.layers.0.encoder_attn.out_proj").style.value == "row"


def test_cross_attention_traced_without_encoder_states_is_whole_and_says_why():
    model = _bart_decoder()
    plan = autoshard.plan(model, world_size=2, example_inputs={"input_ids": torch.ones(2, 8, dtype=torch.long)})
    whole = {item.module: item.reason for item in plan.replicated()}
    assert whole["model.decoder.layers.0.encoder_attn.k_proj"] == "not_called"
    assert "a layer the traced forward never calls" in str(plan)


def test_a_decoder_without_cross_attention_gets_no_encoder_states():
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "bert", hidden_size=48, num_hidden_layers=1, num_attention_heads=6, intermediate_size=70,
            vocab_size=101, is_decoder=True, add_cross_attention=False))
    assert "encoder_hidden_states" not in example_inputs_for(model)[1]


def _released(kind):
    """A model of the released size on meta (nothing allocated): its config's defaults."""
    with torch.device("meta"):
        return AutoModel.from_config(AutoConfig.for_model(kind))


@pytest.mark.parametrize("kind, shape", [
    ("dac", (2, 1, None)),  # an audio codec's waveform: its first convolution's one channel
    ("moonshine", (2, None)),  # a waveform the forward unsqueezes itself before its first convolution
])
def test_a_waveform_no_config_field_sizes_is_inferred_from_the_first_layer(kind, shape):
    model = _released(kind)
    _, kwargs = example_inputs_for(model)
    values = kwargs["input_values"]
    assert values.dim() == len(shape) and values.is_floating_point()
    assert all(want is None or got == want for got, want in zip(values.shape, shape))
    # Long enough for every stride of the encoder: the forward runs on meta and the plan is made.
    plan = autoshard.plan(model, world_size=2)
    assert plan.layers


def test_a_time_series_gets_its_configs_context_and_channels():
    model = _released("patchtst")
    _, kwargs = example_inputs_for(model)
    config = model.config
    assert kwargs["past_values"].shape == (2, config.context_length, config.num_input_channels)


def test_a_main_input_neither_made_nor_inferred_names_both_reasons():
    class Waveform(nn.Module):
        main_input_name = "input_values"

        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {})()
            self.conv = nn.Conv1d(3, 4, 1)

        def forward(self, input_values=None):
            return self.conv(input_values.transpose(1, 2))  # (batch, samples, 3): reaches its layer transposed

    with pytest.raises(MissingInputs) as error:
        example_inputs_for(Waveform())
    message = str(error.value)
    assert "no conv_kernel and conv_stride" in message and "inferring it from the first layer failed" in message
    assert "'input_values' reaches its first layer, conv (Conv1d), changed" in message


def test_a_waveform_its_first_convolution_cannot_take_is_inferred_again():
    """The wav2vec2 config fields (conv_kernel, conv_stride) make (batch, samples); a model that
    hands its waveform straight to a one-channel convolution (OmniASR) takes (batch, 1, samples)."""
    class OneChannelWaveform(nn.Module):
        main_input_name = "input_values"

        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"conv_kernel": [10, 3], "conv_stride": [5, 2]})()
            self.conv = nn.Conv1d(1, 4, 10, stride=5)

        def forward(self, input_values=None):
            return self.conv(input_values)

    _, kwargs = example_inputs_for(OneChannelWaveform())
    assert kwargs["input_values"].dim() == 3 and kwargs["input_values"].shape[:2] == (2, 1)
    assert OneChannelWaveform()(kwargs["input_values"]).shape[:2] == (2, 4)


class _GrowsItsPositions(nn.Module):
    """A forward that extends a buffer of positions the first time it sees a longer input (as
    SeamlessM4T's relative positions do), then places features at a placeholder check."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.positions = nn.Buffer(torch.zeros(1, 4))

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features):
        return input_ids == 9

    def forward(self, input_ids):
        if self.positions.shape[1] < input_ids.shape[1]:
            self.positions = torch.zeros(1, input_ids.shape[1], device=input_ids.device)
        embeds = self.embed(input_ids) + self.positions[:, :input_ids.shape[1], None]
        self.get_placeholder_mask(input_ids, embeds, torch.ones(6, 4, device=input_ids.device))
        return embeds


def test_counting_tokens_leaves_the_model_as_it_was():
    """The placeholder count runs the forward on a copy: a model that changes its own state as it
    runs reaches the planner's trace (and the dry run) unchanged."""
    from autoshard.inputs.image_inputs import count_at_check

    with torch.device("meta"):
        model = _GrowsItsPositions()
    assert count_at_check(model, {"input_ids": torch.ones(2, 8, dtype=torch.long)}) == 6
    assert model.positions.shape == (1, 4)
