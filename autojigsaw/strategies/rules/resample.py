"""Rules for nearest and linear upsampling: shard a batch or channel dim, or the rows of a spatial one.

By a power of two s (1 / s is exact in floating point, so every rank computes the source
positions one device would), output row i of nearest upsampling copies input row i // s: where
every rank's output chunk is its input chunk repeated, it runs on the local rows (kernel
"local_upsample", which passes the local output size: the captured call's is the global one).
Otherwise, and for linear (bilinear, trilinear) upsampling by powers of two without
align_corners, kernel "halo_resample" fetches the input rows the chunk reads (rules/halo.py;
linear reads one more on each side, and past the edges torch clamps to the edge row, which the
fetch copies), upsamples them and keeps the chunk's rows. Linear resampling to any other size,
and with align_corners=True (U-Nets' bilinear upsampling) to any size, reads source rows at
positions no call on local rows reproduces (i x (in - 1) / (out - 1) with aligned corners,
(i + 0.5) x in / out - 0.5 without): the same kernel name fetches the rows each chunk reads and
interpolates its sharded dims itself at those positions (kernels/resize.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from ...cost_model.compute import memory_time
from ...kernels import registry
from ...kernels.halo import halo_resample
from ...kernels.resize import halo_resize
from ...placements import chunk_sizes, chunks_align, local_offset, local_shape
from . import halo
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
UPSAMPLE = "local_upsample"
HALO_RESAMPLE = "halo_resample"

_NEAREST = {aten.upsample_nearest1d.vec: 1, aten.upsample_nearest2d.vec: 2, aten.upsample_nearest3d.vec: 3}
_LINEAR = {aten.upsample_linear1d.vec: 1, aten.upsample_bilinear2d.vec: 2, aten.upsample_trilinear3d.vec: 3}


@register(*_NEAREST, *_LINEAR)
def upsample(node, mesh, candidates):
    x, y = node.args[0].meta["val"], node.meta["val"]
    scales = _scales(node)
    maps = _row_maps(node)
    first = x.ndim - len(_spatial(node))

    def options(n):
        opts = [AxisOption((R,), (R,))]
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d),), note="planes") for d in range(first) if x.shape[d] >= n]
            if node.target in _NEAREST:
                opts += [AxisOption((Shard(d),), (Shard(d),), kernel=UPSAMPLE, note="rows")
                         for d in scales if x.shape[d] >= n]
            opts += [AxisOption((Shard(d),), (Shard(d),), kernel=HALO_RESAMPLE, note="rows and halos") for d in maps]
        return opts

    def aligned(strategy) -> bool:
        """Does every sharded spatial dim hold its input rows repeated (no halo needed)?"""
        return all(chunks_align(y.shape[d], x.shape[d], s, [n for n, p in zip(mesh.sizes, strategy.inputs[0])
                                                            if p == Shard(d) and n > 1])
                   for d, s in scales.items())

    def keep(strategy) -> bool:
        if strategy.kernel == UPSAMPLE:
            return aligned(strategy)
        if strategy.kernel == HALO_RESAMPLE:
            if node.target in _NEAREST and aligned(strategy):
                return False  # local_upsample serves it without communication
            return (halo.one_axis_each(strategy.inputs[0], maps)
                    and halo.nonempty(x.shape, y.shape, maps, mesh.sizes, strategy.inputs[0]))
        return True

    return [s for s in per_axis(mesh, options) if keep(s)]


def _spatial(node) -> range:
    x = node.args[0].meta["val"]
    k = _NEAREST.get(node.target) or _LINEAR[node.target]
    return range(x.ndim - k, x.ndim)


def _scales(node) -> dict[int, int]:
    """{spatial dim: s} where the output is s x the input, s a power of two (and, for linear
    upsampling, align_corners is off)."""
    if node.target in _LINEAR and node.args[2]:
        return {}
    x, y = node.args[0].meta["val"], node.meta["val"]
    out = {d: y.shape[d] // x.shape[d] for d in _spatial(node) if y.shape[d] % x.shape[d] == 0}
    return {d: s for d, s in out.items() if s & (s - 1) == 0}


def _computed(node) -> bool:
    """Does the kernel compute the sharded dims' source positions itself (linear resampling with
    aligned corners, or to a size that is not a power of two of the input's)?"""
    return node.target in _LINEAR and (bool(node.args[2]) or len(_scales(node)) < len(_spatial(node)))


def _source_scales(node) -> dict[int, float]:
    """{spatial dim: the scale of its source positions}, as aten computes it."""
    x, y = node.args[0].meta["val"], node.meta["val"]
    factors = (list(node.args) + [None])[3]
    out = {}
    for k, d in enumerate(_spatial(node)):
        if node.args[2]:
            out[d] = (x.shape[d] - 1) / (y.shape[d] - 1) if y.shape[d] > 1 else 0.0
        elif factors and factors[k] > 0:
            out[d] = 1.0 / factors[k]
        else:
            out[d] = x.shape[d] / y.shape[d]
    return out


