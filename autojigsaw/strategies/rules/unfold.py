"""Rule for Tensor.unfold (windows sliding along one dim: PatchTST's patches): shard another dim, or replicate.

x.unfold(d, size, step) keeps every dim of x in its place (d now counts the windows) and appends one of
`size` values; a shard of any other dim holds whole windows, so it needs nothing. The windowed dim stays
whole: a window may straddle two shards, and windows overlap when step < size.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .base import other_dims_split, per_axis, register

aten = torch.ops.aten


@register(aten.unfold.default)
def unfold(node: Node, mesh, candidates):
    x = node.args[0].meta["val"]
    windowed = node.args[1] % x.ndim
    return per_axis(mesh, other_dims_split(x.shape, {windowed}, note="a dim the windows do not slide along"))
