"""Small models written to exhibit the classes of model on which a plan could compute
something other than the unsharded model: replicated parameters applied inside a sharded
region (their gradients are partial sums on each rank), and integer attributes that only
happen to equal a size the plan makes local."""

import torch
import torch.nn.functional as F
from torch import nn

from tiny_layers import RMSNorm, attend, repeat_kv

DIM, HEADS, HEAD_DIM, VOCAB = 20, 5, 4, 37


class Attention(nn.Module):
    """Multi-head attention with hooks for the per-head oddities below."""

    def __init__(self, qk_norm=False, scale=False, mix=False, per_head=False):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HEAD_DIM
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.k = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)
        # QK-norm: one RMSNorm over head_dim, applied to every head of q and of k.
        self.q_norm = RMSNorm(HEAD_DIM) if qk_norm else None
        self.k_norm = RMSNorm(HEAD_DIM) if qk_norm else None
        # A learned temperature (a scalar) and a scale over head_dim shared by every head.
        self.temperature = nn.Parameter(torch.tensor(0.7)) if scale else None
        self.value_scale = nn.Parameter(torch.linspace(0.5, 1.5, HEAD_DIM)) if scale else None
        # A replicated weight multiplying every head (a [head_dim, head_dim] map).
        self.mix = nn.Parameter(torch.eye(HEAD_DIM) + 0.1 * torch.randn(HEAD_DIM, HEAD_DIM)) if mix else None
        # A scale per head: it lives on the heads axis itself.
        self.head_gain = nn.Parameter(torch.linspace(0.8, 1.2, HEADS).view(HEADS, 1, 1)) if per_head else None

    def forward(self, x):
        b, s, _ = x.shape
        shape = (b, s, self.num_heads, self.head_dim)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        if self.temperature is not None:
            scores = scores * self.temperature
            v = v * self.value_scale
        if self.head_gain is not None:
            scores = scores * self.head_gain
        out = scores.softmax(-1) @ v
        if self.mix is not None:
            out = out @ self.mix
        return self.o(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Model(nn.Module):
    def __init__(self, **attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = RMSNorm(DIM)
        self.attn = Attention(**attention)
        self.up = nn.Linear(DIM, 30)
        self.down = nn.Linear(30, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.attn(self.norm(h))
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


class SharedTemperature(Model):
    """The temperature is also used outside the attention, on replicated hidden states: its
    gradient has a whole part and a partial part, which no sum over the ranks can fix."""

    def __init__(self):
        super().__init__(scale=True)

    def forward(self, ids):
        h = self.embed(ids) * self.attn.temperature
        h = h + self.attn(self.norm(h))
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


# name -> builder; each builds the same weights from the same seed.
PARTIAL_GRADIENT_MODELS = {
    "qk_norm": lambda: Model(qk_norm=True),
    "scale": lambda: Model(scale=True),
    "mix": lambda: Model(mix=True),
    "per_head": lambda: Model(per_head=True),
    "shared_temperature": SharedTemperature,
    "all": lambda: Model(qk_norm=True, scale=True, mix=True),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = PARTIAL_GRADIENT_MODELS[name]()
    with torch.no_grad():  # weights that are not all ones, so that a wrong sum shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


class PartialRotaryAttention(nn.Module):
    """Grouped-query attention with rotary embeddings on the first `rotary_dims` features of
    each head, where rotary_dims happens to equal the number of KV heads (2): only the head
    counts are global sizes the sharded model must see locally."""

    def __init__(self, heads=4, kv_heads=2, head_dim=6, rotary_dims=2):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary_dims = rotary_dims
        self.q = nn.Linear(DIM, heads * head_dim, bias=False)
        self.k = nn.Linear(DIM, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(DIM, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, DIM, bias=False)

    def rotate(self, x):
        rot, rest = x[..., :self.rotary_dims], x[..., self.rotary_dims:]
        positions = torch.arange(x.shape[-2], device=x.device, dtype=x.dtype)
        angle = positions[:, None] * torch.arange(1, self.rotary_dims + 1, device=x.device, dtype=x.dtype) / 10
        half = torch.cat([-rot[..., self.rotary_dims // 2:], rot[..., :self.rotary_dims // 2]], dim=-1)
        return torch.cat([rot * angle.cos() + half * angle.sin(), rest], dim=-1)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.rotate(self.q(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2))
        k = self.rotate(self.k(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2))
        v = self.v(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k, v = repeat_kv(k, self.num_kv_heads, self.num_heads), repeat_kv(v, self.num_kv_heads, self.num_heads)
        out = attend(q, k, v, causal=False)
        return self.o(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class PartialRotaryModel(Model):
    def __init__(self, **attention):
        super().__init__()
        self.attn = PartialRotaryAttention(**attention)


def build_partial_rotary(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return PartialRotaryModel()


def build_shared_kv_rotary(seed: int = 0) -> nn.Module:
    """6 query heads over 3 KV heads: on 4 ranks ([2, 2, 1, 1] query heads) each rank holds one
    KV head, shared, and rotary_dims (2) equals the query heads per KV head."""
    torch.manual_seed(seed)
    return PartialRotaryModel(heads=6, kv_heads=3, rotary_dims=2)
