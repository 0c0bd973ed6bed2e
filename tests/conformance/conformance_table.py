"""The conformance table: one line per architecture, each checked at 2, 3 and 4 ranks.

    Arch(name, builder, inputs, small=..., xfail=..., refused=..., fp64=..., planning=...)

- `small`: also in the matrix `make test` runs (True: at 2 and 3 ranks; or a tuple of world
  sizes); the rest runs with `make conformance`.
- `xfail`: an `Xfail(symptom, reason)` (or `{world_size: Xfail}`) for a known wrong result on
  main; strict, so the entry must be fixed by removing it once the planner computes the model.
- `refused`: a regex (or `{world_size: regex}`) of the error plan()/parallelize() is expected to
  raise: refusing a model it cannot shard exactly is a conforming outcome.
- `fp64`: gradients in float64 (every op here supports it); False compares in float32.
- `planning`: how the plan gets its example inputs. "plan": `autoshard.plan(model,
  example_inputs=inputs)` then `parallelize(model, plan)`; "parallelize":
  `parallelize(model, example_inputs=inputs)`; "auto": `parallelize(model)`, the inputs made
  from the model's config. `inputs` always drive the checked forward and backward.
- `plan_says`: a regex (or `{world_size: regex}`) that `print(plan)` must match: the plan says
  what it did with the idiom the model is written in, in words that name it.
- `tolerance`: in place of the harness's for the entry's dtype, for a model that computes
  part of its forward in float32 whatever its dtype.

Sizes are chosen so that 2, 3 and 4 ranks do not all divide them: 6 heads (3 KV heads with
grouped-query attention), hidden 48 (head_dim 8), intermediate 70, vocabulary 101.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

import conformance_sweep_sample
from conformance_builders import (audio_beside_text, audio_features, features, hf, idiom, own, own_multihead, pixels, seq2seq_ids, token_ids,
                                  token_ids_and_encoder_states, token_ids_and_labels)
from conformance_harness import GradientMismatch, LogitsMismatch, Refused

WORLD_SIZES = (2, 3, 4)
SMALL_WORLD_SIZES = (2, 3)


@dataclass(frozen=True)
class Xfail:
    symptom: type  # the ConformanceFailure subclass the check raises
    reason: str


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable
    inputs: Callable
    small: Any = False  # bool, or the world sizes of the small matrix
    xfail: Any = None  # Xfail, or {world_size: Xfail}
    refused: Any = None  # regex, or {world_size: regex}
    fp64: bool = True
    planning: str = "plan"  # "plan", "parallelize" or "auto"
    tolerance: Optional[dict] = None  # dict(rtol=..., atol=...)
    plan_says: Any = None  # regex, or {world_size: regex}

    world_sizes: tuple = WORLD_SIZES  # where the full matrix checks it

    def small_at(self, world_size: int) -> bool:
        return world_size in (self.small if isinstance(self.small, tuple) else SMALL_WORLD_SIZES if self.small else ())

    def plan_says_at(self, world_size: int) -> Optional[str]:
        return self.plan_says.get(world_size) if isinstance(self.plan_says, dict) else self.plan_says

    def xfail_at(self, world_size: int) -> Optional[Xfail]:
        return self.xfail.get(world_size) if isinstance(self.xfail, dict) else self.xfail


# Defect 1 of the soundness issue: a replicated parameter applied inside a sharded region gets
# only its rank's part of the gradient. The forward is exact; the gradient and the step are not.
PARTIAL_GRAD = "replicated parameter inside the sharded head/feature region gets a partial gradient"
QK_NORM = Xfail(GradientMismatch, "QK-norm: the RMSNorm weight over head_dim is " + PARTIAL_GRAD)
# Defect 2: an integer attribute equal to a head count by coincidence is made local.
ROTARY = Xfail(LogitsMismatch, "rotary_dim equals the KV head count and is localised: fewer features rotated")
QK_LAYERNORM = Xfail(GradientMismatch, "qk_layernorm: the LayerNorm weight and bias over head_dim are a " + PARTIAL_GRAD)
# head_dim equal to the query head count is made local too, and the sharded view then fails.
HEAD_DIM = Xfail(Refused, "head_dim equals the query head count and is localised: the meta dry run fails")


# Models whose RMSNorm computes in float32 (`.to(torch.float32)`) even in a float64 model: the
# QK-norm's gradients, summed over heads in another order once sharded (on 4 ranks, partial
# per holder of a shared KV head), agree to float32's precision. The defects show at 1e-3.
NORM_IN_FP32 = dict(rtol=1e-5, atol=1e-6)
# Cohere applies its rotary embedding in float32 (`q.float()`) even in a float64 model; with its
# attention split by heads (its rotary pairs features with stack and flatten), the rounding of
# q and k to float32 differs where the sharded sums differ in their last float64 bits.
ROTARY_IN_FP32 = NORM_IN_FP32
# OLMo 2's q_norm and k_norm span every head's features, in float32 even in a float64 model:
# split by heads, each rank's sum of squares is summed over the ranks in another order, and the
# scale's last float32 bit reaches every gradient of the attention (3.5e-6 on gradients of
# magnitude 26 at 2 ranks). tests/plan/test_split_norms.py checks the same split exactly in
# float64 with a norm that computes in its input's dtype.
NORM_ACROSS_HEADS_IN_FP32 = dict(rtol=1e-5, atol=1e-5)

# Mixture-of-experts models run in fp32 (the default grouped matmul has no fp64 CPU kernel):
# every gradient summed over the ranks in another order differs by fp32 rounding, seen up to
# 1.2e-5 on gradients of magnitude 35 (embeddings, through two blocks). The eager expert loop
# is checked at fp64 (mixtral_eager), where such errors are below 1e-13; defects show at 1e-3.
MOE_FP32 = dict(rtol=1e-4, atol=5e-5)

# OLMo-hybrid's gated delta rule and DeepSeek-V3's norms run in float32 inside a float64 model:
# summed over the ranks in another order, gradients differ by up to 1e-7 of a tensor's largest
# value (7e-6 where they reach 60).
FP32_INSIDE_OF_LARGEST = dict(rtol=1e-6, atol=1e-6, of_largest=True)

L, H, KV, I = 2, 6, 3, 70  # layers, heads, KV heads, intermediate size
LLAMA_LIKE = dict(hidden_size=48, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=KV)
BERT_LIKE = dict(hidden_size=48, num_hidden_layers=L, num_attention_heads=H, intermediate_size=I,
                 max_position_embeddings=32)

TABLE = [
    # ---- Hugging Face decoders
    Arch("gpt2", hf("gpt2", n_embd=48, n_layer=L, n_head=H, n_positions=32), token_ids(), small=True),
    Arch("llama", hf("llama", **LLAMA_LIKE), token_ids(), small=True),
    Arch("gemma", hf("gemma", **LLAMA_LIKE, head_dim=8), token_ids()),
    Arch("gemma2", hf("gemma2", **LLAMA_LIKE, head_dim=8, sliding_window=4), token_ids()),
    Arch("gemma3", hf("gemma3_text", **LLAMA_LIKE, head_dim=8, sliding_window=4), token_ids(),
         tolerance=NORM_IN_FP32),
    Arch("mistral", hf("mistral", **{**LLAMA_LIKE, "num_key_value_heads": 2}), token_ids()),
    # 4 query heads over 2 KV heads at 3 ranks: query heads 2/1/1, so repeat_kv's n_rep is 2 on
    # rank 0 and 1 (no expand at all) on the others, while 2 is also the KV head count.
    Arch("mistral_4_over_2", hf("mistral", hidden_size=64, intermediate_size=I, num_hidden_layers=L,
                                num_attention_heads=4, num_key_value_heads=2), token_ids(), small=(3,)),
    Arch("qwen2", hf("qwen2", **LLAMA_LIKE), token_ids()),
    Arch("qwen3", hf("qwen3", **LLAMA_LIKE, head_dim=8), token_ids(), small=True, tolerance=NORM_IN_FP32),
    # Gated-delta-net layers (linear attention) beside full attention: q, k and v from one Linear
    # through a depthwise convolution applied with F.conv1d, 3 key heads over 6 value heads.
    Arch("qwen3_5_gated_delta_net", hf("qwen3_5_text", **LLAMA_LIKE, head_dim=8, linear_num_key_heads=3,
                                       linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                                       layer_types=["linear_attention", "full_attention"]),
         token_ids(), small=True, tolerance=NORM_IN_FP32,
         # 3 key heads do not go round 4 ranks: the mixer stays whole there, saying why.
         plan_says={2: r"split with their heads: .*conv1d\.weight", 3: r"split with their heads: .*conv1d\.weight",
                    4: r"linear_attn\.in_proj_qkv +replicate .*fused output"}),
    # Qwen3-Next's mixer: q, k, v and z of each key head's group interleaved in one Linear, taken
    # apart per group, then q, k and v concatenated for the convolution and split again.
    Arch("qwen3_next_gated_delta_net", hf("qwen3_next", **LLAMA_LIKE, head_dim=8, linear_num_key_heads=3,
                                          linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                                          layer_types=["linear_attention", "full_attention"], num_experts=3,
                                          num_experts_per_tok=2, moe_intermediate_size=I,
                                          shared_expert_intermediate_size=I, experts_implementation="eager"),
         token_ids(), tolerance=NORM_IN_FP32,
         plan_says={2: r"split with their heads: .*conv1d\.weight", 3: r"split with their heads: .*conv1d\.weight"}),
    # OLMo-hybrid's: separate q, k and v projections concatenated for one convolution over all
    # of them (the convolution's weight split part by part as the concatenation's).
    Arch("olmo_hybrid_gated_delta_net", hf("olmo_hybrid", **{**LLAMA_LIKE, "num_key_value_heads": H},
                                           linear_num_key_heads=H, linear_num_value_heads=H, linear_key_head_dim=4,
                                           linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                                           pad_token_id=0),
         token_ids(), small=True, tolerance=FP32_INSIDE_OF_LARGEST, plan_says=r"split with their heads: .*conv1d\.weight"),
    # Multi-head latent attention without a query LoRA (DeepSeek-V2-Lite's, Sarvam's): kv_a_proj
    # held whole, its output read by kv_b_proj (split by heads) and, as k_pe, broadcast to the
    # rank's heads; the gradient of kv_a_proj's output is summed where it returns it, once.
    Arch("deepseek_v3_mla", hf("deepseek_v3", hidden_size=48, intermediate_size=I, num_hidden_layers=L,
                               num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None, kv_lora_rank=16,
                               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=L,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
         token_ids(), small=True, tolerance=FP32_INSIDE_OF_LARGEST,
         plan_says=r"output gradients summed where .*kv_a_proj_with_mqa"),
    Arch("phi", hf("phi", **LLAMA_LIKE, partial_rotary_factor=0.5), token_ids()),
    # Phi-3 slices q, k and v from its fused qkv_proj at config.num_attention_heads * head_dim.
    Arch("phi3", hf("phi3", **LLAMA_LIKE, pad_token_id=0), token_ids(), small=True),
    Arch("phi3_mha", hf("phi3", **{**LLAMA_LIKE, "num_key_value_heads": H}, pad_token_id=0), token_ids()),
    Arch("falcon", hf("falcon", hidden_size=48, num_hidden_layers=L, num_attention_heads=H, multi_query=False,
                      new_decoder_architecture=False), token_ids()),
    Arch("gpt_neox", hf("gpt_neox", hidden_size=48, num_hidden_layers=L, num_attention_heads=H,
                        intermediate_size=I, rotary_pct=0.5), token_ids()),
    # ALiBi made from the mask, (batch * heads, 1, keys): cut to each rank's heads in every attention.
    Arch("bloom", hf("bloom", hidden_size=48, n_layer=L, n_head=H), token_ids(), small=True),
    # ALiBi made in forward, (heads, 1, max_seq_len), sliced inside the attention after the cut.
    Arch("mpt", hf("mpt", d_model=48, n_layers=L, n_heads=H), token_ids(), small=True),
    # Multi-query attention; FalconLinear (a forward of its own) keeps its layers whole.
    Arch("falcon_mqa", hf("falcon", hidden_size=48, num_hidden_layers=L, num_attention_heads=H, multi_query=True,
                          new_decoder_architecture=False), token_ids()),
    # Rotates pairs of even and odd features with stack and flatten.
    Arch("gptj", hf("gptj", n_embd=48, n_layer=L, n_head=H, n_positions=32, rotary_dim=4), token_ids(), small=True),
    Arch("olmo", hf("olmo", **LLAMA_LIKE), token_ids()),
    Arch("olmo2", hf("olmo2", **LLAMA_LIKE), token_ids(), tolerance=NORM_ACROSS_HEADS_IN_FP32),
    Arch("starcoder2", hf("starcoder2", **LLAMA_LIKE), token_ids()),
    Arch("opt", hf("opt", hidden_size=48, num_hidden_layers=L, num_attention_heads=H, ffn_dim=I,
                   max_position_embeddings=32, word_embed_proj_dim=48), token_ids()),
    # Its default partial_rotary_factor=0.25 gives rotary_ndims=2 at head_dim 8, equal to
    # num_key_value_groups (6 query / 3 KV heads) on 4 ranks, where KV heads are shared.
    Arch("stablelm", hf("stablelm", **LLAMA_LIKE), token_ids(), small=(4,)),
    Arch("persimmon", hf("persimmon", hidden_size=48, intermediate_size=I, num_hidden_layers=L,
                         num_attention_heads=H), token_ids()),
    Arch("cohere", hf("cohere", **LLAMA_LIKE), token_ids(), tolerance=ROTARY_IN_FP32),
    Arch("granite", hf("granite", **LLAMA_LIKE), token_ids()),
    # Mixture of experts under the default expert implementation (grouped_mm): its CPU kernel
    # takes fp32 (not fp64) with 16-byte strides, so every rank's FFN slice (96 features: 48,
    # 32 or 24 per rank) is a multiple of 4.
    Arch("mixtral", hf("mixtral", **{**LLAMA_LIKE, "intermediate_size": 96}, num_local_experts=3,
                        num_experts_per_tok=2), token_ids(), small=True, fp64=False, tolerance=MOE_FP32),
    # An FFN of 64 features, whose even split at 3 ranks (22, 21, 21) would put the grouped
    # matmul's rows off its 16-byte boundary: split in groups of 4 float32s (24, 20, 20) instead.
    Arch("mixtral_ffn_64", hf("mixtral", **{**LLAMA_LIKE, "intermediate_size": 64}, num_local_experts=3,
                               num_experts_per_tok=2), token_ids(), small=(3,), fp64=False, tolerance=MOE_FP32),
    # The eager loop over experts (nonzero on the routing), with an uneven FFN split, in fp64.
    Arch("mixtral_eager", hf("mixtral", **LLAMA_LIKE, num_local_experts=3, num_experts_per_tok=2,
                              experts_implementation="eager"), token_ids()),
    # The batched implementation (each routed token's expert weights gathered, then bmm), fp64.
    Arch("mixtral_batched", hf("mixtral", **LLAMA_LIKE, num_local_experts=3, num_experts_per_tok=2,
                                experts_implementation="batched_mm"), token_ids()),
    # gpt-oss's experts: gate and up interleaved on the FFN axis (split in (gate, up) pairs, 70
    # of them: uneven at 3 and 4 ranks), a bias per expert on each side (the out bias added by
    # one rank), a clamped gate; the eager loop and the batched implementation, in fp64.
    Arch("gpt_oss_eager", hf("gpt_oss", **LLAMA_LIKE, head_dim=8, num_local_experts=3, num_experts_per_tok=2,
                              sliding_window=4, experts_implementation="eager"), token_ids(), small=(2, 3),
         plan_says=r"mlp\.experts +column"),
    Arch("gpt_oss_batched", hf("gpt_oss", **LLAMA_LIKE, head_dim=8, num_local_experts=3, num_experts_per_tok=2,
                                sliding_window=4, experts_implementation="batched_mm"), token_ids()),
    # A shared expert (plain Linear layers) beside the routed ones, and the default implementation.
    Arch("qwen2_moe", hf("qwen2_moe", **LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                          shared_expert_intermediate_size=40), token_ids(), small=True, fp64=False,
         tolerance=MOE_FP32),
    Arch("gpt_bigcode", hf("gpt_bigcode", n_embd=48, n_layer=L, n_head=H, n_positions=32, multi_query=False),
         token_ids()),
    # Multi-query attention in one fused c_attn (query heads, then the one KV head's k and v).
    Arch("gpt_bigcode_mqa", hf("gpt_bigcode", n_embd=48, n_layer=L, n_head=H, n_positions=32, multi_query=True),
         token_ids()),
    Arch("codegen", hf("codegen", n_embd=64, n_layer=L, n_head=8, n_positions=32, rotary_dim=4), token_ids()),
    Arch("biogpt", hf("biogpt", **BERT_LIKE), token_ids()),
    Arch("xglm", hf("xglm", d_model=48, num_layers=L, attention_heads=H, ffn_dim=I, max_position_embeddings=32),
         token_ids(), fp64=False),  # its mask fills with float32's minimum
    # ---- Hugging Face encoders
    Arch("bert", hf("bert", "masked", **BERT_LIKE), token_ids(), small=True),
    Arch("roberta", hf("roberta", "masked", **BERT_LIKE, pad_token_id=0), token_ids()),
    Arch("xlm_roberta", hf("xlm-roberta", "masked", **BERT_LIKE, pad_token_id=0), token_ids()),
    Arch("electra", hf("electra", "masked", **BERT_LIKE, embedding_size=48), token_ids()),
    Arch("distilbert", hf("distilbert", "masked", dim=48, n_layers=L, n_heads=H, hidden_dim=I,
                          max_position_embeddings=32), token_ids()),
    Arch("albert", hf("albert", "masked", **BERT_LIKE, embedding_size=16), token_ids()),
    # RemBERT keeps all_head_size on its attention's `self` submodule, below the region's module.
    Arch("rembert", hf("rembert", "masked", **BERT_LIKE, input_embedding_size=16, output_embedding_size=16),
         token_ids()),
    # DeBERTa's forward checks input_ids for padding (`pad_token_id in input_ids[:, [-1, 0]]`);
    # its q_bias and v_bias (all_head_size, added to the query and value heads) are split with them.
    Arch("deberta", hf("deberta", "masked", **BERT_LIKE), token_ids(), planning="auto"),
    Arch("clip_text", hf("clip_text_model", "base", **BERT_LIKE), token_ids(), small=True, planning="auto"),
    Arch("vit", hf("vit", "base", **BERT_LIKE, image_size=8, patch_size=4, num_channels=3), pixels(3, 8),
         small=True, planning="auto"),
    # CLIP's vision tower: its patch embedding (a convolution over pixels, which carry no gradient)
    # feeds a cat with the class embedding and a LayerNorm over all features: split on its output
    # channels and gathered, where it was held whole.
    Arch("clip_vision", hf("clip_vision_model", "base", **BERT_LIKE, image_size=8, patch_size=4, num_channels=3),
         pixels(3, 8), small=True, plan_says=r"patch_embedding +column_gather"),
    # BatchNorms between a column convolution and its row partner, split with the channels
    # (MobileNet's inverted residuals, with depthwise convolutions between; RegNet's grouped ones).
    Arch("mobilenet_v2", hf("mobilenet_v2", "base", depth_multiplier=0.25, image_size=16), pixels(3, 16),
         plan_says=r"BatchNorms split with their channels"),
    Arch("regnet", hf("regnet", "base", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4),
         pixels(3, 16), plan_says=r"BatchNorms split with their channels"),
    # ResNet's bottlenecks: the last convolution of each and the shortcut add into the residual
    # stream, which stays whole. On 3 and 4 ranks that would leave a rank more than 1/N + 10% of
    # the parameters: the large ones are split on their output channels and gathered (their input
    # gradient summed in backward), the small ones held whole.
    Arch("resnet", hf("resnet", "base", embedding_size=8, hidden_sizes=[16, 40], depths=[1, 2],
                      layer_type="bottleneck"),
         pixels(3, 16), small=True,
         plan_says={n: r"convolution +column_gather .*gathered: its output aten\.add" for n in (3, 4)}),
    Arch("vit_example_inputs", hf("vit", "base", **BERT_LIKE, image_size=8, patch_size=4, num_channels=3),
         pixels(3, 8)),
    # ---- Hugging Face encoder-decoders
    Arch("bart", hf("bart", "seq2seq", d_model=48, encoder_layers=1, decoder_layers=1, encoder_attention_heads=H,
                    decoder_attention_heads=H, encoder_ffn_dim=I, decoder_ffn_dim=I, max_position_embeddings=32),
         seq2seq_ids(), small=True, planning="auto"),
    Arch("bart_example_inputs", hf("bart", "seq2seq", d_model=48, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=I,
                                   decoder_ffn_dim=I, max_position_embeddings=32),
         seq2seq_ids(), planning="parallelize"),
    # A decoder alone (BartForCausalLM) with its cross-attention: the plan's own inputs carry
    # encoder_hidden_states, so the cross-attention is traced and split by heads.
    Arch("bart_decoder_cross_attention", hf("bart", d_model=48, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=I,
                                            decoder_ffn_dim=I, max_position_embeddings=32),
         token_ids_and_encoder_states(48), small=True, planning="auto",
         plan_says=r"encoder_attn\.k_proj +column"),
    Arch("t5", hf("t5", "seq2seq", d_model=48, d_kv=8, d_ff=I, num_layers=1, num_decoder_layers=1, num_heads=H),
         seq2seq_ids(), small=True, planning="auto"),
    # Two blocks per stack: the first attention's relative position bias (cut to each rank's heads
    # as it leaves its embedding) is passed on to the second, whose heads it then shares.
    Arch("t5_two_layers", hf("t5", "seq2seq", d_model=48, d_kv=8, d_ff=I, num_layers=2, num_decoder_layers=2,
                             num_heads=H), seq2seq_ids(), small=True),
    Arch("t5_example_inputs", hf("t5", "seq2seq", d_model=48, d_kv=8, d_ff=I, num_layers=1, num_decoder_layers=1,
                                 num_heads=H), seq2seq_ids()),
    # In-place masking of the scores (XLM: scores.masked_fill_(mask, min)), split by heads.
    Arch("xlm", hf("xlm", emb_dim=48, n_layers=L, n_heads=H, max_position_embeddings=32), token_ids(), small=True,
         plan_says=r"attentions\.0(-1)?\.q_lin +column"),
    # Local attention over blocks of tokens padded with F.pad (LongT5), split by heads. At 4 ranks
    # a rank with one of the 6 heads traces a unit axis where the plan predicts another order:
    # the dry run keeps that attention whole (still exact).
    Arch("longt5_local", hf("longt5", "seq2seq", d_model=48, d_kv=8, d_ff=I, num_layers=1, num_decoder_layers=1,
                            num_heads=H, local_radius=2, encoder_attention_type="local"), seq2seq_ids(),
         plan_says={2: r"LocalSelfAttention\.q +column", 3: r"LocalSelfAttention\.q +column"}),
    Arch("whisper", hf("whisper", "speech", d_model=48, encoder_layers=1, decoder_layers=1,
                       encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=I, decoder_ffn_dim=I,
                       num_mel_bins=8, max_source_positions=8, max_target_positions=16, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
         audio_features(8, 16), small=True, planning="auto"),
    # A model of text and audio planned on the audio autoshard makes beside the text (features
    # of 8 mel bins x 16 frames, 4 audio tokens per sample): the audio tower is traced and split.
    Arch("qwen2_audio", hf("qwen2_audio", "base",
                           audio_config=dict(d_model=48, encoder_layers=1, encoder_attention_heads=H, encoder_ffn_dim=I,
                                             num_mel_bins=8, max_source_positions=8),
                           text_config=dict(model_type="qwen2", hidden_size=48, num_hidden_layers=1,
                                            num_attention_heads=H, num_key_value_heads=2, intermediate_size=I,
                                            vocab_size=97),
                           audio_token_index=96),
         audio_beside_text(96, 8, 16, 4, "feature_attention_mask"), small=(2,), planning="auto",
         plan_says=r"audio_tower\.layers\.0\.self_attn\.q_proj +column"),
    # ---- our own: the control, then one model per defect class of the soundness issue
    Arch("own_plain", own(), token_ids(97), small=True),
    Arch("own_plain_parallelize_inputs", own(), token_ids(97), small=True, planning="parallelize"),
    # A plain nn.Module has no config to make inputs from: its one input is made from its first
    # layer (an Embedding: token ids), and the plan is made and checked without example_inputs.
    Arch("own_plain_no_inputs", own(), token_ids(97), small=True, planning="auto"),
    # Reads its input ids' values in forward (nonzero, .tolist(), .item()), as padding checks do.
    Arch("own_padding_check", own(padding_check=True), token_ids(97), small=True, planning="parallelize"),
    # On 4 ranks its KV heads are shared: the norm's gradient is partial on each holder.
    Arch("own_qk_norm", own(qk_norm=True), token_ids(97), small=(2, 3, 4)),
    Arch("own_partial_rotary", own(heads=12, kv_heads=4, rotary_dim=4), token_ids(97), small=True),
    # A LayerNorm over every head's features of q and of k (ESM-C): split with the heads, its mean
    # and variance summed over the ranks; at 4 ranks the 3 KV heads are shared and it stays whole,
    # the query projection, unpaired then, gathered (the plan would otherwise be imbalanced).
    Arch("own_qk_layer_norm", own(qk_layer_norm=True), token_ids(97), small=(2, 3),
         plan_says={2: r"q_proj +column ", 3: r"q_proj +column ",
                    4: r"q_proj +column_gather .*k_layer_norm normalises over KV heads that several ranks hold"}),
    # ESM-C: LayerNorms (its own subclass, returning the input's dtype) over every head's features
    # of q and k, split with the heads.
    Arch("esmc", hf("esmc", "base", hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=6, head_dim=8), token_ids(), plan_says=r"q_proj +column"),
    Arch("own_head_dim_equals_heads", own(heads=8, kv_heads=4, head_dim=8), token_ids(97)),
    # A per-head parameter on the heads axis (multiplying the heads, or the scores) is split with
    # them: each rank holds its heads' slice, a local parameter whose gradient needs no sum.
    Arch("own_head_scale", own(head_scale=True), token_ids(97), small=True),
    Arch("own_score_gain", own(score_gain=True), token_ids(97)),
    # Attention sinks (gpt-oss): a per-head logit viewed as [1, heads, 1, 1] and expanded beside
    # the scores; split with the heads, with and without grouped-query attention.
    Arch("own_attention_sinks", own(sinks=True), token_ids(97), small=(2, 3),
         plan_says=r"parameters split with their heads: .*sinks"),
    Arch("own_attention_sinks_gqa", own(sinks=True, heads=6, kv_heads=3), token_ids(97),
         plan_says=r"parameters split with their heads: .*sinks"),
    # A key made with new_empty and written slice by slice with copy_ (MLA's key_states): split
    # with the heads of the tensor it was made like.
    Arch("own_key_written_into", own(key_written_into=True), token_ids(97), small=(2, 3),
         plan_says=r"k_proj +column"),
    # A replicated weight inside the sharded region (a gain over head_dim on every head of q, a
    # scalar gain on the MLP's hidden features): its gradient is partial on each rank, summed.
    Arch("own_head_dim_gain", own(head_dim_gain=True), token_ids(97), small=True),
    Arch("own_mlp_scalar_gain", own(scalar_gain=True), token_ids(97), small=True),
    # Gate and up in one Linear whose output is viewed as (2, ffn) and taken apart by two selects
    # (Moshi): split as its two parts, each by the ranks (70 features: uneven at 3 and 4 ranks).
    Arch("own_gate_up_selected", own(gate_up_selected=True), token_ids(97), small=(2, 3),
         plan_says=r"mlp\.up +column"),
    # Rotary layouts the plan follows through their ops (stack and flatten; complex pairs; repeat).
    Arch("own_rotary_stack", own(rotary_layout="stack"), token_ids(97), small=True),
    Arch("own_rotary_interleave", own(rotary_layout="interleave"), token_ids(97), small=True),
    Arch("own_rotary_repeat", own(rotary_layout="repeat"), token_ids(97), small=(2, 3, 4)),
    # KV heads tiled for their query heads: kept whole.
    Arch("own_tiled_kv", own(tiled_kv=True), token_ids(97), small=True),
    # torch.nn.MultiheadAttention: in_proj_weight split by heads in its q/k/v parts, out_proj a row layer.
    Arch("own_multihead", own_multihead(), token_ids(97), small=True),
    Arch("own_multihead_seq_first", own_multihead(batch_first=False), token_ids(97), small=True),
    Arch("own_multihead_no_bias", own_multihead(bias=False), token_ids(97), small=True),
    # Called with need_weights=True (torch's default), the weights averaged over the heads never
    # read: split by heads, the weights not returned. Read (added to the residual): averaged over
    # every head with one all-reduce in forward, their gradient reaching each rank's heads.
    Arch("own_multihead_weights", own_multihead(need_weights=True), token_ids(97), small=True),
    Arch("own_multihead_weights_read", own_multihead(read_weights=True), token_ids(97), small=True),
    Arch("own_multihead_weights_read_seq_first", own_multihead(read_weights=True, batch_first=False), token_ids(97)),
    # A bias over the heads held by the model (a buffer's slices, or made in forward from the head
    # count) and passed to every attention: cut to each rank's heads where the attention receives it.
    Arch("own_alibi_buffer", own(alibi="buffer"), token_ids(97), small=True),
    Arch("own_alibi_computed", own(alibi="computed"), token_ids(97), small=True),
    # Multi-query attention: the one KV head held by every rank, its projections' gradients summed.
    Arch("own_mqa", own(kv_heads=1), token_ids(97), small=True),
    Arch("own_mqa_alibi", own(kv_heads=1, alibi="computed"), token_ids(97), small=True),
]

# ---- plain-PyTorch idioms (see idiom_models): each exact, and where a part is kept whole, the plan
# says why in words that name the idiom.
IDIOMS = [
    Arch("own_idiom_optional_layers", idiom("optional_layers"), token_ids(97), small=True),
    Arch("own_idiom_autocast", idiom("autocast"), token_ids(97), small=True),
    Arch("own_idiom_config_heads", idiom("config_heads"), token_ids(97), small=True,
         plan_says=r"blocks\.0(-1)?\.attn: local attributes \{'config\.num_attention_heads'"),
    # Both head counts made local together: one at a time neither changes kv * (heads // kv).
    Arch("own_idiom_grouped_heads", idiom("grouped_heads"), token_ids(97), small=True,
         plan_says=r"blocks\.0(-1)?\.attn: local attributes \{'config\.num_attention_heads': '[\d/]+', "
                   r"'config\.num_key_value_heads'"),
    # q, k and v taken apart by unbind: the fused projection is split by heads in its 3 parts.
    Arch("own_idiom_unbind_qkv", idiom("unbind_qkv"), token_ids(97), small=True,
         plan_says=r"blocks\.0(?:-1)?\.attn\.qkv +column .* in parts \((\d+), \1, \1\)"),
    # Sizes read from the whole input (nanoGPT's `y.view(B, T, C)`): the views made local by call.
    Arch("own_idiom_size_views", idiom("size_views"), token_ids(97), small=True,
         plan_says=r"blocks\.0(-1)?\.attn: view and reshape sizes read from whole tensors, made local"),
    # F.linear on the fused weight with a concatenated bias: not the layer's call, so the weight,
    # read inside its attention's one call, is stored split and gathered for that call.
    Arch("own_idiom_functional_qkv_bias", idiom("functional_qkv_bias"), token_ids(97), small=True,
         plan_says=r"parameters stored split and gathered whole for each call of their module .*"
                   r"blocks\.0(-1)?\.attn\.qkv\.weight"),
    Arch("own_idiom_adaptive_norm", idiom("adaptive_norm"), token_ids(97), small=True,
         plan_says=r"blocks\.0(-1)?\.modulation\.1 .*replicated: .*adaptive-norm modulation"),
    # The stem is a layer of its own, whose output passes the grouped positional convolution
    # and meets the blocks' norm: it cannot be paired, and is gathered (held whole where the rest
    # splits evenly enough); the positional convolution stays whole. Each with its reason.
    Arch("own_idiom_conv", idiom("conv"), pixels(3, 8), small=True,
         plan_says=r"stem +(replicate|column_gather) .*its output aten\.native_layer_norm(?s:.*)a grouped or depthwise "
                   r"convolution "
                   r"whose input channels arrive whole.*position \(Conv1d"),
    # Its cross attention norms x and the memory itself and reshapes q with x's length: both kept whole.
    Arch("own_idiom_two_input_attention", idiom("two_input_attention"), token_ids(97), small=True,
         plan_says=r"module 'blocks\.0\.cross' receives tokens split over the ranks .* may read their count"),
    Arch("own_idiom_own_loss", idiom("own_loss"), token_ids_and_labels(97), small=True,
         plan_says=r"lm_head .*computes a loss from these logits in its own forward.*loss parallelism, which keeps "
                   r"them split, applies only to Hugging Face's loss functions"),
    Arch("own_idiom_frozen_input", idiom("frozen_input"), features(48), small=True),
    # Identical blocks nested in identical blocks: recorded once, folded for the others.
    Arch("own_idiom_nested_mlps", idiom("nested_mlps"), features(48), small=True),
    # x.to(cfg.device) in forward: a copy of the stream, planned as the copy it is.
    Arch("own_idiom_device_move", idiom("device_move"), token_ids(97), small=True),
    Arch("own_idiom_frozen_embedding", idiom("frozen_embedding"), token_ids(97), small=True),
    Arch("own_idiom_trained", idiom("trained"), token_ids(97), small=True),
    # Outputs computed and dropped: the backward never reaches their layers' input copies.
    Arch("own_idiom_dropped_outputs", idiom("dropped_outputs"), token_ids(97), small=True),
    # k/v projections called on x and on the encoder's output in every block: one copy of that output.
    # The depthwise convolution's weight and bias over the fused q/k/v channels are split part by
    # part with in_proj; the zeros filled by copy_ are made at each rank's channels.
    Arch("own_idiom_conv_mixer", idiom("conv_mixer"), token_ids(97), small=True,
         plan_says=r"split with their heads: .*conv1d\.weight"),
    Arch("own_idiom_merged_attention", idiom("merged_attention"), token_ids(97), small=True),
]
TABLE += IDIOMS
TABLE += conformance_sweep_sample.entries(Arch)

# Our own models written to exhibit the defect classes; each is in the small matrix.
DEFECT_MODELS = {"own_qk_norm", "own_partial_rotary", "own_head_scale", "own_head_dim_gain", "own_mlp_scalar_gain"}

IDIOM_MODELS = {arch.name for arch in IDIOMS}

BY_NAME = {arch.name: arch for arch in TABLE}
assert len(BY_NAME) == len(TABLE), "architecture names must be unique"


def check_named(name: str):
    """Runs on every rank: the conformance check of the table's entry `name`."""
    from conformance_harness import check

    return check(BY_NAME[name])
