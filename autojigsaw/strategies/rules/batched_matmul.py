"""Rules for aten.matmul (`a @ b` as captured), the matmuls of attention written out by hand.

Per mesh axis, for C [..., M, N] = A [..., M, K] @ B [..., K, N] with broadcast batch dims:
  batch        A, B Shard(their copy of batch dim i; Replicate where they broadcast) -> Shard(i)
  rows         A Shard(-2), B Replicate                                             -> Shard(-2)
  columns      A Replicate, B Shard(-1)                                             -> Shard(-1)
  contraction  A Shard(-1), B Shard(-2)                                             -> Partial
With q @ k^T, softmax and @ v this gives attention with sharded heads, with sharded query
rows against gathered K/V, or with sharded keys (a sharded softmax, then a partial sum).
DTensor has rules for mm and bmm but none for matmul, which export keeps whole.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()


@register(aten.matmul.default)
def matmul(node, mesh, candidates):
    a, b = node.args[0].meta["val"], node.args[1].meta["val"]
    if a.ndim < 2 or b.ndim < 2:
        return None  # matrix-vector products: DTensor's fallback
    out = node.meta["val"]

    def batch_placement(t, i: int):
        d = i - (out.ndim - t.ndim)
        return Shard(d) if d >= 0 and t.shape[d] != 1 else R

    def options(n):
        opts = [AxisOption((R, R), (R,))]
        if n == 1:
            return opts
        opts += [AxisOption((batch_placement(a, i), batch_placement(b, i)), (Shard(i),), note="batch")
                 for i in range(out.ndim - 2) if out.shape[i] >= n]
        if a.shape[-2] >= n:
            opts.append(AxisOption((Shard(a.ndim - 2), R), (Shard(out.ndim - 2),), note="rows"))
        if b.shape[-1] >= n:
            opts.append(AxisOption((R, Shard(b.ndim - 1)), (Shard(out.ndim - 1),), note="columns"))
        if a.shape[-1] >= n:
            opts.append(AxisOption((Shard(a.ndim - 1), Shard(b.ndim - 2)), (Partial(),), note="contraction"))
        return opts

    return per_axis(mesh, options)
