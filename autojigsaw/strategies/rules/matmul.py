"""Rules for aten.linear: data (token) sharding, Megatron column and row, replicated.

Per mesh axis, for Y = X W^T + b with X [..., K], W [N, K]:
  token   X Shard(d) for a leading dim d, W and b Replicate  -> Y Shard(d)
  column  X Replicate, W Shard(0), b Shard(0)                -> Y Shard(-1)
  row     X Shard(-1), W Shard(1), b Partial (added once)    -> Y Partial
Combining axes gives the 2-D layouts, Jigsaw's zero-redundancy one among them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()


@register(aten.linear.default)
def linear(node, mesh, candidates):
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    has_bias = len(candidates) == 3
    last = x.ndim - 1
    out_features, in_features = w.shape

    def options(n):
        opts = [AxisOption((R, R, R), (R,))]
        if n == 1:
            return trim_options(opts, has_bias)
        opts += [AxisOption((Shard(d), R, R), (Shard(d),), note="token")
                 for d in range(last) if x.shape[d] >= n]
        if out_features >= n:
            opts.append(AxisOption((R, Shard(0), Shard(0)), (Shard(last),), note="column"))
        if in_features >= n:
            opts.append(AxisOption((Shard(last), Shard(1), Partial()), (Partial(),), note="row"))
        return trim_options(opts, has_bias)

    return per_axis(mesh, options)


def trim_options(opts, has_bias):
    if has_bias:
        return opts
    return [AxisOption(o.inputs[:2], o.outputs, o.kernel, o.note) for o in opts]
