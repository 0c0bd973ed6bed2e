"""Tiny decoders of our own, each written to exhibit one way a plan can compute something
other than the model while every shape still fits:

- QK-norm: an RMSNorm over head_dim applied to every head of q and k (a replicated weight
  applied inside the sharded head region: its gradient is partial on each rank);
- partial rotary whose rotary-dimension count happens to equal the number of KV heads (an
  attribute that only looks like a head count);
- per-head scales: a parameter of shape (num_heads, 1, 1) or (num_heads,) multiplying attention;
- a replicated weight multiplying a sharded tensor: a scalar gain on the MLP's hidden features,
  a gain over head_dim on every head of q.

Rotary embeddings over every feature of a head in other layouts, which the plan must follow
through their ops (`rotary_layout`): "stack" (GPT-J: even and odd features rotated in pairs
with stack and flatten, the table widened by repeat_interleave), "interleave" (pairs as complex
numbers: view_as_complex, a complex product, view_as_real), "repeat" (the table widened by
`.repeat`, and the KV heads repeated for their query heads with `.repeat` instead of expand).
With `tiled_kv` the KV heads are tiled instead (`k.repeat(1, group, 1, 1)`: query head h reads
KV head h % kv_heads), which no contiguous split of the query heads meets on one rank.

Two ways attention is sharded around a tensor or a head held by every rank:

- ALiBi: a bias over the heads added to the scores, held whole by the model and passed to every
  attention (`alibi="buffer"`: slices of a buffer; `alibi="computed"`: made in forward from the
  head count), cut to each rank's heads where the attention receives it;
- multi-query attention (`kv_heads=1`): the one KV head is held by every rank.

And one that reads its inputs' values in forward, as Hugging Face's padding checks do
(`.item()`, `nonzero`, `.tolist()`), which the meta device alone cannot answer.

`TinyDecoder()` with no option set is the control: it uses none of these and must conform.
"""

import math

import torch
from torch import nn

from tiny_layers import RMSNorm, causal_mask, repeat_kv

VOCAB = 97


