"""Small plain-PyTorch models, each written in one idiom that models outside transformers use
and that a plan must either compute exactly or keep whole with a reason naming it:

- "optional_layers": an nn.ModuleList holding None (a layer left out by a config);
- "autocast": torch.autocast(device_type=x.device.type) inside forward;
- "config_heads": the head counts read from a config object the attention holds;
- "grouped_heads": the head split written as `num_kv_heads * (num_heads // num_kv_heads)`;
- "unbind_qkv": a fused qkv split by `reshape(...).permute(...).unbind(0)`;
- "size_views": nanoGPT's attention: `B, T, C = x.size()`, q, k and v viewed with `C // n_head`
  and the heads' output with `view(B, T, C)`, C read from the whole input;
- "functional_qkv_bias": `F.linear(x, self.qkv.weight, torch.cat((q_bias, k_bias, v_bias)))`;
- "adaptive_norm": a Linear's output chunked into shift, scale and gate, multiplied into the stream;
- "conv": a patch stem and a positional convolution;
- "two_input_attention": a module called as `attn(x, memory)`, both from split streams;
- "own_loss": a loss computed by the model's forward itself, from its labels;
- "frozen_input": a column layer whose input needs no gradient (features fed in directly);
- "frozen_embedding": a frozen token embedding, whose output needs no gradient;
- "trained": a decoder that has already run forward, backward and an optimizer step.
- "dropped_outputs": a pooler and a projection computed and thrown away (a pooler under a
  language-model head, a projection for a branch the inputs leave out): backward never reaches
  them, so their input copies sum no gradient;
- "merged_attention": one set of k/v projections for self-attention on x and cross-attention on
  an encoder's output, called twice per block: the encoder's output, read by every block, is
  copied once.
- "conv_mixer": a gated-delta-net style mixer: one Linear's output of q, k and v parts of
  different widths, a depthwise convolution over all of them applied with F.conv1d on a Conv1d's
  weight and bias (never called), a buffer of zeros filled by copy_ (a cache's conv state), a
  triangular solve per head and a per-head decay parameter.

- "nested_mlps": segment-anything's mask decoder: a ModuleList of MLPs, each a ModuleList of
  Linears, identical blocks inside identical blocks, over features given directly;
- "device_move": TransformerLens's `residual.to(cfg.device)` in forward, a copy to the device the
  model was configured for, which moves no values on the device the model already holds.

Sizes: hidden 48, 6 heads of 8 (3 KV heads where grouped), FFN 70, vocabulary 97, 2 blocks.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tiny_layers import attend, repeat_kv

VOCAB = 97
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 48, 6, 3, 8, 70


class MLP(nn.Module):
    def __init__(self, hidden=HIDDEN, ffn=FFN):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """q, k and v projections; the head counts held as plain attributes, or read from a
    config object (`config`), or the query heads written as kv_heads * group (`grouped`)."""

    def __init__(self, config=None, grouped=False, autocast=False):
        super().__init__()
        self.config = config
        self.grouped, self.autocast = grouped, autocast
        if config is None:
            self.num_heads, self.num_kv_heads = HEADS, KV_HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        heads, kv_heads = ((self.config.num_attention_heads, self.config.num_key_value_heads) if self.config
                           else (self.num_heads, self.num_kv_heads))
        if self.grouped:
            heads = kv_heads * (heads // kv_heads)
        q = self.q_proj(x).view(b, t, heads, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv_heads, HEAD_DIM).transpose(1, 2)
        k, v = repeat_kv(k, kv_heads, heads), repeat_kv(v, kv_heads, heads)
        if self.autocast:
            # Attention kept out of mixed precision, as models do for their softmax.
            with torch.autocast(device_type=x.device.type, enabled=False):
                out = attend(q, k, v)
        else:
            out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * HEAD_DIM))


class UnbindAttention(nn.Module):
    """timm's attention: one fused qkv Linear, its output split by reshape, permute and unbind;
    with `functional_bias` the Linear is never called, its weight applied by F.linear with a
    bias made of q and v biases and a zero k bias (BEiT)."""

    def __init__(self, functional_bias=False):
        super().__init__()
        self.num_heads = HEADS
        self.functional_bias = functional_bias
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
        if functional_bias:
            self.q_bias = nn.Parameter(0.1 * torch.randn(HEADS * HEAD_DIM))
            self.register_buffer("k_bias", torch.zeros(HEADS * HEAD_DIM), persistent=False)
            self.v_bias = nn.Parameter(0.1 * torch.randn(HEADS * HEAD_DIM))
        self.proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x):
        b, t, _ = x.shape
        if self.functional_bias:
            qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.reshape(b, t, 3, self.num_heads, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        out = attend(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, self.num_heads * HEAD_DIM))


class SizeViewAttention(nn.Module):
    """nanoGPT's CausalSelfAttention, as its model.py writes it."""

    def __init__(self, n_embd: int = HIDDEN, n_head: int = HEADS):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = attend(q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        self.attn = attention
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Embedding, blocks (None where a block is left out), norm, head."""

    def __init__(self, blocks):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        return self.lm_head(self.norm(x))


class AdaptiveNormBlock(nn.Module):
    """DiT's block: a Linear of the condition gives shift, scale and gate for each half."""

    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.attn = Attention()
        self.mlp_norm = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.mlp = MLP()
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(HIDDEN, 6 * HIDDEN))

    def forward(self, x, condition):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(condition).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate1 * self.attn(self.attn_norm(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.mlp_norm(x) * (1 + scale2) + shift2)


class AdaptiveNormDecoder(nn.Module):
    """The condition is the embedding of the first token (a class label, as DiT's)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.condition = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(AdaptiveNormBlock() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        condition = self.condition(input_ids[:, 0])
        for block in self.blocks:
            x = block(x, condition)
        return self.lm_head(self.norm(x))


class ConvEncoder(nn.Module):
    """A ViT with a patch stem (Conv2d) and a positional convolution (wav2vec2's grouped Conv1d
    over the tokens), then blocks and a Linear head over the patches."""

    def __init__(self, channels=3, patch=4):
        super().__init__()
        self.stem = nn.Conv2d(channels, HIDDEN, patch, stride=patch)
        self.position = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=4)
        self.blocks = nn.ModuleList(Block(Attention()) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, pixel_values):
        x = self.stem(pixel_values).flatten(2)  # (batch, hidden, patches)
        x = (x + F.gelu(self.position(x))).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CrossAttention(nn.Module):
    """Queries from x, keys and values from the memory: called as attn(x, memory). It norms both
    inputs itself and reads both lengths from them (x's for q, the memory's for k and v), so
    each must reach it with every token."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.x_norm = nn.LayerNorm(HIDDEN)
        self.memory_norm = nn.LayerNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.kv_proj = nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x, memory):
        b, t, _ = x.shape
        heads = self.num_heads
        x, memory = self.x_norm(x), self.memory_norm(memory)
        q = self.q_proj(x).view(b, t, heads, HEAD_DIM).transpose(1, 2)
        k, v = self.kv_proj(memory).view(b, memory.shape[1], 2 * heads, HEAD_DIM).transpose(1, 2).chunk(2, dim=1)
        out = attend(q, k, v, causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * HEAD_DIM))


