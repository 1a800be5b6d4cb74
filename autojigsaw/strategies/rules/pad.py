"""Rule for aten.pad and constant_pad_nd: shard a dim it does not pad, or one it pads, through halos.

A dim the padding leaves alone shards for free. A padded dim (constant, circular -- a weather
model's longitude --, reflect or replicate; negative amounts crop) shards through kernel
"halo_pad": each output row is one input row (or the constant), so each rank fetches the input
rows of its chunk of the padded output (rules/halo.py): the rank holding the first longitude
gets the last ones from the last rank for circular padding, its own mirrored rows for reflect.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard

from ...cost_model.compute import memory_time
from ...kernels import registry
from ...kernels.halo import halo_pad
from ...placements import local_shape
from . import halo
from .base import AxisOption, other_dims_split, per_axis, register

aten = torch.ops.aten
HALO_PAD = "halo_pad"
_MODES = ("constant", "circular", "reflect", "replicate")


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(node, mesh, candidates):
    x, y = node.args[0].meta["val"], node.meta["val"]
    padded, maps = _padded(node), _row_maps(node)

    batch_split = other_dims_split(x.shape, set(padded))

    def options(n):
        opts = batch_split(n)
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d),), kernel=HALO_PAD, note="rows and halos") for d in maps]
        return opts

    return [s for s in per_axis(mesh, options) if halo.one_axis_each(s.inputs[0], maps)
            and halo.nonempty(x.shape, y.shape, maps, mesh.sizes, s.inputs[0])]


def _mode(node) -> str:
    mode = (list(node.args) + [None] * 3)[2] if node.target is aten.pad.default else "constant"
    return mode or "constant"


def _padded(node) -> dict[int, tuple[int, int]]:
    """{dim: (rows added before, after)} of each dim the padding changes (pairs from the last dim)."""
    ndim, amounts = node.args[0].meta["val"].ndim, list(node.args[1])
    pairs = {ndim - 1 - k: (amounts[2 * k], amounts[2 * k + 1]) for k in range(len(amounts) // 2)}
    return {d: p for d, p in pairs.items() if p != (0, 0)}


def _source(mode: str, before: int, size: int):
    """Output row -> the input row it copies (outside 0..size-1: the constant)."""
    def source(j: int) -> int:
        i = j - before
        if mode == "circular":
            return i % size
        if mode == "reflect":
            return -i if i < 0 else 2 * (size - 1) - i if i >= size else i
        if mode == "replicate":
            return min(max(i, 0), size - 1)
        return i if 0 <= i < size else -1

    return source


def _row_maps(node) -> dict[int, halo.RowMap]:
    """{padded dim: every rank's wanted input rows for its chunk of the padded output}."""
    x = node.args[0].meta["val"]
    return {d: halo.mapped(_source(_mode(node), before, x.shape[d])) for d, (before, _) in _padded(node).items()}


def _halo_pad_call(node, sharding, rank, local_inputs):
    x, y = node.args[0].meta["val"], node.meta["val"]
    found = halo.fetches(x.shape, y.shape, sharding.inputs[0], _row_maps(node), rank.mesh.sizes)
    value = (list(node.args) + [None] * 4)[3 if node.target is aten.pad.default else 2]
    return halo_pad, (local_inputs[0], list(node.args[1])), dict(
        mode=_mode(node), value=value, fetches=halo.kernel_fetches(found, rank))


def _halo_pad_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """Writing the padded chunk (and its gradient's copy back), and the fetches."""
    x, y = node.args[0].meta["val"], node.meta["val"]
    backward = ctx.training and grad
    fetch, _ = halo.fetch_time(x, strategy.inputs[0], y.shape, _row_maps(node), ctx, backward)
    ys = local_shape(y.shape, strategy.outputs[0], ctx.mesh.sizes, ctx.coord0)
    t = float(memory_time(2 * math.prod(ys) * y.dtype.itemsize, ctx.device)) * (2 if backward else 1)
    return t + fetch, 0.0


registry.add(registry.Kernel(HALO_PAD, _halo_pad_call, halo.traffic, _halo_pad_cost))
