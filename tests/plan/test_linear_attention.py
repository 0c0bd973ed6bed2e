"""Gated-delta-net mixers split by heads (docs/constructs.md, "Linear-attention mixers"): the
depthwise convolution's weight over q, k and v of different widths is split part by part (with
Qwen3.5's fused in_proj_qkv, or with OLMo-hybrid's concatenation of separate projections), so
the whole model each rank's slices make again must be the unsharded one, and a checkpoint saved
on 2 ranks must reload on 3 and unsharded. The forward, every gradient and optimizer steps are
checked against the unsharded model in the conformance table (qwen3_5_gated_delta_net,
olmo_hybrid_gated_delta_net, qwen3_next_gated_delta_net)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging

import autoshard
from checkpoint_round_trip import load, train_and_save
from multirank import run_on_ranks

logging.set_verbosity_error()

# 3 key heads over 6 value heads: uneven at 2 ranks for the key heads' parts.
MIXER = dict(vocab_size=101, hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
             head_dim=8, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8,
             linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
MODELS = {
    "qwen3_5_text": dict(MIXER, num_key_value_heads=3),
    "olmo_hybrid": dict(MIXER, num_key_value_heads=6, linear_num_key_heads=6, pad_token_id=0),
}


def _build(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **MODELS[name]))


def _full_state(name: str) -> dict:
    model = autoshard.parallelize(_build(name))
    conv, local = next((n, p) for n, p in model.named_parameters() if n.endswith("linear_attn.conv1d.weight"))
    return {"full": {n: v.clone() for n, v in autoshard.full_state_dict(model).items()},
            "local_conv": (conv, tuple(local.shape))}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_ranks_slices_make_the_unsharded_model_again(name, world_size):
    results = run_on_ranks(_full_state, world_size, name, timeout=600)
    want = _build(name).state_dict()
    conv, _ = results[0]["local_conv"]
    # The convolution's weight is really split (each rank holds fewer channels than the model).
    assert all(r["local_conv"][1][0] < want[conv].shape[0] for r in results), [r["local_conv"] for r in results]
    for result in results:
        assert result["full"].keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(result["full"][key], value), key


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_on_two_ranks_reloads_on_three_and_unsharded(tmp_path, name):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(train_and_save, 2, path, _build, name, timeout=600)[0]
    conv = next(n for n in saved if n.endswith("linear_attn.conv1d.weight"))
    assert not torch.equal(saved[conv], _build(name).state_dict()[conv])  # the step changed it
    for loaded in (run_on_ranks(load, 3, path, _build, name, timeout=600)[0], load(path, _build, name, sharded=False)):
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
