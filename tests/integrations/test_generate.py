"""Hugging Face generation on parallelized causal LMs with the default settings (sequence and
loss parallelism on), over 2 and 3 gloo ranks: greedy `generate` (with and without the KV
cache) gives the unsharded model's tokens and per-step scores, and `model(ids,
logits_to_keep=1)` its last-token logits. The model indexes the final hidden states' last
tokens before its head; the plan gathers the tokens before that indexing
(csrc/plan/token_indexing.cpp), and decoding steps hold fewer tokens than there are ranks."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import autoshard

from multirank import run_on_ranks

# 4 query heads over 2 KV heads (split 2/1/1 on 3 ranks: KV heads shared unevenly) and 6 over 3.
CONFIGS = {
    "llama": ("llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)),
    "llama_6_heads": ("llama", dict(hidden_size=48, intermediate_size=70, num_attention_heads=6,
                                    num_key_value_heads=3)),
    "qwen2_6_heads": ("qwen2", dict(hidden_size=48, intermediate_size=70, num_attention_heads=6,
                                    num_key_value_heads=3)),
}
# Gated-delta-net layers beside full attention: decoding steps go through the mixers' cached
# path (the conv state and the recurrent state, made at each rank's heads), which the plan's
# trace of a whole prompt never ran. 3 key heads over 6 value heads.
LINEAR_ATTENTION = dict(hidden_size=48, intermediate_size=70, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                        linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8,
                        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
LINEAR_CONFIGS = {
    "qwen3_5_text": ("qwen3_5_text", LINEAR_ATTENTION),
    # An expert FFN of 64 float32 features: split in groups of 16 bytes, as the grouped matmul needs.
    "qwen3_next": ("qwen3_next", dict(LINEAR_ATTENTION, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64)),
}
CONFIGS.update(LINEAR_CONFIGS)
PROMPT = 7  # tokens: no rank count here divides it


def _build(name: str) -> nn.Module:
    kind, sizes = CONFIGS[name]
    config = AutoConfig.for_model(kind, num_hidden_layers=2, vocab_size=256, attention_dropout=0.0, **sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _generate(model: nn.Module, ids: torch.Tensor, use_cache: bool):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False, use_cache=use_cache, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def _check(name: str) -> dict:
    reference, sharded = _build(name), _build(name)
    autoshard.parallelize(sharded)  # the defaults: sequence_parallel=True, loss_parallel=True
    plan = sharded.autoshard_state.plan
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = reference(ids, logits_to_keep=1).logits, sharded(ids, logits_to_keep=1).logits
        assert got.shape == want.shape == (2, 1, 256)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for use_cache in (True, False):
            want_tokens, want_scores = _generate(reference, ids, use_cache)
            tokens, scores = _generate(sharded, ids, use_cache)
            assert torch.equal(tokens, want_tokens), (use_cache, tokens, want_tokens)
            assert tokens.shape == (2, PROMPT + 8)
            torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)
    return {"roles": sorted({layer.sequence for layer in plan.layers if layer.sequence}),
            "exits": [entry.module for entry in plan.sequence_exits], "plan": str(plan)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(LINEAR_CONFIGS))
def test_generate_through_linear_attention_matches_the_unsharded_model(name, world_size):
    result = run_on_ranks(_check, world_size, name, timeout=600)[0]
    # The mixers are split: their convolution's taps with their heads.
    assert "linear_attn.conv1d.weight" in result["plan"], result["plan"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", [name for name in CONFIGS if name not in LINEAR_CONFIGS])
def test_generate_matches_the_unsharded_model(name, world_size):
    result = run_on_ranks(_check, world_size, name, timeout=600)[0]
    # The case this is about is really planned: tokens split between the layers, and the
    # head's gather made where the final norm returns them (4 query heads over 2 KV heads
    # included, split 2/1/1 at 3 ranks).
    assert result["roles"] == ["gathered", "reduce_scatter"], result["plan"]
    assert result["exits"] == ["model.norm"], result["plan"]


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h):
        # A scaling first, as a norm would: the layer gathers a tensor only it reads.
        return h + self.down(torch.relu(self.up(0.5 * h)))


class _LastTokens(nn.Module):
    """Blocks, then the head reads the last `keep` tokens as transformers' heads do; with
    `squash` the blocks' output passes an op of the model's own forward first, so that no
    module returns the tokens the indexing reads."""

    def __init__(self, squash: bool, width: int = 16, vocab: int = 32):
        super().__init__()
        self.squash = squash
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, keep: int = 0):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        if self.squash:
            h = torch.tanh(h)
        return self.head(h[:, slice(-keep, None), :])


def test_indexing_of_tokens_no_module_returns_gives_up_sequence_parallelism():
    ids = torch.zeros(2, 6, dtype=torch.long)
    returned = autoshard.plan(_LastTokens(squash=False), world_size=2, example_inputs=(ids,))
    assert [e.module for e in returned.sequence_exits] == ["blocks.1"], str(returned)
    assert returned.layer("head").sequence == "gathered", str(returned)
    squashed = autoshard.plan(_LastTokens(squash=True), world_size=2, example_inputs=(ids,))
    assert not any(layer.sequence for layer in squashed.layers) and not squashed.sequence_exits, str(squashed)
    assert "aten.alias.default indexes the token axis" in str(squashed)
    assert "no module returns the tokens it reads" in str(squashed)


def _toy_exact(squash: bool) -> float:
    torch.manual_seed(0)
    reference = _LastTokens(squash)
    torch.manual_seed(0)
    sharded = autoshard.parallelize(_LastTokens(squash), example_inputs=(torch.zeros(2, 6, dtype=torch.long),))
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return max((sharded(ids, keep) - reference(ids, keep)).abs().max().item() for keep in (0, 1, 2))


@pytest.mark.parametrize("squash", [False, True])
def test_toy_model_last_tokens_match_the_unsharded_model(squash):
    errors = run_on_ranks(_toy_exact, 2, squash, timeout=300)
    assert max(errors) < 1e-5, errors


def _sample(model: nn.Module, ids: torch.Tensor, **settings) -> tuple:
    """Seeded sampling from `model`, and the global generator's next draw after it (a later
    shuffle or sample of the same seeded run)."""
    torch.manual_seed(11)
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                            do_sample=True, pad_token_id=0, **settings)
    return tokens, torch.rand(4)


SAMPLING = {"plain": {}, "top_k": {"top_k": 20, "temperature": 0.7}, "top_p": {"top_p": 0.9, "temperature": 1.3}}


def _seeded_sampling(train_first: bool) -> dict:
    """The unsharded model and one parallelized in evaluation mode (as from_pretrained returns
    it), or in training mode and then switched to evaluation, sample the same tokens from the
    same seed, and leave the global generator alike."""
    reference, sharded = _build("llama"), _build("llama")  # both in eval mode
    if train_first:
        sharded.train()
    autoshard.parallelize(sharded)
    flags_kept = all(not module.training for module in sharded.modules())
    if train_first:
        flags_kept = all(module.training for module in sharded.modules())
        sharded.eval()
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    differ = []
    for name, settings in SAMPLING.items():
        want_tokens, want_next = _sample(reference, ids, **settings)
        tokens, following = _sample(sharded, ids, **settings)
        if not torch.equal(tokens, want_tokens):
            differ.append(f"{name}: tokens {tokens.tolist()} where the unsharded model gives {want_tokens.tolist()}")
        if not torch.equal(following, want_next):
            differ.append(f"{name}: the generator's next draw after sampling differs")
    return {"flags_kept": flags_kept, "differ": differ}


@pytest.mark.parametrize("train_first", [False, True], ids=["parallelized-in-eval", "train-then-eval"])
def test_seeded_sampling_gives_the_unsharded_models_tokens(train_first):
    for rank, result in enumerate(run_on_ranks(_seeded_sampling, 2, train_first, timeout=600)):
        assert result["flags_kept"], f"rank {rank}: parallelize changed a module's training flag"
        assert result["differ"] == [], f"rank {rank}: {result['differ']}"


class _DropoutFree(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.dropout(torch.relu(self.up(x)), p=0.0, training=self.training))


def _draws_after_training_steps() -> list:
    torch.manual_seed(0)
    model = autoshard.parallelize(_DropoutFree().train(), example_inputs=(torch.ones(2, 8),))
    torch.manual_seed(5)
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
    return torch.rand(3).tolist()


def test_a_training_forward_without_dropout_leaves_the_global_generator_alone():
    torch.manual_seed(5)
    want = torch.rand(3).tolist()
    for rank, got in enumerate(run_on_ranks(_draws_after_training_steps, 2, timeout=300)):
        assert got == want, f"rank {rank}: the generator moved in forwards that draw nothing"


def _deterministic_decoding() -> list:
    """Beam search, a static cache and left-padded prompts on the unsharded model and on one
    parallelized with the defaults: the names of the settings whose tokens differ."""
    reference, sharded = _build("llama"), _build("llama")
    autoshard.parallelize(sharded)
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    padded = ids.clone()
    padded[0, :3] = 0  # the first prompt is 3 tokens shorter, padded on the left
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    settings = {"beams": dict(num_beams=3, do_sample=False),
                "static cache": dict(do_sample=False, cache_implementation="static"),
                "left padding": dict(do_sample=False, input_ids=padded, attention_mask=mask)}
    differ = []
    for name, setting in settings.items():
        setting = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **setting}
        tokens = [m.generate(**setting, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
                  for m in (reference, sharded)]
        if not torch.equal(*tokens):
            differ.append(f"{name}: {tokens[1].tolist()} where the unsharded model gives {tokens[0].tolist()}")
    return differ


def test_beams_static_cache_and_left_padding_give_the_unsharded_models_tokens():
    for rank, differ in enumerate(run_on_ranks(_deterministic_decoding, 2, timeout=600)):
        assert differ == [], f"rank {rank}: {differ}"