def _rotate(x, pairs: int, positions):
    """Rotates the first 2 * pairs features of every head (half-split layout); the frequencies
    are made here from `pairs`, so a changed count changes the result, not the shapes."""
    if pairs == 0:
        return x
    width = 2 * pairs
    inv_freq = 1.0 / (10000.0 ** (torch.arange(pairs, dtype=x.dtype, device=x.device) / pairs))
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rot, rest = x[..., :width], x[..., width:]
    first, second = rot[..., :pairs], rot[..., pairs:]
    rotated = torch.cat([-second, first], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def _angles(x, positions):
    pairs = x.shape[-1] // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(pairs, dtype=x.dtype, device=x.device) / pairs))
    return positions.to(x.dtype)[:, None] * inv_freq[None, :]  # (tokens, pairs)


def _rotate_layout(x, layout: str, positions):
    """Rotates every feature of each head of x (batch, heads, tokens, head_dim) in `layout`."""
    angles = _angles(x, positions)
    if layout == "stack":
        cos, sin = (torch.repeat_interleave(t, 2, dim=-1) for t in (angles.cos(), angles.sin()))
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos + rotated * sin
    if layout == "interleave":
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        turn = torch.polar(torch.ones_like(angles), angles)
        return torch.view_as_real(pairs * turn).flatten(-2)
    if layout == "repeat":
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin
    raise ValueError(f"rotary_layout must be 'stack', 'interleave' or 'repeat', got {layout!r}")


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, *, qk_norm=False, rotary_dim=0, head_scale=False,
                 score_gain=False, head_dim_gain=False, rotary_layout=None, tiled_kv=False, sinks=False,
                 key_written_into=False, qk_layer_norm=False):
        super().__init__()
        self.tiled_kv = tiled_kv
        self.key_written_into = key_written_into
        self.rotary_layout = rotary_layout
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, jitter=0.1) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, jitter=0.1) if qk_norm else None
        # ESM-C's q_norm and k_norm: a LayerNorm (weight and bias) over every head's features of
        # q_proj's and k_proj's outputs, before the view into heads.
        self.q_layer_norm = nn.LayerNorm(heads * head_dim) if qk_layer_norm else None
        self.k_layer_norm = nn.LayerNorm(kv_heads * head_dim) if qk_layer_norm else None
        if qk_layer_norm:
            for norm in (self.q_layer_norm, self.k_layer_norm):
                nn.init.normal_(norm.weight, 1.0, 0.1)
                nn.init.normal_(norm.bias, 0.0, 0.1)
        self.head_scale = nn.Parameter(1.0 + 0.1 * torch.randn(heads, 1, 1)) if head_scale else None
        self.score_gain = nn.Parameter(1.0 + 0.1 * torch.randn(heads)) if score_gain else None
        self.q_gain = nn.Parameter(1.0 + 0.1 * torch.randn(head_dim)) if head_dim_gain else None
        # gpt-oss's attention sinks: one learned logit per head, a column beside the scores
        # that takes part in the softmax and is dropped after it.
        self.sinks = nn.Parameter(0.5 * torch.randn(heads)) if sinks else None

    def forward(self, x, bias=None):
        b, t, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_layer_norm is not None:
            q, k = self.q_layer_norm(q), self.k_layer_norm(k)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_gain is not None:
            q = q * self.q_gain
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.key_written_into:
            # MLA's key (MiniCPM3, DeepSeek): a new tensor made like a piece of k but wider,
            # written slice by slice with copy_ (here k's two halves, swapped).
            half = self.head_dim // 2
            first = k[..., :half]
            key = first.new_empty(*first.shape[:-1], self.head_dim)
            key[..., :half].copy_(k[..., half:])
            key[..., half:].copy_(first)
            k = key
        if self.rotary_dim:
            positions = torch.arange(t, device=x.device)
            q, k = _rotate(q, self.rotary_dim // 2, positions), _rotate(k, self.rotary_dim // 2, positions)
        if self.rotary_layout:
            positions = torch.arange(t, device=x.device)
            q, k = _rotate_layout(q, self.rotary_layout, positions), _rotate_layout(k, self.rotary_layout, positions)
        group = self.num_heads // self.num_kv_heads
        if self.tiled_kv:
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        elif self.rotary_layout == "repeat":
            k = k[:, :, None].repeat(1, 1, group, 1, 1).reshape(b, self.num_heads, t, self.head_dim)
            v = v[:, :, None].repeat(1, 1, group, 1, 1).reshape(b, self.num_heads, t, self.head_dim)
        else:
            k, v = repeat_kv(k, self.num_kv_heads, self.num_heads), repeat_kv(v, self.num_kv_heads, self.num_heads)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if self.score_gain is not None:
            scores = scores * self.score_gain[:, None, None]
        if bias is not None:
            scores = scores + bias
        mask = causal_mask(scores)
        if self.sinks is not None:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
            out = torch.softmax(torch.cat([scores + mask, sinks], dim=-1), dim=-1)[..., :-1] @ v
        else:
            out = torch.softmax(scores + mask, dim=-1) @ v
        if self.head_scale is not None:
            out = out * self.head_scale
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden, ffn, *, scalar_gain=False, gate_up_selected=False):
        super().__init__()
        # Moshi's gating MLP: gate and up in one Linear, its output viewed as (2, ffn) and each
        # half taken with a select.
        self.gate_up_selected = gate_up_selected
        self.up = nn.Linear(hidden, 2 * ffn if gate_up_selected else ffn)
        self.down = nn.Linear(ffn, hidden)
        self.gain = nn.Parameter(torch.tensor(1.3)) if scalar_gain else None

    def forward(self, x):
        if self.gate_up_selected:
            both = self.up(x).view(*x.shape[:-1], 2, -1)
            h = torch.nn.functional.gelu(both[..., 0, :]) * both[..., 1, :]
        else:
            h = torch.nn.functional.gelu(self.up(x))
        if self.gain is not None:
            h = h * self.gain
        return self.down(h)