def _row_maps(node) -> dict[int, halo.RowMap]:
    """{dim the halo kernel shards: every rank's wanted input rows}."""
    x = node.args[0].meta["val"]
    if _computed(node):
        return {d: _linear_map(x.shape[d], _source(node, scale)) for d, scale in _source_scales(node).items()}
    return {d: _row_map(node, s, x.shape[d]) for d, s in _scales(node).items()}


def _source(node, scale: float):
    """Output row i's source position (aten rounds it in its own precision)."""
    if node.args[2]:
        return lambda i: i * scale
    return lambda i: max((i + 0.5) * scale - 0.5, 0.0)


def _linear_map(size: int, source) -> halo.RowMap:
    """Each rank's input rows: output row i reads rows floor(source(i)) and the next, and one more each
    side (clamped): the kernel's own rounding of the position may differ."""
    return halo.spans(lambda i: max(math.floor(source(i)) - 1, 0),
                      lambda i: min(math.floor(source(i)) + 2, size - 1) + 1)


def _row_map(node, scale: int, size: int) -> halo.RowMap:
    """Each rank's input rows: output row i reads row i // s (nearest) or its neighbours too (linear)."""
    extra = 1 if node.target in _LINEAR else 0

    def runs(out_sizes):
        starts = [sum(out_sizes[:r]) for r in range(len(out_sizes))]
        rows = [range(o // scale - extra, (o + n - 1) // scale + extra + 1) for o, n in zip(starts, out_sizes)]
        clamped = [[min(max(i, 0), size - 1) for i in r] for r in rows]
        return tuple(halo.mapped(lambda j, c=c: c[j])((len(c),))[0] for c in clamped)

    return runs


def _local_upsample(node, sharding, rank, local_inputs):
    """upsample_nearest to this rank's output chunk (the captured call may name the global size)."""
    y = node.meta["val"]
    size = local_shape(y.shape, sharding.outputs[0], rank.mesh.sizes, rank.coord)
    return node.target, (local_inputs[0], list(size[-len(_spatial(node)):]), None), {}


registry.add(registry.Kernel(UPSAMPLE, _local_upsample))


def _halo_call(node, sharding, rank, local_inputs):
    x, y = node.args[0].meta["val"], node.meta["val"]
    scales = _scales(node)
    found = halo.fetches(x.shape, y.shape, sharding.inputs[0], _row_maps(node), rank.mesh.sizes)
    out_size = tuple(y.shape[d] for d in _spatial(node))
    fetches = halo.kernel_fetches(found, rank)
    if _computed(node):
        kind = "corners" if node.args[2] else "half_pixel"
        rows = halo.computed_rows(kind, found, x.shape, y.shape, sharding.outputs[0], rank, _source_scales(node))
        # aten resamples the other dims with the call's scale factors, and copies the computed ones
        factors, computed = (list(node.args) + [None])[3], {d for d, *_ in found}
        aten_scales = [None if d in computed or not factors else factors[k] for k, d in enumerate(_spatial(node))]
        return halo_resize, (local_inputs[0],), dict(op=node.target.overloadpacket.default,
                                                     op_args=(node.args[2], *aten_scales), out_size=out_size,
                                                     fetches=fetches, rows=rows)
    offset = local_offset(y.shape, sharding.outputs[0], rank.mesh.sizes, rank.coord)
    extra = 1 if node.target in _LINEAR else 0
    crops = []
    for d, a, _, _ in found:
        first_row = offset[d] // scales[d] - extra  # the first fetched row, before clamping
        rows = chunk_sizes(y.shape[d], rank.mesh.sizes[a])[rank.coord[a]]
        crops.append((d, scales[d], offset[d] - scales[d] * first_row, rows))
    return halo_resample, (local_inputs[0],), dict(
        op=node.target, align_corners=node.args[2] if node.target in _LINEAR else None, out_size=out_size,
        fetches=fetches, crops=tuple(crops))


def _halo_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """Upsampling the fetched rows (reading them, writing s x as many; twice with the backward), and the fetches."""
    x, y = node.args[0].meta["val"], node.meta["val"]
    backward = ctx.training and grad
    fetch, fetched = halo.fetch_time(x, strategy.inputs[0], y.shape, _row_maps(node), ctx, backward)
    ys = local_shape(y.shape, strategy.outputs[0], ctx.mesh.sizes, ctx.coord0)
    grown = math.prod(ys) * math.prod(fetched) / max(math.prod(local_shape(x.shape, strategy.inputs[0],
                                                                              ctx.mesh.sizes, ctx.coord0)), 1)
    moved = (math.prod(fetched) + grown) * x.dtype.itemsize
    return float(memory_time(moved, ctx.device)) * (2 if backward else 1) + fetch, 0.0


registry.add(registry.Kernel(HALO_RESAMPLE, _halo_call, halo.traffic, _halo_cost))