class TwoStreamBlock(nn.Module):
    """Self-attention and MLP on x, then attention from x to the memory."""

    def __init__(self):
        super().__init__()
        self.block = Block(Attention())
        self.cross = CrossAttention()

    def forward(self, x, memory):
        x = self.block(x)
        return x + self.cross(x, memory)


class TwoStreamDecoder(nn.Module):
    """The memory is a second stream of its own embedding and block over the same tokens (a
    row layer's output, so split over the tokens where sequence parallelism holds)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.memory_embed = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = Block(Attention())
        self.blocks = nn.ModuleList(TwoStreamBlock() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        memory = self.encoder(self.memory_embed(input_ids))
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, memory)
        return self.lm_head(self.norm(x))


class OwnLossDecoder(Decoder):
    """Returns (loss, logits): its loss a label-smoothed cross-entropy of its own making."""

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), label_smoothing=0.1)
        return loss, logits


class FeatureEncoder(nn.Module):
    """Blocks over features given directly (no embedding): the first block's projections read
    an input that needs no gradient. Its norms have no weight, so nothing before them does."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(Attention()) for _ in range(2))
        for block in self.blocks:
            block.attn_norm = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, features):
        x = features
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DroppedOutputsDecoder(Decoder):
    """Also computes a pooler of the first token and an MLP's projection of the last hidden
    state, and returns neither."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.projection = MLP()

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        torch.tanh(self.pooler(x[:, 0]))
        self.projection(x)
        return self.lm_head(self.norm(x))


class MergedAttention(nn.Module):
    """Self- and cross-attention in one: the keys and values of x and of the memory made by the
    same projections, and attended together (T5Gemma 2's merged attention)."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x, memory):
        b, t, _ = x.shape
        heads = lambda y: y.view(b, -1, self.num_heads, HEAD_DIM).transpose(1, 2)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        k = torch.cat((k, heads(self.k_proj(memory))), dim=2)
        v = torch.cat((v, heads(self.v_proj(memory))), dim=2)
        out = attend(q, k, v, causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * HEAD_DIM))


class MergedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        self.attn = MergedAttention()
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x, memory):
        x = x + self.attn(self.attn_norm(x), memory)
        return x + self.mlp(self.mlp_norm(x))


class MergedAttentionDecoder(nn.Module):
    """An encoder block over the tokens, then decoder blocks that each attend to its output."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = Block(Attention())
        self.encoder_norm = nn.LayerNorm(HIDDEN)
        self.blocks = nn.ModuleList(MergedBlock() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        memory = self.encoder_norm(self.encoder(self.embed(input_ids)))
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, memory)
        return self.lm_head(self.norm(x))


class ConvMixer(nn.Module):
    """Gated-delta-net's shape of mixer (Qwen3.5, Qwen3-Next) in plain PyTorch: q, k and v from
    one Linear (widths 24, 24, 48 over 6 heads), a causal depthwise convolution over the fused
    channels applied functionally, a solve of a unit lower-triangular system per head."""

    def __init__(self, heads=HEADS, qk_dim=4, v_dim=HEAD_DIM, kernel=3):
        super().__init__()
        self.qk_dim, self.v_dim, self.kernel = qk_dim, v_dim, kernel
        channels = heads * (2 * qk_dim + v_dim)
        self.in_proj = nn.Linear(HIDDEN, channels, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
        self.decay = nn.Parameter(torch.linspace(-1.0, -0.1, heads))
        self.out_proj = nn.Linear(heads * v_dim, HIDDEN, bias=False)

    def forward(self, x):
        batch, tokens, _ = x.shape
        mixed = self.in_proj(x).transpose(1, 2)
        channels = mixed.shape[1]
        # What a cache keeps of the last tokens, made at the size of what it holds.
        state = torch.zeros(batch, channels, self.kernel - 1, dtype=x.dtype, device=x.device)
        state.copy_(mixed[:, :, -(self.kernel - 1):])
        mixed = F.conv1d(mixed, self.conv1d.weight, self.conv1d.bias, padding=self.kernel - 1, groups=channels)
        mixed = F.silu(mixed[:, :, :tokens] + state[:, :, -1:]).transpose(1, 2)
        q, k, v = mixed.split([channels // (2 * self.qk_dim + self.v_dim) * d
                               for d in (self.qk_dim, self.qk_dim, self.v_dim)], dim=-1)
        q, k = (t.reshape(batch, tokens, -1, self.qk_dim).transpose(1, 2) for t in (q, k))
        v = v.reshape(batch, tokens, -1, self.v_dim).transpose(1, 2)
        system = torch.eye(tokens, dtype=x.dtype, device=x.device) + 0.1 * (q @ k.transpose(-1, -2)).tril(-1)
        out = torch.linalg.solve_triangular(system, v, upper=False, unitriangular=True)
        out = out * self.decay.exp().view(1, -1, 1, 1)
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


def trained(model: nn.Module, clear=True, **inputs) -> nn.Module:
    """`model` after one training step of its own (forward, backward, SGD), its gradients then
    cleared unless not `clear`: a plan must not depend on whether the model ran before."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = model(**inputs)
    out = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    optimizer.step()
    if clear:
        optimizer.zero_grad()
    return model


