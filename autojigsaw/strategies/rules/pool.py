"""Rules for pooling: shard a batch or channel dim, or the windows of a spatial one.

These ops work on each (sample, channel) plane alone, so any leading dim shards for free. A
spatial dim shards:
  - for windows that tile the input (stride == kernel, no padding or dilation): no communication;
  - for other max and average pooling windows (a ResNet stem's 3x3 stride-2 max pool), ceil mode
    included, through kernel "halo_pool": each rank fetches the rows its output rows read
    (rules/halo.py), padded with -inf (max) or zeros (average, counting the padding);
  - for adaptive average pooling to one point (a classifier's global pooling), through kernel
    "partial_mean_pool": each rank pools its rows, weighted by its share, into a Partial sum; to
    more points (a pyramid pooling's 2, 3, 6), through kernel "halo_adaptive_pool", which fetches
    the rows of its output rows' windows (kernels/resize.py).
Adaptive max pooling, an average that does not count its padding, or one whose last ceil-mode
window runs past the padding changes the windows at the edges: they run batch- or
channel-sharded, or whole.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...cost_model.compute import memory_time
from ...kernels import registry
from ...kernels.halo import halo_pool
from ...kernels.pooling import partial_mean_pool
from ...kernels.resize import halo_resize
from ...placements import chunk_sizes, chunks_align, local_shape
from . import halo
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
HALO_POOL = "halo_pool"
PARTIAL_MEAN = "partial_mean_pool"
HALO_ADAPTIVE = "halo_adaptive_pool"

_MAX_POOLS = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3}
_AVG_POOLS = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
_ADAPTIVE_AVG = {aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
                 aten.adaptive_avg_pool3d.default: 3}
_ADAPTIVE = {**_ADAPTIVE_AVG, aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3}
_SPATIAL = {**_MAX_POOLS, **_AVG_POOLS, **_ADAPTIVE}


@register(*_SPATIAL)
def pool(node, mesh, candidates):
    x, y = node.args[0].meta["val"], node.meta["val"]
    y = y[0] if isinstance(y, (tuple, list)) else y
    spatial = range(x.ndim - _SPATIAL[node.target], x.ndim)
    windows = _tiling_windows(node, x.shape, y.shape, spatial)
    overlapping = {d: m for d, m in _pool_windows(node, spatial).items() if d not in windows}
    to_a_point = [d for d in spatial if node.target in _ADAPTIVE_AVG and y.shape[d] == 1]
    adaptive = _adaptive_windows(node, spatial)

    def options(n):
        opts = [AxisOption((R,), (R,) * _outputs(node))]
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d),) * _outputs(node), note="planes")
                     for d in range(spatial[0]) if x.shape[d] >= n]
            opts += [AxisOption((Shard(d),), (Shard(d),), note="whole windows")
                     for d in windows if min(x.shape[d], y.shape[d]) >= n]
            opts += [AxisOption((Shard(d),), (Shard(d),), kernel=HALO_POOL, note="rows and halos") for d in overlapping]
            opts += [AxisOption((Shard(d),), (Partial(),), kernel=PARTIAL_MEAN, note="rows, pooled shares summed")
                     for d in to_a_point]
            opts += [AxisOption((Shard(d),), (Shard(d),), kernel=HALO_ADAPTIVE, note="rows and halos")
                     for d in adaptive]
        return opts

    def tiles(strategy) -> bool:
        for d, window in windows.items():
            parts = [n for n, p in zip(mesh.sizes, strategy.inputs[0]) if p == Shard(d) and n > 1]
            if parts and not chunks_align(x.shape[d], y.shape[d], window, parts):
                return False
        return True

    def every_rank_holds_rows(strategy) -> bool:
        """Does every rank hold rows of each dim pooled to a point (its share is not zero)?"""
        return all(min(chunk_sizes(x.shape[p.dim], n)) > 0 for p, n in zip(strategy.inputs[0], mesh.sizes)
                   if isinstance(p, Shard) and p.dim in to_a_point)

    fetched = {**overlapping, **adaptive}
    return [s for s in per_axis(mesh, options) if tiles(s) and halo.one_axis_each(s.inputs[0], [*fetched, *to_a_point])
            and halo.nonempty(x.shape, y.shape, fetched, mesh.sizes, s.inputs[0]) and every_rank_holds_rows(s)]


def _outputs(node) -> int:
    return 2 if isinstance(node.meta["val"], (tuple, list)) else 1


def _tiling_windows(node, x_shape, y_shape, spatial) -> dict[int, int]:
    """{spatial dim: points of the finer side per point of the coarser} where windows tile it exactly."""
    if node.target not in _MAX_POOLS and node.target not in _AVG_POOLS:
        return {}
    kernel, stride, padding, dilation = _pool_args(node, len(spatial))
    if any(padding) or any(d != 1 for d in dilation):
        return {}
    # ceil mode adds no window where the windows tile the dim exactly
    return {d: k for d, k, s in zip(spatial, kernel, stride) if k == s and x_shape[d] == k * y_shape[d]}


def _pool_args(node, n: int):
    """(kernel, stride, padding, dilation) of a max or average pooling, one entry per dim (ceil mode
    needs none: the output size, which it sets, gives the windows)."""
    args = list(node.args) + [None] * 6
    kernel, stride, padding = (_per_dim(args[i], n) for i in (1, 2, 3))
    dilation = _per_dim(args[4], n) if node.target in _MAX_POOLS else []
    return kernel, stride or kernel, padding or [0] * n, dilation or [1] * n


def _pool_windows(node, spatial) -> dict[int, halo.RowMap]:
    """The input rows each output row of a max or average pooling reads, where fetching them and
    pooling unpadded gives the single-device result: not an average that leaves its padding out of
    the count or overrides the divisor, nor one whose last window (ceil mode) runs past the padding,
    where it divides by the rows inside only. A max pooling's windows past the end read -inf."""
    if node.target not in _MAX_POOLS and node.target not in _AVG_POOLS:
        return {}
    kernel, stride, padding, dilation = _pool_args(node, len(spatial))
    args = list(node.args) + [None] * 7
    counts_padding = node.target in _MAX_POOLS or ((args[5] is None or args[5]) and args[6] is None)
    if not (counts_padding or not any(padding)):
        return {}
    x, y = node.args[0].meta["val"], node.meta["val"]
    maps = {}
    for d, k, s, p, dil in zip(spatial, kernel, stride, padding, dilation):
        past_padding = s * (y.shape[d] - 1) + dil * (k - 1) - p > x.shape[d] - 1 + p
        if node.target in _MAX_POOLS or not past_padding:
            maps[d] = halo.windows(s, p, dil * (k - 1))
    return maps


