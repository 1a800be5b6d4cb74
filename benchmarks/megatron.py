"""A hand-written Megatron-LM tensor-parallel MLPStack: the baseline written the way people do.

As in Megatron-LM (Shoeybi et al. 2019): `f` is the identity forward and an all-reduce
backward before each column-parallel linear, `g` an all-reduce forward and the identity
backward after each row-parallel linear. Norms and the residual stream are replicated; the
head is column-parallel and all-gathers its output. Parameters are plain local tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .models import MLPStack


class _F(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class _G(torch.autograd.Function):
    """All-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), x.dim() - 1, group))

    @staticmethod
    def backward(ctx, g):
        return g.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def _shard(t: torch.Tensor, dim: int, group) -> nn.Parameter:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % n:
        raise ValueError(f"Megatron needs dim {dim} of size {t.shape[dim]} divisible by {n} ranks")
    return nn.Parameter(t.detach().chunk(n, dim)[r].clone())


class MegatronBlock(nn.Module):
    """Replicated LayerNorm, column-parallel fc1, row-parallel fc2, replicated fc2 bias."""

    def __init__(self, ref, group):
        super().__init__()
        self.group = group
        self.norm = nn.LayerNorm(ref.norm.normalized_shape)
        self.norm.load_state_dict(ref.norm.state_dict())
        self.w1, self.b1 = _shard(ref.fc1.weight, 0, group), _shard(ref.fc1.bias, 0, group)
        self.w2 = _shard(ref.fc2.weight, 1, group)
        self.b2 = nn.Parameter(ref.fc2.bias.detach().clone())

    def forward(self, x):
        h = F.gelu(F.linear(_F.apply(self.norm(x), self.group), self.w1, self.b1))
        return x + _G.apply(F.linear(h, self.w2), self.group) + self.b2


class MegatronStack(nn.Module):
    """MLPStack over a process group, Megatron style; takes and returns whole tensors."""

    def __init__(self, ref: MLPStack, group):
        super().__init__()
        self.group = group
        self.blocks = nn.Sequential(*(MegatronBlock(b, group) for b in ref.blocks))
        self.norm = nn.LayerNorm(ref.norm.normalized_shape)
        self.norm.load_state_dict(ref.norm.state_dict())
        self.wh, self.bh = _shard(ref.head.weight, 0, group), _shard(ref.head.bias, 0, group)

    def forward(self, x):
        h = _F.apply(self.norm(self.blocks(x)), self.group)
        return _GatherLast.apply(F.linear(h, self.wh, self.bh), self.group)
