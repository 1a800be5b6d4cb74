"""Rules for pointwise ops DTensor's rules miss, and for dropout.

Ops listed in _SAME_AS are pointwise twins of ops DTensor knows; their strategies are
the twin's. Dropout keeps its input's layout (the dropout kernel draws the single-device
mask, so training matches the single-device model bit for bit).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...ir import Strategy, tensor_inputs
from ..dtensor_rules import dtensor_strategies
from .base import AxisOption, per_axis, register

aten = torch.ops.aten

_SAME_AS = {
    aten.__and__.Tensor: aten.bitwise_and.Tensor,
    aten.__or__.Tensor: aten.bitwise_or.Tensor,
    aten.__xor__.Tensor: aten.bitwise_xor.Tensor,
}


@register(*_SAME_AS)
def pointwise_twin(node, mesh, candidates):
    original = node.target
    node.target = _SAME_AS[original]
    try:
        inputs = {src: c for (src, _), c in zip(tensor_inputs(node), candidates)}
        pairs = dtensor_strategies(node, mesh, inputs) or []
    finally:
        node.target = original
    return [Strategy(i, o) for i, o in pairs]


@register(aten.native_dropout.default)
def dropout(node, mesh, candidates):
    x = node.args[0].meta["val"]

    def options(n):
        opts = [AxisOption((Replicate(),), (Replicate(), Replicate()), kernel="dropout")]
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d), Shard(d)), kernel="dropout")
                     for d in range(x.ndim) if x.shape[d] >= n]
            opts.append(AxisOption((Partial(),), (Partial(), Replicate()), kernel="dropout"))
        return opts

    return per_axis(mesh, options)
