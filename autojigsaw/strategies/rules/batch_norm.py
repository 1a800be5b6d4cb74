"""Rule for BatchNorm in training (aten._native_batch_norm_legit_functional): shard channels, or the
batch and points with the statistics summed over the ranks (SyncBatchNorm), or replicate.

Each channel is normalized over every sample and point, and its running averages updated from
those statistics. A channel shard needs nothing (its weight, bias and running averages shard
alike). A batch or spatial shard runs kernels/norm.sharded_batch_norm, which all-reduces each
channel's statistics over the axes that shard them: two sums for the output, two more for the
running averages (forward, one stacked pair backward, per axis). DTensor's own rule offers the
channel shard alone.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ...dtypes import acc_dtype
from ...ir import GLOBAL
from ...kernels import registry
from ...kernels.norm import sharded_batch_norm
from ...placements import local_shape
from .base import AxisOption, per_axis, register
from .norm import stats_cost, stats_traffic

aten = torch.ops.aten
R = Replicate()
SYNC = "sharded_batch_norm"
_OP = aten._native_batch_norm_legit_functional.default


@register(_OP)
def batch_norm(node: Node, mesh, candidates):
    x = node.args[0].meta["val"]
    params = len(candidates) - 1  # weight, bias, running mean, running var (those given)
    training = node.args[5]

    def options(n):
        opts = [AxisOption((R,) * (1 + params), (R,) * 5)]
        if n == 1:
            return opts
        if x.shape[1] >= n:
            opts.append(AxisOption((Shard(1),) + (Shard(0),) * params, (Shard(1),) + (Shard(0),) * 4, note="channels"))
        if training:
            opts += [AxisOption((Shard(d),) + (R,) * params, (Shard(d),) + (R,) * 4, kernel=SYNC, note="points")
                     for d in range(x.ndim) if d != 1 and x.shape[d] >= n]
        return opts

    return [s for s in per_axis(mesh, options) if _no_empty_shard(x.shape, s.inputs[0], mesh)]


def _no_empty_shard(shape, placements, mesh) -> bool:
    """Does every rank hold some of x? (torch.chunk leaves the last ranks none when a dim is small,
    and batch norm refuses an empty input.)"""
    return all(min(local_shape(shape, placements, mesh.sizes, coord)) > 0
               for coord in itertools.product(*map(range, mesh.sizes)))


def _stat_axes(placements) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim != 1)


def _build(node: Node, sharding, rank, local_inputs):
    x = node.args[0].meta["val"]
    inputs = iter(local_inputs[1:])
    weight, bias, running_mean, running_var = (next(inputs) if isinstance(a, Node) else None for a in node.args[1:5])
    momentum, eps = node.args[6], node.args[7]
    count = math.prod(x.shape) // x.shape[1]
    axes = tuple(rank.axis(a) for a in _stat_axes(sharding.inputs[0]))
    return sharded_batch_norm, (local_inputs[0], weight, bias, running_mean, running_var, momentum, eps), {
        "count": count, "axis": axes}


def _stat_bytes(channels: int, dtype) -> int:
    return channels * acc_dtype(dtype).itemsize


def _traffic(node: Node, rank, backward) -> list[tuple[str, int]]:
    """Bytes of a rewritten sharded_batch_norm node: (x, weight, bias, running mean, running var, ...)."""
    x = node.args[0]
    val = x.meta[GLOBAL]
    # mean and variance, for the output and the running averages
    return stats_traffic(node.kwargs["axis"], _stat_bytes(val.shape[1], val.dtype), 2, 2, x in backward)


def _cost(node: Node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The local norm, plus the statistics' all-reduces (two forward, which the running averages reuse)."""
    x = node.args[0].meta["val"]
    return stats_cost(node, strategy, ctx, grad, _stat_axes(strategy.inputs[0]), _stat_bytes(x.shape[1], x.dtype), 2, 2)


registry.add(registry.Kernel(SYNC, _build, _traffic, _cost))
