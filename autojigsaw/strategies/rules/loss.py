"""Rules for mean squared error and the broadcast_tensors before it: the loss over a sharded field.

F.mse_loss broadcasts its two tensors (broadcast_tensors: views, so both keep any common
layout when their shapes agree) and reduces over every element. Per mesh axis:
  replicated   input, target Replicate                   -> loss Replicate
  shard d      input, target Shard(d)                    -> loss Partial (kernel: this shard's
               share of the global mean), or Shard(d) with reduction "none"
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...kernels import registry
from ...kernels.mse import sharded_mse_loss
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
SHARDED_MSE = "sharded_mse_loss"
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _same_layouts(shape, n: int, outputs: int, partial_out: bool = False) -> list[AxisOption]:
    """Both tensors alike: replicated, or sharded on one dim at least n long (an empty shard adds 0)."""
    opts = [AxisOption((R, R), (R,) * outputs)]
    if n > 1:
        opts += [AxisOption((Shard(d), Shard(d)), (Partial(),) if partial_out else (Shard(d),) * outputs,
                            kernel=SHARDED_MSE if partial_out else "local", note=f"dim {d}")
                 for d in range(len(shape)) if shape[d] >= n]
    return opts


@register(aten.broadcast_tensors.default)
def broadcast_tensors(node, mesh, candidates):
    shapes = [t.meta["val"].shape for t in node.args[0]]
    if len(shapes) != 2 or shapes[0] != shapes[1]:
        return None  # a real broadcast: the replicated fallback
    return per_axis(mesh, lambda n: _same_layouts(shapes[0], n, outputs=2))


def _reduction(node) -> str:
    return _REDUCTIONS[node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)]


@register(aten.mse_loss.default)
def mse_loss(node, mesh, candidates):
    x, target = node.args[0].meta["val"], node.args[1].meta["val"]
    if x.shape != target.shape:
        return None
    reduced = _reduction(node) != "none"
    return per_axis(mesh, lambda n: _same_layouts(x.shape, n, outputs=1, partial_out=reduced))


def _call(node, sharding, rank, local_inputs):
    x = node.args[0].meta["val"]
    reduction = _reduction(node)
    return sharded_mse_loss, tuple(local_inputs), dict(count=math.prod(x.shape), reduction=reduction)


registry.add(registry.Kernel(SHARDED_MSE, _call))
