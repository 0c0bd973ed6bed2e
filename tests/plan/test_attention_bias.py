"""Attention with a bias over its heads (ALiBi: Bloom, MPT, our own model's buffer or computed
bias; T5's relative position bias, an embedding over the heads) and multi-query attention (one KV head held by every rank): the tiny models' attention is
sharded, so that a rank holds at most 1/N + 0.1 of the parameters at N=2 (hidden 48, 6 heads,
2 layers). Exactness is checked by the conformance entries of the same models."""

import os
import sys
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.utils import logging

import autoshard
from autoshard.planner.sharding_plan import ShardingPlan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
from conformance_models import TinyDecoder  # noqa: E402

logging.set_verbosity_error()


def _hf(kind, head=AutoModelForCausalLM, **config):
    torch.manual_seed(0)
    return head.from_config(AutoConfig.for_model(kind, vocab_size=101, **config))


MODELS = {
    "bloom": lambda: _hf("bloom", hidden_size=48, n_layer=2, n_head=6),
    "mpt": lambda: _hf("mpt", d_model=48, n_layers=2, n_heads=6),
    "own_alibi_buffer": lambda: TinyDecoder(alibi="buffer"),
    "own_alibi_computed": lambda: TinyDecoder(alibi="computed"),
    "own_mqa": lambda: TinyDecoder(kv_heads=1),
    # One Linear holds the query heads and the one KV head: its KV parts are held whole (Falcon
    # picks them by list indexing, [..., [-2], :]).
    "falcon_mqa": lambda: _hf("falcon", hidden_size=48, num_hidden_layers=2, num_attention_heads=6, multi_query=True,
                              new_decoder_architecture=False),
    "gpt_bigcode_mqa": lambda: _hf("gpt_bigcode", n_embd=48, n_layer=2, n_head=6, n_positions=32, multi_query=True),
    "t5": lambda: _hf("t5", AutoModelForSeq2SeqLM, d_model=48, d_kv=8, d_ff=70, num_layers=2, num_decoder_layers=2,
                      num_heads=6),
}


def _example(name):
    return (torch.ones(2, 8, dtype=torch.long),) if name.startswith("own_") else None


def _held(name, build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(build(), world_size=2, example_inputs=_example(name))
    return plan, plan.held_fraction(0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_is_sharded(name):
    plan, held = _held(name, MODELS[name])
    assert held <= 0.6, f"{name}: rank 0 holds {held:.3f}\n{plan}"


ATTENTIONS = {"bloom": "transformer.h.{}.self_attention", "mpt": "transformer.blocks.{}.attn",
              "own_alibi_buffer": "blocks.{}.attn", "own_alibi_computed": "blocks.{}.attn"}


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_bias_is_cut_at_every_attention(name):
    plan, _ = _held(name, MODELS[name])
    assert [entry.module for entry in plan.head_entries] == [ATTENTIONS[name].format(i) for i in range(2)]
    for entry in plan.head_entries:  # in the attention's own region
        layers = [layer for layer in plan.layers if layer.module.startswith(entry.module + ".")]
        assert layers and all(layer.region == entry.region and layer.style != "replicate" for layer in layers)


def test_multi_query_kv_projection_is_held_by_every_rank():
    plan, _ = _held("own_mqa", MODELS["own_mqa"])
    for layer in plan.layers:
        if layer.module.endswith(("k_proj", "v_proj")):
            assert layer.style == "column" and layer.units == 1 and layer.repeat == 6
        if layer.module.endswith("q_proj"):
            assert layer.style == "column" and layer.units == 6


def test_relative_position_bias_is_cut_as_it_leaves_its_embedding():
    plan, _ = _held("t5", MODELS["t5"])
    assert sorted(entry.module for entry in plan.head_outputs) == [
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias" for stack in ("decoder", "encoder")]
    for name in ("encoder.block.1.layer.0.SelfAttention.q", "decoder.block.1.layer.1.EncDecAttention.o"):
        assert plan.layer(name).style != "replicate"


def test_head_cuts_round_trip_through_json():
    for name in ("bloom", "t5"):
        plan, _ = _held(name, MODELS[name])
        again = ShardingPlan.from_json(plan.to_json())
        assert (again.head_entries, again.head_outputs) == (plan.head_entries, plan.head_outputs)
        assert again.head_entries or again.head_outputs
