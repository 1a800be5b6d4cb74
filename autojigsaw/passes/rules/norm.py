"""Rules for aten.layer_norm: shard any dim outside the normalized ones, or replicate.

Normalizing over a sharded dim needs statistics from every rank: that is the
sharded_layer_norm kernel's strategy (kernels/norm.py), added with that kernel.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from . import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()


@register(aten.layer_norm.default)
def layer_norm(node, mesh, candidates):
    x = node.args[0].meta["val"]
    free_dims = x.ndim - len(node.args[1])
    n_params = len(candidates) - 1

    def options(n):
        opts = [AxisOption((R,) * (1 + n_params), (R,))]
        if n > 1:
            opts += [AxisOption((Shard(d),) + (R,) * n_params, (Shard(d),))
                     for d in range(free_dims) if x.shape[d] >= n]
        return opts

    return per_axis(mesh, options)
