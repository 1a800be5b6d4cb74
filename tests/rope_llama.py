"""A Llama block written as torchtitan and Meta's reference write it: complex RoPE, fused wqkv.

`view_as_complex -> mul by a complex64 buffer -> view_as_real` loses half the q/k gradient on two
ranks if complex values are taken for values without a gradient (tests/test_complex_rope.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def in_dtype(dtype: torch.dtype, cls, *args, **kwargs) -> nn.Module:
    """`cls(*args)` with parameters made in `dtype`; the complex RoPE table stays complex64.

    (`module.to(torch.float64)` would cast the complex buffer to real, dropping its imaginary part.)
    """
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(*args, **kwargs)
    finally:
        torch.set_default_dtype(default)


def rope_frequencies(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """complex64 (seq, head_dim // 2): e^(i t f) as torch.polar makes them."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) pairs by complex multiplication."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs.view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RopeBlock(nn.Module):
    """RMSNorm, fused wqkv, complex RoPE, causal SDPA, wo; RMSNorm, SiLU-gated MLP."""

    def __init__(self, dim: int = 128, heads: int = 8, seq: int = 64, hidden: int = 256):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attention_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.register_buffer("freqs", rope_frequencies(self.head_dim, seq), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in (q, k, v))
        q, k = apply_rotary(q, self.freqs[:s]), apply_rotary(k, self.freqs[:s])
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RopeLlama(nn.Module):
    """Token embedding, `depth` RoPE blocks, a final norm and an untied output head."""

    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, seq: int = 32, depth: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RopeBlock(dim, heads, seq, 2 * dim) for _ in range(depth))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
