"""The layers every collection of our own test models shares (tests/conformance's
conformance_models and idiom_models, support/soundness_models): an RMSNorm as Hugging Face
writes it, KV heads repeated for their query heads, and attention over heads."""

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Written out as Hugging Face writes it (normalised x times weight), over the last axis. Its
    weight is ones, or with `jitter` ones plus that much noise from torch's generator, so that a
    wrong sum of its gradient shows."""

    def __init__(self, dim: int, eps: float = 1e-6, jitter: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(1.0 + jitter * torch.randn(dim) if jitter else torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def repeat_kv(x, kv_heads: int, heads: int):
    """(batch, kv_heads, tokens, head_dim) widened to `heads` heads by expand and reshape, each KV
    head read by the run of query heads that follows it (Llama's repeat_kv)."""
    b, _, t, head_dim = x.shape
    return x[:, :, None].expand(b, kv_heads, heads // kv_heads, t, head_dim).reshape(b, heads, t, head_dim)


def causal_mask(scores):
    """-inf where a query (the scores' second last axis) would read a later key, else 0."""
    return torch.full(scores.shape[-2:], float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)


def attend(q, k, v, causal: bool = True):
    """Attention over (batch, heads, tokens, head_dim): causal, or with causal=False every query
    reading every key (cross-attention)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        return torch.softmax(scores + causal_mask(scores), dim=-1) @ v
    return torch.softmax(scores, dim=-1) @ v
