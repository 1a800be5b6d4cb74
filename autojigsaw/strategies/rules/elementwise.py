"""Rules for pointwise ops DTensor's rules miss, and for dropout.

Ops listed in _SAME_AS are pointwise twins of ops DTensor knows; their strategies are
the twin's. `where` with a scalar branch (T5's position bias under its mask) and `fill` with
a tensor value broadcast their tensors: each shards the output dims it spans and stays whole
where it broadcasts (never Partial: neither is linear). Dropout keeps its input's layout (the
dropout kernel draws the single-device mask, so training matches the single-device model bit
for bit).
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


@register(aten.where.ScalarOther, aten.where.ScalarSelf, aten.fill.Tensor)
def broadcast_pointwise(node, mesh, candidates):
    tensors = [src.meta["val"] for src, _ in tensor_inputs(node)]
    out = node.meta["val"].shape

    def options(n):
        opts = [AxisOption((Replicate(),) * len(tensors), (Replicate(),))]
        for d in range(len(out)) if n > 1 else ():
            if out[d] >= n:
                spans = [d - (len(out) - t.ndim) for t in tensors]  # each tensor's dim under output dim d
                opts.append(AxisOption(tuple(Shard(k) if k >= 0 and t.shape[k] == out[d] else Replicate()
                                             for t, k in zip(tensors, spans)), (Shard(d),)))
        return opts

    return per_axis(mesh, options)


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