class Block(nn.Module):
    def __init__(self, hidden, ffn, heads, kv_heads, head_dim, scalar_gain=False, gate_up_selected=False,
                 **attention):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, jitter=0.1)
        self.attn = Attention(hidden, heads, kv_heads, head_dim, **attention)
        self.mlp_norm = RMSNorm(hidden, jitter=0.1)
        self.mlp = MLP(hidden, ffn, scalar_gain=scalar_gain, gate_up_selected=gate_up_selected)

    def forward(self, x, bias=None):
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    def __init__(self, hidden=48, ffn=70, heads=6, kv_heads=3, head_dim=8, layers=2, padding_check=False,
                 alibi="", max_positions=32, **options):
        super().__init__()
        self.padding_check = padding_check
        self.alibi, self.num_heads = alibi, heads
        if alibi == "buffer":
            self.register_buffer("alibi_bias", alibi_bias(heads, max_positions))
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(Block(hidden, ffn, heads, kv_heads, head_dim, **options) for _ in range(layers))
        self.norm = RMSNorm(hidden, jitter=0.1)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids):
        if self.padding_check:
            padded = (input_ids == 0).nonzero()
            if padded.shape[0] > 0 or 0 in input_ids[:, [-1, 0]].tolist()[0] or int(input_ids.max().item()) >= VOCAB:
                raise ValueError("TinyDecoder: input_ids hold padding (token 0) or ids outside the vocabulary")
        x = self.embed(input_ids)
        t = input_ids.shape[1]
        bias = None
        if self.alibi == "buffer":
            bias = self.alibi_bias[:, :t, :t]
        elif self.alibi == "computed":
            bias = alibi_bias(self.num_heads, t, device=input_ids.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, bias)
        return self.lm_head(self.norm(x))


def alibi_bias(heads: int, length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """ALiBi: a slope per head times the (negative) distance from query to key, (heads, length,
    length); the slopes depend on the head count, so each head's bias differs."""
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=device, dtype=dtype) / heads)
    positions = torch.arange(length, device=device, dtype=dtype)
    distance = (positions[None, :] - positions[:, None]).clamp(max=0)
    return slopes[:, None, None] * distance[None]


def tiny_decoder(**options) -> nn.Module:
    return TinyDecoder(**options)


class MultiheadBlock(nn.Module):
    """A pre-norm block whose attention is torch.nn.MultiheadAttention, causal. With
    `read_weights` it also adds the attention weights it returns (averaged over the heads, or
    per head without `average_weights`) applied to its normed input to the residual."""

    def __init__(self, hidden, ffn, heads, *, batch_first, bias, need_weights, read_weights=False,
                 average_weights=True):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, bias=bias, batch_first=batch_first)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)
        self.need_weights = need_weights or read_weights
        self.read_weights = read_weights
        self.average_weights = average_weights

    def forward(self, x):  # (batch, tokens, hidden)
        normed = h = self.attn_norm(x)
        if not self.attn.batch_first:
            h = h.transpose(0, 1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        out, weights = self.attn(h, h, h, attn_mask=causal, need_weights=self.need_weights,
                                 average_attn_weights=self.average_weights)
        if not self.attn.batch_first:
            out = out.transpose(0, 1)
        x = x + out
        if self.read_weights:
            if not self.average_weights:
                weights = weights.sum(dim=1)
            x = x + torch.matmul(weights, normed)
        return x + self.mlp(self.mlp_norm(x))


class MultiheadDecoder(nn.Module):
    """A decoder of nn.MultiheadAttention blocks: its attention applies `in_proj_weight` (q, k
    and v fused) and `out_proj.weight` with functional calls, never calling a Linear module."""

    def __init__(self, hidden=48, ffn=70, heads=6, layers=2, batch_first=True, bias=True, need_weights=False,
                 read_weights=False, average_weights=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(MultiheadBlock(hidden, ffn, heads, batch_first=batch_first, bias=bias,
                                                   need_weights=need_weights, read_weights=read_weights,
                                                   average_weights=average_weights) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def multihead_decoder(**options) -> nn.Module:
    return MultiheadDecoder(**options)