class NestedMLPs(nn.Module):
    """Outer blocks of MLPs, each a ModuleList of Linears with a ReLU between them (SAM's
    output_hypernetworks_mlps), summed into the stream."""

    def __init__(self):
        super().__init__()
        self.mlps = nn.ModuleList(
            nn.ModuleList([nn.Linear(HIDDEN, FFN), nn.Linear(FFN, FFN), nn.Linear(FFN, HIDDEN)]) for _ in range(3))
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, features):
        x = features
        for mlp in self.mlps:
            h = x
            for i, layer in enumerate(mlp):
                h = layer(h) if i == len(mlp) - 1 else torch.relu(layer(h))
            x = x + h
        return self.head(x)


class DeviceMoveDecoder(Decoder):
    """Moves its residual stream to its configured device between blocks (TransformerLens)."""

    def __init__(self):
        super().__init__([Block(Attention()) for _ in range(2)])
        self.cfg = SimpleNamespace(device=torch.device("cpu"))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x.to(self.cfg.device))
        return self.lm_head(self.norm(x.to(self.cfg.device)))


def idiom_model(idiom: str) -> nn.Module:
    """The model written in `idiom` (see the module's docstring)."""
    if idiom == "optional_layers":
        return Decoder([Block(Attention()), None, Block(Attention())])
    if idiom == "autocast":
        return Decoder([Block(Attention(autocast=True)) for _ in range(2)])
    if idiom in ("config_heads", "grouped_heads"):
        config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
        return Decoder([Block(Attention(config=config, grouped=idiom == "grouped_heads")) for _ in range(2)])
    if idiom == "unbind_qkv":
        return Decoder([Block(UnbindAttention()) for _ in range(2)])
    if idiom == "size_views":
        return Decoder([Block(SizeViewAttention()) for _ in range(2)])
    if idiom == "functional_qkv_bias":
        return Decoder([Block(UnbindAttention(functional_bias=True)) for _ in range(2)])
    if idiom == "adaptive_norm":
        return AdaptiveNormDecoder()
    if idiom == "conv":
        return ConvEncoder()
    if idiom == "two_input_attention":
        return TwoStreamDecoder()
    if idiom == "own_loss":
        return OwnLossDecoder([Block(Attention()) for _ in range(2)])
    if idiom == "frozen_input":
        return FeatureEncoder()
    if idiom == "frozen_embedding":
        model = Decoder([Block(Attention()) for _ in range(2)])
        model.embed.weight.requires_grad_(False)
        return model
    if idiom == "trained":
        ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
        return trained(Decoder([Block(Attention()) for _ in range(2)]), input_ids=ids)
    if idiom == "dropped_outputs":
        return DroppedOutputsDecoder([Block(Attention()) for _ in range(2)])
    if idiom == "merged_attention":
        return MergedAttentionDecoder()
    if idiom == "conv_mixer":
        return Decoder([Block(ConvMixer()) for _ in range(2)])
    if idiom == "nested_mlps":
        return NestedMLPs()
    if idiom == "device_move":
        return DeviceMoveDecoder()
    raise ValueError(f"idiom_model: unknown idiom {idiom!r}")
