"""Rule for Tensor.unfold (windows sliding along one dim: PatchTST's patches): shard another dim, or replicate.

x.unfold(d, size, step) keeps every dim of x in its place (d now counts the windows) and appends one of
`size` values; a shard of any other dim holds whole windows, so it needs nothing. The windowed dim stays
whole: a window may straddle two shards, and windows overlap when step < size.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()


@register(aten.unfold.default)
def unfold(node: Node, mesh, candidates):
    x = node.args[0].meta["val"]
    windowed = node.args[1] % x.ndim

    def options(n):
        opts = [AxisOption((R,), (R,))]
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d),), note="a dim the windows do not slide along")
                     for d in range(x.ndim) if d != windowed and x.shape[d] >= n]
        return opts

    return per_axis(mesh, options)
