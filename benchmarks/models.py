"""The benchmark model: pre-norm residual MLP blocks, a final norm and a linear head.

It is the MLP half of a transformer block (and the channel-mixing half of a weather mixer),
so every implementation compared here can express it: PyTorch's `parallelize_module` plan,
a hand-written Megatron module, autojigsaw, and the plain single-device model.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """[batch, seq, d] -> [batch, seq, d]: `depth` blocks, a LayerNorm and a linear head."""

    def __init__(self, d: int = 256, hidden: int = 1024, depth: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d, hidden) for _ in range(depth)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.norm(self.blocks(x)))


def build(d: int, hidden: int, depth: int, seed: int = 0) -> MLPStack:
    """The reference model, with the same weights on every rank and in every variant."""
    torch.manual_seed(seed)
    return MLPStack(d, hidden, depth)


def sample(batch: int, seq: int, d: int, seed: int = 1) -> torch.Tensor:
    """The input every variant trains on: the same tensor on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, d, generator=gen)
