"""Tiny Hugging Face models built from configs (random weights, nothing downloaded), with
sizes that divide nothing evenly: 5 or 6 heads, odd hidden and vocabulary sizes."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.utils import logging

logging.set_verbosity_error()

MASKED_LM = {"bert", "roberta"}

# Each has a head count that 2, 3 and 4 ranks do not all divide.
CONFIGS = {
    "gpt2": dict(n_embd=60, n_layer=2, n_head=5, vocab_size=101, n_positions=32,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_size=60, num_hidden_layers=2, num_attention_heads=5, intermediate_size=70, vocab_size=101,
                 max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "roberta": dict(hidden_size=60, num_hidden_layers=2, num_attention_heads=5, intermediate_size=70, vocab_size=101,
                    max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "opt": dict(hidden_size=60, num_hidden_layers=2, num_attention_heads=5, ffn_dim=70, vocab_size=101,
                max_position_embeddings=32, word_embed_proj_dim=60, dropout=0.0, attention_dropout=0.0),
    # Grouped-query attention: 6 query heads over 3 KV heads.
    "llama": dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=3, vocab_size=101, attention_dropout=0.0),
    # Multi-query attention: 5 query heads and one KV head in one fused Linear.
    "gpt_bigcode": dict(n_embd=60, n_layer=2, n_head=5, vocab_size=101, n_positions=32, multi_query=True,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # Tied input and output embeddings.
    "gemma": dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=8, vocab_size=101, attention_dropout=0.0),
}

# The heads a plan must keep whole: query heads and KV heads.
HEADS = {"gpt2": (5,), "gpt_bigcode": (5,), "bert": (5,), "roberta": (5,), "opt": (5,), "llama": (6, 3), "gemma": (6, 3)}


def from_config(model_class, kind: str, **config):
    """A `model_class` (an ``AutoModelFor...``) of `kind` from a config with these settings and
    eager attention, its weights drawn from torch's generator as it stands."""
    config = AutoConfig.for_model(kind, **config)
    config._attn_implementation = "eager"
    return model_class.from_config(config)


def build(kind: str, device="cpu", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls = AutoModelForMaskedLM if kind in MASKED_LM else AutoModelForCausalLM
    with torch.device(device):
        model = from_config(cls, kind, **{**CONFIGS[kind], **overrides})
    return model.float().eval()


def layer_count(kind: str) -> int:
    config = CONFIGS[kind]
    return config.get("n_layer", config.get("num_hidden_layers"))
