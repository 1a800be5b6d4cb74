"""Rule for aten.group_norm: shard the batch, or the channels in whole groups, or replicate.

GroupNorm (U-Nets, diffusion and weather models) normalizes each sample's channel groups over
their channels and spatial positions. A batch shard needs nothing; a channel shard whose chunks
hold whole groups needs nothing either: each rank normalizes its own groups exactly, with its
chunk of weight and bias, by calling group_norm with its local number of groups (the captured
call's count would split every local group again, a wrong answer). Spatial dims would need the
statistics all-reduced and are left whole.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ...kernels import registry
from ...placements import local_shape
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
WHOLE_GROUPS = "group_norm_whole_groups"


@register(aten.group_norm.default)
def group_norm(node: Node, mesh, candidates):
    x, groups = node.args[0].meta["val"], node.args[1]
    n_params = len(candidates) - 1

    def options(n):
        opts = [AxisOption((R,) * (1 + n_params), (R,))]
        if n > 1 and x.shape[0] >= n:
            opts.append(AxisOption((Shard(0),) + (R,) * n_params, (Shard(0),), note="samples"))
        if n > 1 and groups % n == 0:
            opts.append(AxisOption((Shard(1),) + (Shard(0),) * n_params, (Shard(1),), kernel=WHOLE_GROUPS,
                                   note="channels, whole groups"))
        return opts

    def whole_groups(strategy) -> bool:
        shards = math.prod(n for n, p in zip(mesh.sizes, strategy.inputs[0]) if p == Shard(1))
        return groups % shards == 0

    return [s for s in per_axis(mesh, options) if whole_groups(s)]


def _build(node: Node, spec, rank, local_inputs):
    """group_norm on this rank's channels, with the number of groups they hold."""
    x, groups = node.args[0].meta["val"], node.args[1]
    channels = local_shape(x.shape, spec.inputs[0], rank.mesh.sizes, rank.coord)[1]
    inputs = iter(local_inputs[1:])
    weight, bias = (next(inputs) if isinstance(a, Node) else None for a in (list(node.args) + [None] * 4)[2:4])
    eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    return aten.group_norm.default, (local_inputs[0], channels * groups // x.shape[1], weight, bias, eps), {}


registry.add(registry.Kernel(WHOLE_GROUPS, _build))