def _adaptive_windows(node, spatial) -> dict[int, halo.RowMap]:
    """The input rows each output row of an adaptive average pooling to more than one point reads."""
    if node.target not in _ADAPTIVE_AVG:
        return {}
    x, y = node.args[0].meta["val"], node.meta["val"]
    maps = {}
    for d in spatial:
        size, out = x.shape[d], y.shape[d]
        if out > 1:
            maps[d] = halo.spans(lambda i, size=size, out=out: i * size // out,
                                 lambda i, size=size, out=out: -(-(i + 1) * size // out))
    return maps


def _fetched_rows(node, spatial) -> dict[int, halo.RowMap]:
    """The row maps of the dims a halo kernel of this pooling fetches."""
    return _adaptive_windows(node, spatial) if node.target in _ADAPTIVE_AVG else _pool_windows(node, spatial)


def _per_dim(v, n: int) -> list[int]:
    """A pooling argument as one entry per spatial dim ([] and None stay empty: the default)."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return []
    if isinstance(v, int):
        return [v] * n
    return list(v) * n if len(v) == 1 else list(v)


def _halo_pool_call(node, sharding, rank, local_inputs):
    x, y = node.args[0].meta["val"], node.meta["val"]
    spatial = range(x.ndim - _SPATIAL[node.target], x.ndim)
    found = halo.fetches(x.shape, y.shape, sharding.inputs[0], _pool_windows(node, spatial), rank.mesh.sizes)
    kernel, stride, padding, *_ = _pool_args(node, len(spatial))
    fill = float("-inf") if node.target in _MAX_POOLS else 0.0
    return halo_pool, (local_inputs[0], kernel, stride, padding, *node.args[4:]), dict(
        op=node.target, fetches=halo.kernel_fetches(found, rank), fill=fill)


def _halo_pool_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """Reading the fetched rows and writing the output (twice with the backward), and the fetches."""
    x, y = node.args[0].meta["val"], node.meta["val"]
    spatial = range(x.ndim - _SPATIAL[node.target], x.ndim)
    backward = ctx.training and grad
    fetch, fetched = halo.fetch_time(x, strategy.inputs[0], y.shape, _fetched_rows(node, spatial), ctx, backward)
    ys = local_shape(y.shape, strategy.outputs[0], ctx.mesh.sizes, ctx.coord0)
    moved = (math.prod(fetched) + math.prod(ys)) * x.dtype.itemsize
    t = float(memory_time(moved, ctx.device)) * (2 if backward else 1) + fetch
    return t, float(math.prod(fetched) * x.dtype.itemsize if backward else 0)


registry.add(registry.Kernel(HALO_POOL, _halo_pool_call, halo.traffic, _halo_pool_cost))


def _partial_mean_call(node, sharding, rank, local_inputs):
    x = node.args[0].meta["val"]
    mine = local_shape(x.shape, sharding.inputs[0], rank.mesh.sizes, rank.coord)
    pooled = {p.dim for p in sharding.inputs[0] if isinstance(p, Shard) and p.dim >= x.ndim - _SPATIAL[node.target]}
    share = math.prod(mine[d] / x.shape[d] for d in pooled)
    return partial_mean_pool, (local_inputs[0], node.args[1]), dict(op=node.target, share=share)


registry.add(registry.Kernel(PARTIAL_MEAN, _partial_mean_call))


def _halo_adaptive_call(node, sharding, rank, local_inputs):
    x, y = node.args[0].meta["val"], node.meta["val"]
    spatial = range(x.ndim - _SPATIAL[node.target], x.ndim)
    found = halo.fetches(x.shape, y.shape, sharding.inputs[0], _adaptive_windows(node, spatial), rank.mesh.sizes)
    rows = halo.computed_rows("window_means", found, x.shape, y.shape, sharding.outputs[0], rank, {})
    out_size = tuple(y.shape[d] for d in spatial)
    return halo_resize, (local_inputs[0],), dict(op=node.target, op_args=(), out_size=out_size,
                                                 fetches=halo.kernel_fetches(found, rank), rows=rows)


registry.add(registry.Kernel(HALO_ADAPTIVE, _halo_adaptive_call, halo.traffic, _halo_pool_cost))
