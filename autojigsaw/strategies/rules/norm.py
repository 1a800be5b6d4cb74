"""Rules for aten.layer_norm and aten.rms_norm: shard a free dim, the normalized dim, or replicate.

A free dim (batch, tokens) shards without communication. The last normalized dim (channels)
sharded over one mesh axis runs kernels/norm.py's sharded kernels, which all-reduce the row
statistics so every rank gets exactly its chunk of the single-device result; weight and bias
are then sharded like that dim. The kernels' builders, traffic and cost are registered here.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ...cost_model.compute import backward_factor, flops, roofline_time
from ...dtypes import acc_dtype
from ...ir import GLOBAL, PLACEMENTS, bytes_sent
from ...kernels import registry
from ...kernels.norm import sharded_layer_norm, sharded_rms_norm
from ...placements import local_shape
from .base import AxisOption, kernel_axis, per_axis, register

aten = torch.ops.aten
R = Replicate()
_KERNELS = {aten.layer_norm.default: "sharded_layer_norm",
            aten.rms_norm.default: "sharded_rms_norm"}
_PARAMS = {aten.layer_norm.default: (2, 3), aten.rms_norm.default: (2,)}  # weight, bias positions
# Row statistics all-reduced: (forward, each alone; backward, stacked into one all-reduce)
_STATS = {"sharded_layer_norm": (2, 2), "sharded_rms_norm": (1, 1)}


@register(aten.layer_norm.default, aten.rms_norm.default)
def norm(node, mesh, candidates):
    x = node.args[0].meta["val"]
    k = len(node.args[1])
    n_params = len(candidates) - 1
    last = Shard(x.ndim - 1)

    def options(n):
        opts = [AxisOption((R,) * (1 + n_params), (R,))]
        if n > 1:
            opts += [AxisOption((Shard(d),) + (R,) * n_params, (Shard(d),), note="rows")
                     for d in range(x.ndim - k) if x.shape[d] >= n]
            if x.shape[-1] >= n:
                opts.append(AxisOption((last,) + (Shard(k - 1),) * n_params, (last,),
                                       kernel=_KERNELS[node.target],
                                       note="normalized dim, exact statistics"))
        return opts

    # The kernel reduces its statistics over one axis: the normalized dim on one axis at most.
    return [s for s in per_axis(mesh, options) if list(s.inputs[0]).count(last) <= 1]


def _stat_axis(node: Node, strategy) -> int:
    """The mesh axis that shards the normalized dim (the kernel all-reduces over it)."""
    return kernel_axis(node, strategy.inputs[0], node.args[0].meta["val"].ndim - 1, strategy.kernel)


def _call(kernel, eps_at: int):
    """The builder of `kernel`: (x, global normalized_shape, weight[, bias][, eps]) and its axis."""

    def build(node, sharding, rank, local_inputs):
        inputs = iter(local_inputs[1:])
        args = list(node.args) + [None] * 4
        params = [next(inputs) if isinstance(args[i], Node) else None for i in _PARAMS[node.target]]
        eps = () if args[eps_at] is None else (args[eps_at],)  # absent: the kernel's default
        axis = rank.axis(_stat_axis(node, sharding))
        return kernel, (local_inputs[0], list(node.args[1]), *params, *eps), {"axis": axis}

    return build


def _stat_bytes(x_shape, normalized: int, dtype: torch.dtype) -> int:
    """Bytes of one row statistic per row of a local x, in the kernels' accumulation dtype."""
    return math.prod(x_shape[:len(x_shape) - normalized]) * acc_dtype(dtype).itemsize


def _traffic(kernel: str):
    forward, backward_stats = _STATS[kernel]

    def count(node, rank, backward):
        x = node.args[0]
        val = x.meta[GLOBAL]
        shape = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)
        nbytes = _stat_bytes(shape, len(node.args[1]), val.dtype)
        return stats_traffic((node.kwargs["axis"],), nbytes, forward, backward_stats, x in backward)

    return count


def stats_traffic(axes, nbytes: int, forward: int, backward_stats: int, grad: bool) -> list[tuple[str, int]]:
    """A norm kernel's bytes: on each of `axes` (MeshAxis), `forward` all-reduces of `nbytes` of
    statistics and, when x takes a gradient (the backward reduces only for it), one of `backward_stats` x that."""
    out = []
    for a in axes:
        out += [("all_reduce", bytes_sent("all_reduce", nbytes, a.size))] * forward
        if grad:
            out.append(("all_reduce", bytes_sent("all_reduce", backward_stats * nbytes, a.size)))
    return out


def stats_cost(node, strategy, ctx, grad: bool, axes, nbytes: int, forward: int, backward_stats: int):
    """(seconds, NaN) of a norm on local shards as the default estimate prices it, plus, on each of
    `axes`, `forward` all-reduces of `nbytes` of statistics and (backward) one of `backward_stats` x that."""
    x = node.args[0].meta["val"]
    shape = local_shape(x.shape, strategy.inputs[0], ctx.mesh.sizes, ctx.coord0)
    moved = 2 * math.prod(shape) * x.dtype.itemsize  # x in, y out
    local = float(roofline_time(flops(node.target, [shape], [shape]), moved, x.dtype, ctx.device, "norm"))
    backward = ctx.training and grad
    t = local * (1 + (backward_factor(node.target) if backward else 0))
    for a in axes:
        t += forward * ctx.collective_time("all_reduce", nbytes, a)
        if backward:
            t += ctx.collective_time("all_reduce", backward_stats * nbytes, a)
    return t, math.nan


def _cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The local norm, plus the all-reduces of row statistics."""
    x = node.args[0].meta["val"]
    shape = local_shape(x.shape, strategy.inputs[0], ctx.mesh.sizes, ctx.coord0)
    nbytes = _stat_bytes(shape, len(node.args[1]), x.dtype)
    forward, backward_stats = _STATS[strategy.kernel]
    return stats_cost(node, strategy, ctx, grad, (_stat_axis(node, strategy),), nbytes, forward, backward_stats)


registry.add(registry.Kernel("sharded_layer_norm", _call(sharded_layer_norm, 4), _traffic("sharded_layer_norm"), _cost))
registry.add(registry.Kernel("sharded_rms_norm", _call(sharded_rms_norm, 3), _traffic("sharded_rms_norm"), _cost))
