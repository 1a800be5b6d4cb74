"""Rules for aten.group_norm and instance_norm: shard the batch, the channels in whole groups, or the points.

GroupNorm (U-Nets, diffusion and weather models) normalizes each sample's channel groups over
their channels and spatial positions. A batch shard needs nothing; a channel shard whose chunks
hold whole groups needs nothing either: each rank normalizes its own groups exactly, with its
chunk of weight and bias, by calling group_norm with its local number of groups (the captured
call's count would split every local group again, a wrong answer). Spatial dims sharded over
mesh axes run kernels/norm.sharded_group_norm, which all-reduces each group's statistics over
those axes (two sums forward, one stacked pair backward per axis). InstanceNorm (nnU-Net and
style-transfer networks) is GroupNorm with a group per channel; with running statistics (which
it updates in place from the batch) it stays whole.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ...dtypes import acc_dtype
from ...ir import GLOBAL, PLACEMENTS
from ...kernels import registry
from ...kernels.norm import sharded_group_norm
from ...placements import local_shape
from .base import AxisOption, per_axis, register
from .norm import stats_cost, stats_traffic

aten = torch.ops.aten
R = Replicate()
WHOLE_GROUPS = "group_norm_whole_groups"
POINTS = "sharded_group_norm"


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
        if n > 1:
            opts += [AxisOption((Shard(d),) + (R,) * n_params, (Shard(d),), kernel=POINTS, note="points")
                     for d in range(2, x.ndim) if x.shape[d] >= n]
        return opts

    def whole_groups(strategy) -> bool:
        shards = math.prod(n for n, p in zip(mesh.sizes, strategy.inputs[0]) if p == Shard(1))
        return groups % shards == 0

    return [s for s in per_axis(mesh, options) if whole_groups(s)]


@register(aten.instance_norm.default)
def instance_norm(node: Node, mesh, candidates):
    x = node.args[0].meta["val"]
    n_params = len(candidates) - 1
    running = (list(node.args) + [None] * 5)[3] is not None

    def options(n):
        opts = [AxisOption((R,) * (1 + n_params), (R,))]
        if n == 1 or running:
            return opts
        if x.shape[0] >= n:
            opts.append(AxisOption((Shard(0),) + (R,) * n_params, (Shard(0),), note="samples"))
        if x.shape[1] >= n:
            opts.append(AxisOption((Shard(1),) + (Shard(0),) * n_params, (Shard(1),), note="channels"))
        return opts + [AxisOption((Shard(d),) + (R,) * n_params, (Shard(d),), kernel=POINTS, note="points")
                       for d in range(2, x.ndim) if x.shape[d] >= n]

    return per_axis(mesh, options)


def _groups(node: Node) -> int:
    """The groups of a captured group_norm or instance_norm node (one per channel)."""
    return node.args[0].meta["val"].shape[1] if node.target is aten.instance_norm.default else node.args[1]


def _build(node: Node, sharding, rank, local_inputs):
    """group_norm on this rank's channels, with the number of groups they hold."""
    x, groups = node.args[0].meta["val"], node.args[1]
    channels = local_shape(x.shape, sharding.inputs[0], rank.mesh.sizes, rank.coord)[1]
    inputs = iter(local_inputs[1:])
    weight, bias = (next(inputs) if isinstance(a, Node) else None for a in (list(node.args) + [None] * 4)[2:4])
    eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    return aten.group_norm.default, (local_inputs[0], channels * groups // x.shape[1], weight, bias, eps), {}


registry.add(registry.Kernel(WHOLE_GROUPS, _build))


def _stat_axes(placements) -> tuple[int, ...]:
    """The mesh axes that shard a spatial dim: the group statistics are summed over them."""
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim >= 2)


def _points(node: Node, sharding, rank, local_inputs):
    """sharded_group_norm on this rank's points, the statistics summed over the axes that shard them."""
    x, args = node.args[0].meta["val"], list(node.args) + [None] * 8
    instance = node.target is aten.instance_norm.default
    inputs = iter(local_inputs[1:])
    weight, bias = (next(inputs) if isinstance(a, Node) else None for a in (args[1:3] if instance else args[2:4]))
    eps = args[7] if instance else args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    groups = _groups(node)
    axes = tuple(rank.axis(a) for a in _stat_axes(sharding.inputs[0]))
    return sharded_group_norm, (local_inputs[0], groups, weight, bias, eps), {"spatial": tuple(x.shape[2:]),
                                                                              "axis": axes}


def _stat_bytes(x_shape, groups: int, dtype) -> int:
    """Bytes of one statistic of every (sample, group) of a local x, in the accumulation dtype."""
    return x_shape[0] * groups * acc_dtype(dtype).itemsize


def _traffic(node: Node, rank, backward) -> list[tuple[str, int]]:
    """Bytes of a rewritten sharded_group_norm node: (x, groups, weight, bias, eps)."""
    x = node.args[0]
    val = x.meta[GLOBAL]
    shape = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)
    nbytes = _stat_bytes(shape, node.args[1], val.dtype)
    # the mean, then the variance around it; dx's two sums at once
    return stats_traffic(node.kwargs["axis"], nbytes, 2, 2, x in backward)


def _cost(node: Node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The local norm, plus the statistics' all-reduces."""
    x = node.args[0].meta["val"]
    shape = local_shape(x.shape, strategy.inputs[0], ctx.mesh.sizes, ctx.coord0)
    nbytes = _stat_bytes(shape, _groups(node), x.dtype)
    return stats_cost(node, strategy, ctx, grad, _stat_axes(strategy.inputs[0]), nbytes, 2, 2)


registry.add(registry.Kernel(POINTS, _points, _traffic, _cost))
