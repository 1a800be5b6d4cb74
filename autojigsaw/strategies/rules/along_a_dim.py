"""Rules for ops that work along one dim (argsort, sort, diff, repeat_interleave) and for type_as.

An op along dim d (sorting a row, differencing it, repeating its entries) treats every other dim
as a batch: a shard of one of them needs nothing (ViTMAE's random masking argsorts its noise per
sample; Mamba 2 repeats its heads' states along one dim). Dim d stays whole. `x.type_as(other)`
reads only other's dtype: x's placement passes through, other comes as it is where it has x's shape.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from .base import AxisOption, other_dims_split, per_axis, register

aten = torch.ops.aten
R = Replicate()
_DIM_ARG = {aten.argsort.default: (1, -1), aten.sort.default: (1, -1), aten.diff.default: (2, -1),
            aten.repeat_interleave.self_int: (2, None)}  # op -> (position of dim, its default)
_KW_ONLY = (aten.argsort.stable, aten.sort.stable)  # dim given by keyword only


def _dim(node: Node) -> int | None:
    if node.target in _KW_ONLY:
        return node.kwargs.get("dim", -1)
    position, default = _DIM_ARG[node.target]
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


@register(*_DIM_ARG, *_KW_ONLY)
def along_a_dim(node, mesh, candidates):
    x = node.args[0].meta["val"]
    dim = _dim(node)
    if dim is None or len(candidates) != 1:  # repeat_interleave of the flattened tensor; diff with prepend/append
        return None
    along = dim % x.ndim
    n_out = len(node.meta["val"]) if isinstance(node.meta["val"], (tuple, list)) else 1
    return per_axis(mesh, other_dims_split(x.shape, {along}, n_out, note=f"a dim it does not work along ({along})"))


@register(aten.type_as.default)
def type_as(node, mesh, candidates):
    if len(candidates) != 2:  # x.type_as(x)
        return None
    x, other = node.args[0].meta["val"], node.args[1].meta["val"]
    alike = tuple(x.shape) == tuple(other.shape)

    def options(n):
        opts = [AxisOption((R, R), (R,))]
        if n > 1:
            opts += [AxisOption((Shard(d), Shard(d) if alike else R), (Shard(d),))
                     for d in range(x.ndim) if x.shape[d] >= n]
        return opts  # no Partial: a cast of each rank's share rounds otherwise than a cast of the sum

    return per_axis(mesh, options)
